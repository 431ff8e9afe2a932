"""The first run on GPUs, rehearsed on the CPU: every tensor a lesson hands to a collective carries the rank's
device, and every process group a lesson creates waits its --timeout.

NCCL serves CUDA tensors only; gloo takes CPU tensors, and on a CPU-only machine the rank's device is the CPU:
a tensor made without `device=` passes every CPU run and fails the first GPU run at that collective (lesson
21's `torch.zeros(())` on the ranks without the last stage did, at its closing broadcast).  Here every lesson
with collectives runs at 2 ranks, in a quick configuration, under tests/device_check/sitecustomize.py: each
tensor that the repository's code makes without the rank's device is marked (torch's own tensors, DDP's,
FSDP2's, DCP's, DTensor's and the pipeline's, are not), the mark follows it through ops on marked tensors
only, and a marked tensor reaching a collective ends the rank with one line naming the call and where the
tensor was made ("... would be on the CPU on a GPU run; NCCL refuses it").  Lesson 0's group is gloo by
design (its line names "gloo"), and so is lesson 16's saver group: their CPU tensors are right on a GPU node.
Checked by hand: lesson 21 before its fix failed here with "dist.broadcast at day4/21_pipeline_parallel.py:141
got a tensor made at day4/21_pipeline_parallel.py:120 (torch.zeros without the rank's device)".

The same runs record, when each rank ends its groups, the timeout of every group it holds (the seconds its
backend waits: what torch enforces): lesson 20's mesh groups and lesson 16's saver group wait --timeout like
the default group.  Checked by hand: before lesson 20's `backend_override` and lesson 16's `timeout=` they
waited torch's default (torch 2.14.1's new_group: 1800 s with gloo, 600 s with NCCL), and this test failed.
"""
import json
import os
import textwrap

import pytest

from conftest import PYTHON, REPO, lesson, run

SITE = REPO / "tests" / "device_check"
VIT = ("--train-samples", "640", "--seed", "5", "--loader", "memory", "--width", "32", "--depth", "2")
DAY3 = (*VIT, "--batch-size", "16", "--max-steps", "2", "--heads", "2")
DAY4 = (*VIT, "--batch-size", "16", "--max-steps", "2", "--heads", "4")  # 2 heads a rank
# name: (script, arguments, launcher); "{run_dir}" and "{checkpoints}" are filled in; every run at 2 ranks
RUNS = {
    "0": ("day1/0_torch_dist.py", ("--nproc", "2"), "self"),
    "3": ("day1/3_mnist_distributed.py", ("--max-steps", "5", "--nproc", "2"), "self"),
    "4": ("day1/4_mnist_manual_ddp.py", ("--max-steps", "5", "--sync", "flat", "--nproc", "2"), "self"),
    "6": ("day1/6_mnist_ddp_pt.py", ("--max-steps", "5", "--nproc", "2"), "self"),
    "10": ("day2/10_mnist_ddp_pt_multinode.py", ("--quick", "--max-steps", "5"), "torchrun"),
    "12": ("day2/12_ddp_fault_tolerance.py", ("--quick", "--max-steps", "4", "--checkpoint-every", "2",
                                              "--checkpoint-dir", "{checkpoints}", "--nproc", "2"), "self"),
    "13": ("day3/13_mixed_precision.py", (*DAY3, "--precision", "fp16", "--overflow-at", "2", "--nproc", "2"), "self"),
    "14": ("day3/14_accumulation_checkpointing.py", (*DAY3, "--accumulate", "2", "--checkpoint-activations",
                                                     "--nproc", "2"), "self"),
    "15": ("day3/15_fsdp2.py", (*DAY3, "--nproc", "2"), "self"),
    # a checkpoint at step 2, then resumed from it (every rank's intact-share vote) with asynchronous saves
    "16": ("day3/16_distributed_checkpoint.py", (*DAY3, "--checkpoint-every", "2", "--checkpoint-dir",
                                                 "{checkpoints}", "--nproc", "2"), "self"),
    "16 resumed": ("day3/16_distributed_checkpoint.py", (*DAY3[:-4], "--max-steps", "4", *DAY3[-2:],
                                                         "--checkpoint-every", "2", "--resume", "--async-save",
                                                         "thread", "--checkpoint-dir", "{checkpoints16}",
                                                         "--nproc", "2"), "self"),
    "17": ("day3/17_debugging_hangs.py", ("--train-samples", "320", "--batch-size", "16", "--epochs", "1",
                                          "--save-every", "3", "--loader", "memory", "--nproc", "2"), "self"),
    "18": ("day4/18_hardware_limits.py", (*DAY4, "--sizes-mib", "0.25", "--nproc", "2"), "self"),  # its sweep
    "19": ("day4/19_tensor_parallel.py", (*DAY4, "--nproc", "2"), "self"),
    "20": ("day4/20_device_mesh_2d.py", (*DAY4, "--nproc", "2"), "self"),  # a 1 x 2 mesh
    "21": ("day4/21_pipeline_parallel.py", (*VIT, "--batch-size", "32", "--max-steps", "2", "--heads", "2",
                                            "--schedule", "1f1b", "--microbatches", "4", "--nproc", "2"), "self"),
    "22": ("day5/22_gpt_pretraining.py", ("--max-steps", "2", "--width", "32", "--hidden", "64", "--seq-len", "32",
                                          "--sample-tokens", "5", "--layout", "fsdp-tp", "--nproc", "2"), "self"),
    # lesson 22's model (the run above), fine-tuned
    "23": ("day5/23_hf_finetuning.py", ("--max-steps", "2", "--seq-len", "96", "--answer-tokens", "5",
                                        "--model-dir", "{hf22}", "--nproc", "2"), "self"),
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory, dataset):
    """checked(name): RUNS[name] under the device check, run once: (its process, its groups' timeouts)."""
    root, done = tmp_path_factory.mktemp("device_check"), {}

    def get(name: str):
        if name not in done:
            if name in ("16 resumed", "23"):
                get({"16 resumed": "16", "23": "22"}[name])
            script, args, launcher = RUNS[name]
            run_dir, timeouts = root / name.replace(" ", "_"), root / f"{name.replace(' ', '_')}.timeouts.jsonl"
            fill = {"{run_dir}": run_dir, "{checkpoints}": run_dir / "checkpoints",
                    "{checkpoints16}": root / "16" / "checkpoints", "{hf22}": root / "22" / "hf"}
            args = [str(fill.get(a, a)) for a in args]
            if RUNS[name][0] != "day1/0_torch_dist.py":
                args += ["--run-dir", str(run_dir)]
            env = {"COURSE_DEVICE_CHECK": "1", "COURSE_GROUP_TIMEOUTS": str(timeouts),
                   "PYTHONPATH": os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)}
            proc = lesson(script, *args, launcher=launcher, nproc=2, env=env, check=False, timeout=300)
            lines = [json.loads(line) for line in timeouts.read_text().splitlines()] if timeouts.exists() else []
            done[name] = proc, lines
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_every_tensor_a_lesson_hands_to_a_collective_carries_the_rank_device(checked, name):
    proc, _ = checked(name)
    refused = sorted({line.split("error: ", 1)[-1] for line in proc.stderr.splitlines() if "device check:" in line})
    assert not refused, "\n".join(refused)
    assert proc.returncode == 0, f"{RUNS[name][0]} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert name != "16 resumed" or "resumed from" in proc.stdout, proc.stdout  # the ranks' vote on the shares ran


