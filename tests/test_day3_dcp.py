"""Lesson 16 (distributed checkpoints), run for real: gloo, the CPU, a tiny ViT (width 32, depth 2).

The same global batch everywhere (64: 4 ranks x 16 or 2 ranks x 32), so that a run saved at one world size
and resumed at another takes the same global batches as the uninterrupted run.

Bounds, measured on 2026-11-24 (the numbers are next to each assertion):
- saved by 4 ranks at step 3, resumed by 2 to step 6; saved by those 2 at step 4, resumed by 4 to step 6:
  the relative difference of the whole weight vector from the uninterrupted 4-rank run at most 1e-6 (~8
  float32 ulps); measured 2.3e-8 (4 -> 2) and 2.0e-8 (2 -> 4), against 0.116 that the 6 steps moved the
  weights.  Not bit for bit: at another world size the reduce_scatter and the clip's norm add in another
  order.  Resumed at the same world size (2 -> 2 from step 4): bit for bit.
  Checked by hand: with the optimizer's state left out of dcp.load the two differences are 0.050 and 0.056
  and the same-world-size check fails too.
- a published checkpoint with one shard file cut short, and a temporary directory never published: both
  skipped, said so, the run resumes from the newest complete one.
- bytes flipped in place (same size, so every size still matches) in a shard (__0_0.distcp), in .metadata
  and in complete.json: each of these checkpoints is skipped with one line naming the file, by the rank whose
  share of the files it is (complete.json: rank 0, which lists the checkpoints), and the run resumes from
  the newest intact one; with none intact, --resume ends with one line and exit 1, before any rank loads.
  Before digests, the flipped .metadata was the newest complete checkpoint and was loaded.
- the export (one process) skips the damaged checkpoints, holds the trained weights bit for bit and gives
  the same predictions on all 10,000 test images as the run's own model.pt; with none intact it refuses
  in one line.
- bad input is one line; a checkpoint already at --max-steps leaves nothing to train (one line, exit 0).
Checked by hand too: without the nothing-to-train exit and without --resume if-any's fallback, their two
tests fail.
Measured here (2 cores): the 15 tests, the Slurm one included, in 62 s with a load average of 5 from other
programs (the 4 shared runs: 41 s; the two-node Slurm run: 11 s); the 14 others in 55-58 s when idle.  The
digest checks added one launch (no checkpoint intact: the ranks end before training) and one in-process
case; the 17 tests without Slurm took 217 s with a load average of 10-20 from other programs (the shared
runs 155 s, the new launch 31 s), not measured idle.
"""
import shutil

import pytest
import torch

from conftest import PYTHON, REPO, lesson, metrics, run
from course.training.output import load_weights

pytestmark = pytest.mark.slow
SCRIPT = "day3/16_distributed_checkpoint.py"
COMMON = ["--train-samples", "640", "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5", "--loader", "memory",
          "--width", "32", "--depth", "2", "--heads", "2", "--max-steps", "6", "--checkpoint-every", "3"]
BATCH = {2: ["--batch-size", "32"], 4: ["--batch-size", "16"]}
EQUAL = 1e-6


def vector(path) -> torch.Tensor:
    w = load_weights(path)
    return torch.cat([w[k].flatten() for k in sorted(w)])


def relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def start_from(source_dir, step, target):
    """A checkpoint directory holding one checkpoint of an earlier run, as if that run had stopped there."""
    target.mkdir(parents=True)
    shutil.copytree(source_dir / f"step-{step:09d}", target / f"step-{step:09d}")
    return target


def flip(path, count=64):
    """`count` bytes in the middle of a file inverted in place: the same size, other bytes (a failing disk)."""
    with open(path, "r+b") as f:
        data = f.read()
        middle = len(data) // 2
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data[middle:middle + count]))
    assert path.stat().st_size == len(data)


def flipped_copy(source, target, name):
    """A copy of the checkpoint directory `source` as `target`, with bytes flipped in its file `name`."""
    shutil.copytree(source, target)
    flip(target / name)
    return target


