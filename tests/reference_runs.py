"""The reference runs: every lesson configuration that tests assert on, by name, each launched once per test
session (tests/catalogue.py says how).  A test reads one with the `catalogue` fixture:

    def test_lesson4_equals_one_process(catalogue):
        one, ddp = catalogue("2: 30 steps, batch 64"), catalogue("4: per-param, 2 x 32")

To add a lesson's reference run: one line here, `"N: what it is": Ref(SCRIPT, (ARGS...), launcher, nproc)`,
with "{run_dir}" where the run writes its outputs.  A name says the lesson's number first, then what sets the run apart.
"""
from dataclasses import replace

from catalogue import Ref

L2, L3, L4, L6 = ("day1/2_mnist_training.py", "day1/3_mnist_distributed.py", "day1/4_mnist_manual_ddp.py",
                  "day1/6_mnist_ddp_pt.py")
EQUAL = ("--max-steps", "30", "--seed", "3")  # lessons 2, 4 and 6 on the same global batch of 64
LESSON10 = ("--quick", "--max-steps", "25", "--seed", "3")  # lesson 10 on one node and on two

RUNS = {
    # lesson 0: every rank all_reduces its rank and prints the mean
    "0: 2 ranks, own launcher": Ref("day1/0_torch_dist.py", ("--nproc", "2")),
    # lesson 1 on a machine without a visible GPU: the notice and the gloo path
    "1: 2 ranks, own launcher": Ref("day1/1_torch_dist_gpu.py", ("--nproc", "2")),
    "1: 2 ranks, torchrun": Ref("day1/1_torch_dist_gpu.py", (), "torchrun", 2),
    # lesson 2: the single-process baseline
    "2: one epoch": Ref(L2, ("--epochs", "1", "--run-dir", "{run_dir}")),
    "2: 40 steps": Ref(L2, ("--max-steps", "40", "--run-dir", "{run_dir}")),
    "2: 30 steps, batch 64": Ref(L2, (*EQUAL, "--batch-size", "64", "--run-dir", "{run_dir}")),
    "2: 30 steps, batch 32": Ref(L2, (*EQUAL, "--batch-size", "32", "--run-dir", "{run_dir}")),
    # lesson 3: N copies of lesson 2's 40 steps
    "3: 40 steps, 2 ranks, own launcher": Ref(L3, ("--max-steps", "40", "--run-dir", "{run_dir}", "--nproc", "2")),
    "3: 40 steps, 2 ranks, torchrun": Ref(L3, ("--max-steps", "40", "--run-dir", "{run_dir}"), "torchrun", 2),
    # lessons 4 and 6: W ranks x b = one process on the global batch of 64
    "4: per-param, 2 x 32": Ref(L4, (*EQUAL, "--sync", "per-param", "--batch-size", "32", "--run-dir", "{run_dir}",
                                     "--nproc", "2")),
    "4: flat, 2 x 32": Ref(L4, (*EQUAL, "--sync", "flat", "--batch-size", "32", "--run-dir", "{run_dir}",
                                "--nproc", "2")),
    "4: per-param, 4 x 16": Ref(L4, (*EQUAL, "--sync", "per-param", "--batch-size", "16", "--run-dir", "{run_dir}",
                                     "--nproc", "4")),
    "6: 2 x 32": Ref(L6, (*EQUAL, "--batch-size", "32", "--run-dir", "{run_dir}", "--nproc", "2")),
    "6: 4 x 16": Ref(L6, (*EQUAL, "--batch-size", "16", "--run-dir", "{run_dir}", "--nproc", "4")),
    # lesson 10 on one node, against two nodes (two local torchrun agents; the real two-node Slurm)
    **{f"10: {n} ranks, torchrun": Ref("day2/10_mnist_ddp_pt_multinode.py", (*LESSON10, "--run-dir", "{run_dir}"),
                                       "torchrun", n) for n in (2, 4)},
}


def plan(prefix: str, script: str, common: tuple, entries: dict) -> dict:
    """{prefix + short: Ref} for runs of one lesson that share `common` arguments.  entries: short -> (launcher,
    nproc, extra arguments[, script]); the command is SCRIPT COMMON [--nproc N] EXTRA --run-dir DIR, as the tests
    typed it before the catalogue."""
    refs = {}
    for short, (launcher, nproc, extra, *other) in entries.items():
        nprocs = ("--nproc", str(nproc)) if launcher == "self" else ()
        refs[prefix + short] = Ref(other[0] if other else script, (*common, *nprocs, *extra, "--run-dir", "{run_dir}"),
                                   launcher, nproc)
    return refs


# lesson 13 (tests/test_day3_precision.py): one step each in fp32 (torchrun), bf16 and fp16; two fp16 steps with an
# inf in rank 1's loss at step 2; one fp32 step of the compiled model (tens of seconds of compiling on a CPU)
PRECISION = ("--train-samples", "640", "--batch-size", "16", "--seed", "5", "--lr", "1.0", "--clip-grad-norm", "0.05",
             "--loader", "memory", "--width", "32", "--depth", "2", "--heads", "2")
