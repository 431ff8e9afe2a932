"""Does your training script train the same model on N ranks as on one process?  Run it and see.

    python parity_check.py --script train_ddp.py --nproc 2 4
    python parity_check.py --script train_fsdp.py --nproc 2 --steps 10 -- --lr 0.1

It runs your copy of train_ddp.py or train_fsdp.py (or any script that takes the same options: --nproc,
--batch-size per rank, --max-steps, --seed, --run-dir, --fresh, and writes RUN_DIR/metrics.json with
"loss_per_step" and RUN_DIR/model.pt, a state dict of whole tensors) for --steps optimizer steps, once as one
process with the global batch and once on each N ranks with global batch / N per rank: the same samples
in every step, the same seed.  Then it compares the loss of every step and the final weights.
Arguments after -- go to every run alike (--accum 2, your model's options).

Equal up to float32 rounding is the expected result: the ranks add their gradients in another order than one
process adds the same numbers, and each order rounds differently; float32 keeps about 7 digits (its epsilon,
the gap between 1 and the next float32, is 1.2e-7), and a few steps of training grow such differences to
1e-6 or so of a weight, not more.  A larger difference is a bug, usually one of the list the check prints.
Turn dropout and random augmentation off for the check (they draw other random numbers on N ranks).
Needs torch only.  Exit code 0: equal within the tolerance; 1: a difference; 2: the runs failed.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps

CAUSES_FIRST_STEP = """\
The loss differs from the first step on, before any weight was updated: the N ranks did not compute the
one process's forward pass on the same samples.  Usually:
  - the sampler is not per rank: every rank reads the same samples (no DistributedSampler, or one without
    num_replicas=world size and rank=rank), so N ranks train on N copies of 1/N of the batch;
  - randomness differs per rank: dropout, random augmentation or noise draw other numbers on each rank
    than one process draws for the same samples (turn them off for the check);
  - the data order differs: a shuffle seeded per rank, or set_epoch missing or different;
  - the initial weights differ: under FSDP each rank fills its shards itself (DDP broadcasts rank 0's at
    wrap time), and random initialization drawn on each rank gives other weights than one process's."""
CAUSES_LATER = """\
The first step's loss agrees, later ones do not: the forward pass was the same, the update was not.
Usually:
  - a missing all_reduce: the gradients are not averaged over ranks (no_sync around every micro-batch,
    a model not wrapped in DDP or fully_shard, a parameter updated outside them), so each rank trains on
    its own shard;
  - a loss averaged twice: the loss divided by the world size on top of DDP's or FSDP's own average (they
    average already), which divides the step by N (with Adam it hardly shows: Adam divides it out);
  - a learning rate, schedule or clipping that depends on the world size."""


def launch(script, nproc, batch, args, run_dir, extra):
    cmd = [sys.executable, str(script), "--nproc", str(nproc), "--batch-size", str(batch),
           "--max-steps", str(args.steps), "--seed", str(args.seed), "--run-dir", str(run_dir), "--fresh",
           "--log-every", str(args.steps), *extra]
    print(f"+ {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        print(f"error: the run on {nproc} rank(s) exited {done.returncode}:\n{done.stdout}{done.stderr}",
              file=sys.stderr)
        sys.exit(2)
    try:
        losses = json.loads((run_dir / "metrics.json").read_text())["loss_per_step"]
        weights = torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: the run on {nproc} rank(s) wrote no metrics.json with loss_per_step or no model.pt "
              f"in {run_dir} ({e})", file=sys.stderr)
        sys.exit(2)
    if len(losses) != args.steps:
        print(f"error: the run on {nproc} rank(s) made {len(losses)} steps, not {args.steps}", file=sys.stderr)
        sys.exit(2)
    return losses, weights


def compare(one, many, nproc, tolerance):
    """Print the per-step losses and the weights' differences; True when all are within the tolerance."""
    (losses_1, weights_1), (losses_n, weights_n) = one, many
    print(f"\n1 process against {nproc} ranks, the same global batch:")
    print(f"{'step':>5} {'loss, 1 process':>17} {f'loss, {nproc} ranks':>17} {'relative difference':>20}")
    loss_diffs = []
    for step, (a, b) in enumerate(zip(losses_1, losses_n), 1):
        loss_diffs.append(abs(a - b) / max(abs(a), 1e-12))
        print(f"{step:5d} {a:17.9g} {b:17.9g} {loss_diffs[-1]:20.2e}")
    if weights_1.keys() != weights_n.keys():
        print(f"the two runs' model.pt hold different tensors: {sorted(set(weights_1) ^ set(weights_n))}")
        return False
    weight_diffs = {k: ((weights_1[k].double() - weights_n[k].double()).abs().max()
                        / weights_1[k].double().abs().max().clamp_min(1e-12)).item()
                    for k in weights_1 if weights_1[k].is_floating_point()}
    worst = max(weight_diffs, key=weight_diffs.get)
    print(f"final weights: largest difference {weight_diffs[worst]:.2e} of the tensor's largest value "
          f"({worst}); float32's epsilon is {FLOAT32_EPS:.2e}; tolerance {tolerance:.0e}")
    worst_loss = max(loss_diffs)
    if worst_loss <= tolerance and weight_diffs[worst] <= tolerance:
        print(f"EQUAL within float32 rounding on {nproc} ranks: losses within {worst_loss:.1e}, "
              f"weights within {weight_diffs[worst]:.1e}")
        return True
    first = next(step for step, d in enumerate(loss_diffs, 1) if d > tolerance) if worst_loss > tolerance else None
    where = f"from step {first} on" if first else "in the final weights only"
    print(f"DIFFERENT on {nproc} ranks {where}: losses up to {worst_loss:.1e}, weights up to "
          f"{weight_diffs[worst]:.1e}, more than rounding explains.")
    print(CAUSES_FIRST_STEP if first == 1 else CAUSES_LATER)
    return False


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", type=Path, required=True, help="your training script (a copy of a template)")
    p.add_argument("--nproc", type=int, nargs="+", default=[2], help="the rank counts to compare with 1")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step, in all ranks together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest relative difference taken as rounding (default 1e-5, ~80 float32 epsilons)")
    p.add_argument("--work-dir", type=Path, default=None, help="where the runs write (default: a temporary dir)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = p.parse_args(argv)
    if not args.script.is_file():
        p.error(f"--script {args.script}: no such file")
    if args.steps < 1 or args.global_batch < 1 or min(args.nproc) < 2:
        p.error("--steps and --global-batch must be >= 1, and every --nproc >= 2")
    uneven = [n for n in args.nproc if args.global_batch % n]
    if uneven:
        p.error(f"--global-batch {args.global_batch} does not split evenly over {uneven} ranks")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="parity-"))
    one = launch(args.script, 1, args.global_batch, args, work / "nproc1", extra)
    results = [compare(one, launch(args.script, n, args.global_batch // n, args, work / f"nproc{n}", extra),
                       n, args.tolerance) for n in args.nproc]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