class _OnFirstRead(dict):
    """runs[name]: (run dir, stdout), run when a test first reads it (the quick tier reads only w4 and r42)."""

    def __init__(self, makers):
        super().__init__()
        self.makers = makers

    def __missing__(self, name):
        self[name] = self.makers[name]()
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset):
    """Four runs share the work, each run when a test first reads it:
    - w4: 6 steps uninterrupted at W = 4 (sync saves at steps 3 and 6);
    - r42: W = 2 (async saves), resumed from w4's step 3 in a directory that also holds a step-6 checkpoint
      with a shard file cut short, an unfinished temporary directory, and copies of w4's step 6 as steps 7,
      8 and 9 with bytes flipped in __0_0.distcp, .metadata and complete.json; saves at steps 4 and 6;
    - r24: W = 4, resumed from r42's step 4 (saved by 2 ranks); compared with w4;
    - r22: W = 2, resumed from r42's step 4; compared with r42, which trained on from step 4 at W = 2."""
    root = tmp_path_factory.mktemp("dcp")
    torn = root / "dir42"

    def go(name, w, *extra):
        proc = lesson(SCRIPT, *COMMON, *BATCH[w], "--nproc", str(w), "--run-dir", root / name, *map(str, extra))
        return root / name, proc.stdout

    def r42():
        ckpt4 = out["w4"][0] / "checkpoints"
        start_from(ckpt4, 3, torn)
        shutil.copytree(ckpt4 / "step-000000006", torn / "step-000000006")
        shard = torn / "step-000000006" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])  # a copy cut short
        (torn / ".step-000000009.123.tmp").mkdir()  # a save that never finished
        (torn / ".step-000000009.123.tmp" / "__0_0.distcp").write_bytes(b"half")
        for step, name in ((7, "__0_0.distcp"), (8, ".metadata"), (9, "complete.json")):  # newer, same sizes
            flipped_copy(ckpt4 / "step-000000006", torn / f"step-{step:09d}", name)
        return go("r42", 2, "--resume", "--async-save", "--checkpoint-every", "2", "--checkpoint-dir", torn)

    def from_r42_step_4(name, w):
        out["r42"]  # noqa: B018 (its step 4 is what they resume from)
        return go(name, w, "--resume", "--checkpoint-dir", start_from(torn, 4, root / f"dir{name[1:]}"))

    out = _OnFirstRead({"w4": lambda: go("w4", 4), "r42": r42, "r24": lambda: from_r42_step_4("r24", 4),
                        "r22": lambda: from_r42_step_4("r22", 2)})
    return out


@pytest.mark.parametrize("resumed, uninterrupted, at", [pytest.param("r42", "w4", 3, marks=pytest.mark.quick("16")),
                                                      ("r24", "w4", 4)])
def test_resumed_at_another_world_size_ends_with_the_uninterrupted_weights(runs, resumed, uninterrupted, at):
    """Measured 2026-11-24: 2.3e-8 (4 -> 2), 2.0e-8 (2 -> 4) (bound 1e-6)."""
    r, u = runs[resumed][0], runs[uninterrupted][0]
    rel = relative(vector(r / "model.pt"), vector(u / "model.pt"))
    moved = relative(vector(u / "model.pt"), initial_vector())
    print(f"{resumed} against {uninterrupted}: relative weight difference {rel:.3g} (training moved them {moved:.3g})")
    assert rel <= EQUAL, rel
    mr, mu = metrics(r), metrics(u)
    assert mr["first_step"] == at and mr["steps"] == 6 and mr["resumed_from"].endswith(f"step-{at:09d}")
    saved_by = 6 - mr["world_size"]  # 4 -> 2, 2 -> 4
    assert mr["world_size"] != saved_by and mr["global_batch_size"] == mu["global_batch_size"] == 64
    assert mr["loss_per_step"] == pytest.approx(mu["loss_per_step"][at:], rel=1e-5)
    assert f"saved by {saved_by} ranks): step {at}" in runs[resumed][1]
    assert f"steps {at + 1} to 6 ({6 - at} steps) in" in runs[resumed][1]


