"""Lesson 23 (fine-tuning a Hugging Face model), run for real: gloo, the CPU, a model that `transformers` built
and saved (tests/hf_model.py: LlamaForCausalLM, width 32, depth 2, 4 heads, MLP hidden 64, its norms drawn away
from 1), 6 AdamW steps on prompt/response pairs of 96 tokens.  `transformers` runs in this process, offline.

- transformers -> the course: the held-out loss every run measured on the model as loaded (sharded over 1, 2, 4
  ranks) is the loss transformers computes from its own logits on the same pairs, within float32 rounding
  (measured: equal to 7 digits in one process, 1e-7 relative sharded); lesson 22's model, loaded by 2 ranks
  and saved with no step between, is written back bit for bit, with SHA256SUMS that hold.
- the course -> transformers: the fine-tuned directory loads with AutoModelForCausalLM.from_pretrained, and its
  logits are the course GPT's on the same weights (measured: equal, bit for bit); its held-out loss is the one
  the lesson reported (within 1e-6 relative).
- FSDP2 at 2 and 4 ranks fine-tunes what one process fine-tunes on the same global batch: weights within 1e-5
  relative (measured 3.0e-8 and 2.8e-8 after 6 steps), every step's loss within 1e-5 relative: the masked loss's mean
  is over the whole global batch's response tokens.
- the pitfall: without model.reshard() after the no_grad evaluation, the optimizer holds the root's gathered
  parameters, the root's shards are never stepped (bit for bit as loaded) and the run ends elsewhere (measured 3.8e-2 relative from one process, against 3.0e-8), with
  nothing said.
- the masked loss counts the response's tokens and its END only.
"""
import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from catalogue import Runs
from conftest import REPO
from course.checkpoints import hf
from course.gpt import GPT
from course.training.output import load_weights
from data_tools import instructions

pytestmark = pytest.mark.slow
SEQ_LEN = 96
EQUAL = 1e-5


@pytest.fixture(scope="module")
def runs(catalogue):
    return Runs(catalogue, "23: ")


def weights(model_dir) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


def vector(w: dict) -> torch.Tensor:
    return torch.cat([w[k].flatten() for k in sorted(w)])


def relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def held_out():
    _, held, _ = instructions.load(SEQ_LEN)
    return (torch.stack(t) for t in zip(*[held[i] for i in range(len(held))]))


def transformers_loss(model_dir):
    """(transformers' held-out loss of the model in model_dir, its logits on the held-out inputs)."""
    from transformers import AutoModelForCausalLM

    x, y = held_out()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=instructions.IGNORE).item(), logits


@pytest.mark.quick("23")
@pytest.mark.parametrize("layout", ["fsdp2", "fsdp4"])
def test_fsdp2_fine_tunes_what_one_process_fine_tunes(runs, layout):
    one, _ = runs["one"]
    other, out = runs[layout]
    diff = relative(vector(weights(other / "hf")), vector(weights(one / "hf")))
    print(f"\n{layout}: weights against one process after 6 steps: {diff:.2e} relative")
    assert diff < EQUAL, out
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (one, other))
    assert a["global_batch_rows"] == b["global_batch_rows"] == 16 and b["world_size"] == int(layout[-1])
    assert len(b["loss_per_step"]) == 6
    for x, y in zip(a["loss_per_step"], b["loss_per_step"]):
        assert abs(x - y) <= EQUAL * abs(x), (a["loss_per_step"], b["loss_per_step"])
    assert b["heldout_loss"] < b["heldout_loss_before"]  # it learned something from the pairs


def test_a_model_transformers_saved_loads_into_the_sharded_model_with_its_loss(runs, catalogue):
    theirs, _ = transformers_loss(catalogue("23: transformers' model").run_dir / "hf")
    for name in ("one", "fsdp2", "fsdp4"):
        before = json.loads((runs[name][0] / "metrics.json").read_text())["heldout_loss_before"]
        print(f"{name}: held-out loss as loaded {before:.7f}, transformers {theirs:.7f}")
        assert before == pytest.approx(theirs, rel=1e-6)


def test_the_fine_tuned_directory_loads_into_transformers_with_the_same_logits(runs):
    run_dir, _ = runs["fsdp2"]
    out = run_dir / "hf"
    assert hf.verify_digests(out)  # SHA256SUMS there, and it holds
    assert not (out / "sharded").exists() and not (run_dir / "hf.partial").exists()
    theirs, their_logits = transformers_loss(out)
    model = GPT(**hf.sizes_of(out))
    model.load_state_dict(weights(out))
    x, _ = held_out()
    with torch.no_grad():
        ours = model(x)
    print(f"\nlogits: largest difference {(ours - their_logits).abs().max().item():.2e}")
    torch.testing.assert_close(ours, their_logits, rtol=1e-5, atol=1e-5)
    reported = json.loads((run_dir / "metrics.json").read_text())["heldout_loss"]
    assert reported == pytest.approx(theirs, rel=1e-6)