@pytest.mark.slow
@pytest.mark.parametrize("name, groups", [("20", {"default_pg", "mesh_dp"}),  # mesh_tp: the default's ranks
                                          ("22", {"default_pg", "mesh_dp"}),  # a 1 x 2 mesh, as lesson 20's
                                          ("16 resumed", {"default_pg", "undefined"})])  # undefined: the saver's
def test_every_group_a_lesson_creates_waits_its_timeout(checked, name, groups):
    proc, timeouts = checked(name)
    assert proc.returncode == 0, proc.stderr
    assert {t["rank"] for t in timeouts} == {0, 1} and groups <= {t["group"] for t in timeouts}, timeouts
    waits = {(t["rank"], t["group"]): t["timeout"] for t in timeouts if t["timeout"] != t["default"]}
    assert not waits, f"groups that do not wait the lesson's --timeout ({timeouts[0]['default']} s): {waits}"


PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    import torch.distributed as dist

    backend, device = sys.argv[1], torch.device("cpu")
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())  # NCCL on a GPU node
    saver = dist.new_group(backend="gloo")  # gloo on a GPU node too


    def in_device_context():
        with torch.device(device):
            made = torch.zeros(2)
        dist.all_reduce(made)


    cases = {
        "bare": lambda: dist.all_reduce(torch.zeros(2)),
        "derived": lambda: dist.broadcast(torch.stack([torch.zeros(()) * 2, torch.zeros(()).detach()]), src=0),
        "cpu()": lambda: dist.all_reduce(torch.ones(2, device=device).cpu()),
        "in a list": lambda: dist.all_gather([torch.zeros(1, device=device)], torch.zeros(1)),
        "device": lambda: dist.all_reduce(torch.zeros(2, device=device)),
        "moved": lambda: dist.all_reduce(torch.tensor([1.0, 2.0]).to(device)),
        "from numpy, moved": lambda: dist.all_reduce(torch.from_numpy(np.ones(2)).to(device)),
        "with a device tensor": lambda: dist.all_reduce(torch.stack([torch.zeros((), device=device),
                                                                     torch.tensor(1.0)])),
        "like, with device": lambda: dist.all_reduce(torch.zeros_like(torch.tensor([1.0]), device=device)),
        "in torch.device": in_device_context,
        "torch's own": lambda: dist.all_reduce(torch.nn.utils.get_total_norm([])),
        "gloo group": lambda: dist.all_reduce(torch.zeros(2), group=saver),
    }
    for name, case in cases.items():
        try:
            case()
            print(f"{name}: passed")
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}")
    dist.destroy_process_group()  # left to the interpreter's exit, gloo's threads once aborted it (exit -6)
""")


def test_the_device_check_refuses_a_tensor_made_without_the_rank_device_and_passes_the_others(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    out = run([PYTHON, tmp_path / "probe.py", "gloo"], timeout=120, env={
        "COURSE_DEVICE_CHECK": "1", "COURSE_DEVICE_CHECK_ROOT": str(tmp_path), "PYTHONPATH": str(SITE)}).stdout
    said = dict(line.split(": ", 1) for line in out.splitlines())
    line = {text.split('"')[1]: i + 1 for i, text in enumerate(PROBE.splitlines()) if text.startswith('    "')}
    assert said["bare"] == (f"DeviceCheckError: device check: dist.all_reduce at probe.py:{line['bare']} got a "
                            f"tensor made at probe.py:{line['bare']} (torch.zeros without the rank's device): it "
                            f"would be on the CPU on a GPU run; NCCL refuses it"), said["bare"]
    assert "dist.broadcast" in said["derived"] and "torch.zeros without" in said["derived"], said
    assert "Tensor.cpu()" in said["cpu()"] and "dist.all_gather at" in said["in a list"], said
    assert {name for name, what in said.items() if what == "passed"} == set(line) - {"bare", "derived", "cpu()",
                                                                                     "in a list"}, said