def initial_vector() -> torch.Tensor:
    from course.models import ViT

    torch.manual_seed(5)
    w = ViT(7, 32, 2, 2).state_dict()
    return torch.cat([w[k].flatten() for k in sorted(w)])


def test_resumed_at_the_same_world_size_is_bit_for_bit(runs):
    assert metrics(runs["r22"][0])["first_step"] == 4
    assert torch.equal(vector(runs["r22"][0] / "model.pt"), vector(runs["r42"][0] / "model.pt"))


def test_a_torn_or_unfinished_checkpoint_is_skipped(runs):
    from course.checkpoints import dcp as ckpt

    out = runs["r42"][1]
    directory = metrics(runs["r42"][0])["resumed_from"].rsplit("/", 1)[0]
    assert (f"skipping checkpoint {directory}/step-000000006 (torn or invalid: __1_0.distcp has 1000 bytes"
            in out), out
    assert f"skipping unfinished checkpoint {directory}/.step-000000009.123.tmp (never published" in out
    # the resumed run published its own step 6 in place of the torn one, and left no temporary directory
    from pathlib import Path

    assert ckpt.damage(Path(directory) / "step-000000006") is None
    assert not list(Path(directory).glob(".step-*"))


def test_bytes_flipped_in_place_are_found_by_the_rank_whose_share_they_are(runs):
    """Resumed at W = 2, the 5 files of a 4-rank checkpoint are shared by name: rank 0 hashes .metadata,
    __1_0 and __3_0, rank 1 __0_0 and __2_0; rank 0 alone reads complete.json when it lists them."""
    out = runs["r42"][1]
    directory = metrics(runs["r42"][0])["resumed_from"].rsplit("/", 1)[0]
    for rank, step, says in ((1, 7, "__0_0.distcp: its sha256 differs from the one in complete.json"),
                             (0, 8, ".metadata: its sha256 differs from the one in complete.json"),
                             (0, 9, "complete.json unreadable")):
        line = f"[rank {rank}] skipping checkpoint {directory}/step-{step:09d} (torn or invalid: {says}"
        assert out.count(line) == 1, out
        assert out.count(f"step-{step:09d} (torn") == 1, out  # one line for each, from one rank
    assert metrics(runs["r42"][0])["resumed_from"] == f"{directory}/step-000000003"