RUNS.update(plan("13: ", "day3/13_mixed_precision.py", PRECISION, {
    "fp32": ("torchrun", 2, ("--precision", "fp32", "--max-steps", "1")),
    "bf16": ("self", 2, ("--precision", "bf16", "--max-steps", "1")),
    "fp16": ("self", 2, ("--precision", "fp16", "--max-steps", "1")),
    "overflow": ("self", 2, ("--precision", "fp16", "--max-steps", "2", "--overflow-at", "2", "--overflow-rank", "1")),
    "compiled": ("self", 2, ("--precision", "fp32", "--max-steps", "1", "--compile")),
}))

# lesson 14 (tests/test_day3_accumulation.py): a global batch of 32 four ways, and k = 1 at micro-batch 8
ACCUMULATION = ("--train-samples", "640", "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5", "--max-steps", "4",
                "--loader", "memory", "--width", "32", "--depth", "2", "--heads", "2", "--precision", "fp32")
RUNS.update(plan("14: ", "day3/14_accumulation_checkpointing.py", ACCUMULATION, {
    "k2": ("torchrun", 2, ("--batch-size", "8", "--accumulate", "2")),
    "k1": ("self", 2, ("--batch-size", "16",)),
    "k1_b8": ("self", 2, ("--batch-size", "8", "--max-steps", "2")),
    "one": ("self", 1, ("--batch-size", "32",)),
    "k2_checkpointed": ("self", 2, ("--batch-size", "8", "--accumulate", "2", "--checkpoint-activations")),
}))

# lesson 15 (tests/test_day3_fsdp.py): lesson 13's DDP in fp32 at W = 2 and 4 against FSDP2
FSDP = ("--train-samples", "640", "--batch-size", "16", "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5",
        "--max-steps", "4", "--loader", "memory", "--width", "32", "--depth", "2", "--heads", "2")
RUNS.update(plan("15: ", "day3/15_fsdp2.py", FSDP, {
    "ddp2": ("self", 2, ("--precision", "fp32"), "day3/13_mixed_precision.py"),
    "ddp4": ("self", 4, ("--precision", "fp32"), "day3/13_mixed_precision.py"),
    "fsdp2": ("torchrun", 2, ()),
    "fsdp2_keep": ("self", 2, ("--reshard-after-forward", "false")),
    "fsdp4": ("self", 4, ()),
    "fsdp2_bf16": ("self", 2, ("--precision", "bf16", "--reduce-dtype", "bf16")),
}))

# lessons 18-20 (tests/test_day4.py): one process (lesson 18 at --nproc 1), tensor parallel at T = 2 and 4, the
# 2 x 2 meshes with the same global batch of 32
DAY4 = ("--train-samples", "640", "--batch-size", "32", "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5",
        "--max-steps", "4", "--loader", "memory", "--width", "32", "--depth", "2", "--heads", "4",
        "--precision", "fp32")
HARDWARE = "day4/18_hardware_limits.py"
RUNS.update(plan("18-20: ", "day4/19_tensor_parallel.py", DAY4, {
    "one": ("self", 1, ("--sizes-mib", "0.25"), HARDWARE),  # lesson 18's sweep, at one size: 19 and 20 price their own
    "tp1": ("self", 1, ()),  # a mesh of one rank: nothing cut, nothing sent
    "tp2": ("torchrun", 2, ()),
    "tp4": ("self", 4, ()),
    "fsdp-tp": ("self", 4, ("--batch-size", "16"), "day4/20_device_mesh_2d.py"),
    "hsdp": ("torchrun", 4, ("--batch-size", "8", "--layout", "hsdp"), "day4/20_device_mesh_2d.py"),
}))

# lesson 21 (tests/test_day4_pipeline.py): one process (lesson 18, depth 4) and the schedules, 40 ms a stage
PIPELINE = ("--train-samples", "640", "--batch-size", "32", "--seed", "5", "--lr", "0.5", "--clip-grad-norm", "0.5",
            "--max-steps", "5", "--loader", "memory", "--width", "32", "--depth", "4", "--heads", "4",
            "--precision", "fp32")
STAGE_MS = 40  # long against what the bubble's formula leaves out (~5-10 ms a slot here, more under load)
PIPELINE_PLAN = {"gpipe-p2-m2": ("gpipe", 2, 2, "self"), "gpipe-p2-m4": ("gpipe", 2, 4, "self"),
                 "1f1b-p2-m4": ("1f1b", 2, 4, "self"), "1f1b-p4-m4": ("1f1b", 4, 4, "torchrun"),
                 "1f1b-p4-m8": ("1f1b", 4, 8, "self"), "interleaved-1f1b-p2-m4": ("interleaved-1f1b", 2, 4, "self")}
RUNS.update(plan("21: ", "day4/21_pipeline_parallel.py", PIPELINE, {
    "one": ("self", 1, ("--sizes-mib", "0.25"), HARDWARE),
    **{name: (launcher, p, ("--schedule", schedule, "--microbatches", str(m), "--stage-ms", str(STAGE_MS)))
       for name, (schedule, p, m, launcher) in PIPELINE_PLAN.items()},
}))