def test_lesson_22s_model_loaded_and_saved_without_a_step_is_written_back_bit_for_bit(catalogue):
    lesson22 = catalogue("22: one").run_dir
    ran = catalogue("23: lesson 22's model, unchanged")
    saved, written = load_weights(lesson22 / "model.pt"), weights(ran.run_dir / "hf")
    assert sorted(saved) == sorted(written)
    assert all(torch.equal(saved[k], written[k]) for k in saved)
    assert hf.verify_digests(lesson22 / "hf") and hf.verify_digests(ran.run_dir / "hf")
    assert "after 0 steps" in ran.stdout


def test_without_reshard_after_the_no_grad_evaluation_training_drifts_silently(runs, catalogue):
    one, _ = runs["one"]
    pitfall, out = runs["pitfall"]
    fine, _ = runs["fsdp2"]
    reference = vector(weights(one / "hf"))
    drift = relative(vector(weights(pitfall / "hf")), reference)
    kept = relative(vector(weights(fine / "hf")), reference)
    print(f"\nwithout reshard: {drift:.2e} relative from one process; with it: {kept:.2e}")
    assert drift > 100 * EQUAL > 100 * kept
    assert "warn" not in out.lower()  # nothing says so
    assert json.loads((pitfall / "metrics.json").read_text())["resharded"] is False
    # why: the optimizer held the root's gathered copies, so the root's shards (embedding, final norm, head)
    # were never stepped, while the blocks were
    loaded, stuck = weights(catalogue("23: transformers' model").run_dir / "hf"), weights(pitfall / "hf")
    trained = weights(fine / "hf")
    root = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    assert all(torch.equal(stuck[k], loaded[k]) and not torch.equal(trained[k], loaded[k]) for k in root)
    assert not any(torch.equal(stuck[k], loaded[k]) for k in loaded if k not in root)


def lesson():
    spec = importlib.util.spec_from_file_location("lesson23", REPO / "day5" / "23_hf_finetuning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_row_masks_the_prompt_and_the_padding_and_keeps_the_response_and_its_end():
    x, y = instructions.row("Q: a?\nA: ", "yes.", 24)
    assert bytes(x[:13].tolist()) == b"Q: a?\nA: yes." and x.shape == y.shape == (24,)
    kept = [(i, int(t)) for i, t in enumerate(y) if t != instructions.IGNORE]
    assert kept == [(8, ord("y")), (9, ord("e")), (10, ord("s")), (11, ord(".")), (12, 0)]  # "yes." and END
    assert bytes(x[13:].tolist()) == bytes(11)  # padding: END


def test_the_masked_loss_is_the_mean_over_the_global_batchs_response_tokens(monkeypatch):
    """Two ranks with 3 and 1 response tokens: each backs a loss whose average over the 2 replicas is the
    mean over the 4 tokens; the lesson's all_reduce is replaced by the sum over both ranks here."""
    module = lesson()
    torch.manual_seed(0)
    logits = [torch.randn(1, 4, 256), torch.randn(1, 4, 256)]
    targets = [torch.tensor([[5, 6, 7, -100]]), torch.tensor([[-100, -100, 9, -100]])]
    sums = [F.cross_entropy(l[0], t[0], ignore_index=-100, reduction="sum") for l, t in zip(logits, targets)]
    both = torch.stack([sums[0] + sums[1], torch.tensor(4.0)])
    monkeypatch.setattr(module.dist, "all_reduce", lambda t, *a, **k: t.copy_(both))
    backed = [module.masked_loss(l, t, 2, torch.device("cpu")) for l, t in zip(logits, targets)]
    mean = (sums[0] + sums[1]) / 4
    assert (backed[0][0] + backed[1][0]) / 2 == pytest.approx(mean.item(), rel=1e-6)  # what FSDP2's average backs
    assert backed[0][1].item() == pytest.approx(mean.item(), rel=1e-6)  # what the lesson reports
    per_rank = (sums[0] / 3 + sums[1] / 1) / 2  # a mean per rank weighs rank 1's one token three times
    assert abs(per_rank - mean) > 0.1