def test_with_no_intact_checkpoint_left_resume_ends_in_one_line(runs, tmp_path):
    """The only checkpoint has bytes flipped in __1_0.distcp (rank 0's share at W = 2): the ranks agree that
    nothing is intact, rank 0 says so once, every rank ends, nothing is loaded, trained or written."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    flipped_copy(runs["w4"][0] / "checkpoints" / "step-000000003", directory / "step-000000003", "__1_0.distcp")
    ran = lesson(SCRIPT, *COMMON, *BATCH[2], "--nproc", "2", "--resume", "--checkpoint-dir", directory,
                 "--run-dir", tmp_path / "run", check=False)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert ran.stdout.count(f"[rank 0] skipping checkpoint {directory}/step-000000003 (torn or invalid: "
                            f"__1_0.distcp: its sha256 differs") == 1, ran.stdout
    said = [line for line in ran.stderr.splitlines() if "no checkpoint in" in line]
    assert said == [f"[rank 0] error: --resume: no checkpoint in {directory} is intact (each is named above); "
                    f"remove the damaged ones, or start a new run with another --checkpoint-dir"], ran.stderr
    assert "Traceback" not in ran.stderr and "resumed from" not in ran.stdout
    assert not (tmp_path / "run" / "metrics.json").exists() and [p.name for p in directory.iterdir()] == ["step-000000003"]


def test_every_save_is_published_and_its_stall_measured(runs):
    for name, kind, steps in (("w4", "dcp.save", (3, 6)), ("r42", "dcp.async_save", (4, 6))):
        m = metrics(runs[name][0])
        assert [p.rsplit("/", 1)[1] for p in m["checkpoints"]] == [f"step-{s:09d}" for s in steps]
        assert len(m["save_stall_seconds"]) == 2 and f"checkpoints: 2 with {kind}" in runs[name][1]
        # the stall's parts: the wait for the previous save, then the call, which holds async_save's copy
        for stall, wait, call, copy in zip(*(m[f"save_{k}_seconds"] for k in ("stall", "wait", "call", "copy"))):
            assert wait + call <= stall and 0 <= copy <= call and (copy > 0) == (kind == "dcp.async_save"), m
        print(f"{name} ({kind}): the loop waited {[round(s * 1000, 1) for s in m['save_stall_seconds']]} ms per save")


def test_the_export_is_one_ordinary_file_with_the_same_predictions(runs, tmp_path):
    """From r42's directory: its damaged steps 9, 8 and 7 are named and skipped, its own step 6 exported."""
    from course.models import ViT
    from data_tools.datasets import InMemoryMNIST

    run_dir = runs["r42"][0]
    directory = metrics(run_dir)["resumed_from"].rsplit("/", 1)[0]
    ran = run([PYTHON, REPO / SCRIPT, "--export", tmp_path / "model.pt", "--checkpoint-dir", directory])
    for step, file in ((9, "complete.json unreadable"), (8, ".metadata: its sha256"), (7, "__0_0.distcp: its sha256")):
        assert f"skipping checkpoint {directory}/step-{step:09d} (torn or invalid: {file}" in ran.stdout, ran.stdout
    assert "exported the model of step-000000006 (saved by 2 ranks)" in ran.stdout, ran.stdout + ran.stderr
    exported = torch.load(tmp_path / "model.pt", weights_only=True)  # plain tensors only
    trained = torch.load(run_dir / "model.pt", weights_only=True)
    assert sorted(exported) == sorted(trained) and all(torch.equal(exported[k], trained[k]) for k in trained)
    m = metrics(run_dir)
    test_set = InMemoryMNIST(m["dataset"], "test", None, torch.device("cpu"))
    predictions = []
    for state in (exported, trained):
        model = ViT(7, 32, 2, 2)
        model.load_state_dict(state)
        with torch.no_grad():
            predictions.append(model.eval()(test_set.images).argmax(1))
    assert torch.equal(*predictions)
    assert (predictions[0] == test_set.labels).float().mean().item() == pytest.approx(m["test_accuracy"], abs=1e-6)