# lesson 17 (tests/test_day3_hangs.py): the healthy run and the three bugs, each ended by its 3 s timeout.  shape
# asks for NCCL, as on a GPU node: the repros run on the CPU with gloo whatever is asked.
HANG_TIMEOUT_S = 3
HANGS = ("--train-samples", "320", "--batch-size", "16", "--epochs", "1", "--save-every", "3",
         "--timeout", str(HANG_TIMEOUT_S), "--loader", "memory")
HANG_PLAN = {"none": ("self", "none", ()), "skip": ("self", "skip", ()), "uneven": ("torchrun", "uneven", ()),
             "shape": ("self", "shape", ("--backend", "nccl"))}
RUNS.update({f"17: {name}": Ref("day3/17_debugging_hangs.py",
                                (*HANGS, *more, "--bug", bug, "--run-dir", "{run_dir}"),  # --nproc 2: its default
                                launcher, 2, timeout=120, returncode=None)
             for name, (launcher, bug, more) in HANG_PLAN.items()})

# lesson 22 (tests/test_day5.py): one process with the global batch of 16 rows, and each layout with the same
# global batch: FSDP2 at 2 (torchrun) and 4 ranks, FSDP2 x TP with sequence parallelism on a 1 x 2 and a 2 x 2 mesh,
# activation checkpointing and compile with FSDP2 at 2 and at 4 ranks, bf16 in one process, with FSDP2 at 2 ranks
# and on the 2 x 2 mesh; 20 and 60 steps at 2 ranks, uninterrupted, for the runs that a signal stops and --resume
# continues (to step 20 here, to step 60 under the test Slurm)
GPT = ("--max-steps", "6", "--warmup-steps", "2", "--seed", "5", "--width", "32", "--depth", "2", "--heads", "4",
       "--hidden", "64", "--seq-len", "32", "--eval-rows", "64", "--sample-tokens", "30")
RUNS.update(plan("22: ", "day5/22_gpt_pretraining.py", GPT, {
    "one": ("self", 1, ("--batch-size", "16")),
    "fsdp2": ("torchrun", 2, ("--batch-size", "8")),
    "fsdp4": ("self", 4, ("--batch-size", "4")),
    "fsdp-tp 1x2": ("torchrun", 2, ("--batch-size", "16", "--layout", "fsdp-tp")),
    "fsdp-tp 2x2": ("self", 4, ("--batch-size", "8", "--layout", "fsdp-tp")),
    "checkpointed": ("self", 2, ("--batch-size", "8", "--checkpoint-activations")),
    "checkpointed 4": ("self", 4, ("--batch-size", "4", "--checkpoint-activations")),
    "compiled": ("self", 2, ("--batch-size", "8", "--compile")),
    "compiled 4": ("self", 4, ("--batch-size", "4", "--compile")),
    "bf16 one": ("self", 1, ("--batch-size", "16", "--precision", "bf16")),
    "bf16 fsdp2": ("self", 2, ("--batch-size", "8", "--precision", "bf16")),
    "bf16 fsdp-tp 2x2": ("self", 4, ("--batch-size", "8", "--layout", "fsdp-tp", "--precision", "bf16")),
    "fsdp2, 20 steps": ("self", 2, ("--batch-size", "8", "--max-steps", "20")),  # stopped, resumed: against it
    "fsdp2, 60 steps": ("self", 2, ("--batch-size", "8", "--max-steps", "60")),  # the same on the test Slurm
}))

# lesson 23 (tests/test_day5_hf.py): a model transformers built and saved (tests/hf_model.py), fine-tuned by one
# process with the global batch of 16 pairs and by FSDP2 at 2 (torchrun) and 4 ranks with the same global batch;
# the pitfall (no reshard after the no_grad evaluation) at 2 ranks; lesson 22's model loaded and saved unchanged
FINETUNE = ("--max-steps", "6", "--seed", "5", "--seq-len", "96", "--answer-tokens", "20")
RUNS["23: transformers' model"] = Ref("tests/hf_model.py", ("{run_dir}/hf",))
RUNS.update({name: replace(ref, needs="23: transformers' model")
             for name, ref in plan("23: ", "day5/23_hf_finetuning.py", (*FINETUNE, "--model-dir", "{needs}/hf"), {
                 "one": ("self", 1, ("--batch-size", "16")),
                 "fsdp2": ("torchrun", 2, ("--batch-size", "8")),
                 "fsdp4": ("self", 4, ("--batch-size", "4")),
                 "pitfall": ("self", 2, ("--batch-size", "8", "--skip-reshard")),
             }).items()})
RUNS["23: lesson 22's model, unchanged"] = Ref("day5/23_hf_finetuning.py", (
    "--max-steps", "0", "--seq-len", "96", "--answer-tokens", "20", "--model-dir", "{needs}/hf", "--nproc", "2",
    "--run-dir", "{run_dir}"), needs="22: one")