@pytest.mark.parametrize("args, says", [
    (["--resume", "--checkpoint-dir", "{tmp}/none"], "--resume: the checkpoint dir {tmp}/none does not exist"),
    (["--resume", "--checkpoint-dir", "{w4}", "--width", "64"], "is of another model (--width 32 -> 64)"),
    (["--resume", "--checkpoint-dir", "{w4}", "--nproc", "2", "--batch-size", "16"],
     "was trained with global batch 64 (4 ranks), this run's is 32; resume at 2 ranks with --batch-size 32"),
    (["--resume", "--checkpoint-dir", "{w4}", "--nproc", "3", "--batch-size", "16"],
     "this run's is 48; 64 does not divide among 3 replicas: resume at a world size that divides 64"),
    (["--checkpoint-dir", "{w4}"], "already holds checkpoints; add --resume"),
    (["--resume", "if-any", "--checkpoint-dir", "{torn}"], "already holds checkpoints; none of them is complete"),
    (["--export", "{tmp}/x.pt", "--checkpoint-dir", "{tmp}/none"], "--export: the checkpoint dir {tmp}/none does"),
    (["--export", "{tmp}/x.pt", "--checkpoint-dir", "{flipped}"], "--export: {flipped} holds no intact checkpoint"),
    # an intact checkpoint, exported where no file can be written (before: a FileNotFoundError, a
    # FileExistsError or an IsADirectoryError traceback once the checkpoint had been read)
    (["--export", "/proc/no/such/x.pt", "--checkpoint-dir", "{w4}"],
     "--export /proc/no/such/x.pt cannot be written (No such file or directory)"),
    (["--export", "{w4}/step-000000003/.metadata/x.pt", "--checkpoint-dir", "{w4}"],
     "--export {w4}/step-000000003/.metadata/x.pt cannot be written ({w4}/step-000000003/.metadata is a file)"),
    (["--export", "{tmp}", "--checkpoint-dir", "{w4}"], "--export {tmp} cannot be written (it is a directory)"),
])
def test_bad_input_is_one_line(runs, args, says, tmp_path, capsys, monkeypatch):
    from as_main import run_as_main

    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    fill = {"tmp": tmp_path, "w4": runs["w4"][0] / "checkpoints", "torn": tmp_path / "torn",
            "flipped": tmp_path / "flipped"}
    (tmp_path / "torn" / "step-000000003").mkdir(parents=True)  # a directory without complete.json
    if "{flipped}" in args:  # its only checkpoint with bytes flipped in one shard
        flipped_copy(fill["w4"] / "step-000000003", tmp_path / "flipped" / "step-000000003", "__2_0.distcp")
    args = [a.format(**fill) for a in args]
    code = run_as_main([REPO / SCRIPT, *COMMON[:-4], *args, "--run-dir", tmp_path / "r"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and says.format(**fill) in lines[0], (code, lines)
    assert not (tmp_path / "r").exists() and not (tmp_path / "none").exists() and not (tmp_path / "x.pt").exists()


def test_a_checkpoint_at_the_last_step_leaves_nothing_to_train(runs, tmp_path, capsys, monkeypatch):
    """The same command run again after the run has ended (a job submitted twice): one line, exit 0."""
    from as_main import run_as_main

    for var in ("WORLD_SIZE", "SLURM_NTASKS", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    directory = runs["w4"][0] / "checkpoints"
    code = run_as_main([REPO / SCRIPT, *COMMON, *BATCH[4], "--nproc", "4", "--resume", "if-any",
                        "--checkpoint-dir", directory, "--run-dir", tmp_path / "r"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 1, (code, out)
    assert out[0] == (f"nothing to train: the newest checkpoint in {directory} is at step 6 (epoch 0) and this run "
                      f"ends at --max-steps 6; raise it to train on, or --export the checkpoint")
    assert not (tmp_path / "r").exists()


@pytest.mark.slurm
def test_two_nodes_resume_and_save_as_one_node_does(slurm_cluster, runs):
    """srun over 2 nodes x 2 ranks resumes the one-node W = 4 run's step-3 checkpoint (each rank reads its
    shards across the nodes' shared directory), trains to step 6 and saves: the same weights as the one-node
    uninterrupted run (measured 0.0, bit for bit; bound 1e-6) and a complete checkpoint."""
    from course.checkpoints import dcp as ckpt

    work = slurm_cluster.workdir / "lesson16"
    directory = start_from(runs["w4"][0] / "checkpoints", 3, work / "checkpoints")
    ran = slurm_cluster.run(["srun", "--nodes=2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", PYTHON, "-u",
                             str(REPO / SCRIPT), *COMMON, *BATCH[4], "--resume", "--async-save",
                             "--checkpoint-dir", str(directory), "--run-dir", str(work / "run")], timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    m = metrics(work / "run")
    assert m["world_size"] == 4 and m["first_step"] == 3 and m["steps"] == 6
    rel = relative(vector(work / "run" / "model.pt"), vector(runs["w4"][0] / "model.pt"))
    print(f"lesson 16, 2 nodes resumed vs 1 node uninterrupted: relative weight difference {rel:.3g}")
    assert rel <= EQUAL, rel
    assert ckpt.damage(directory / "step-000000006") is None
