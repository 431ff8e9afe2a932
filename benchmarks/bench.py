#!/usr/bin/env python
"""The course's benchmark: input pipeline, HDF5 streaming, gradient sync, training throughput, start-up.

    python benchmarks/bench.py                              # all sections, 4-5 minutes on 2 CPU cores
    python benchmarks/bench.py --sections input,sync        # some of them
    python benchmarks/bench.py --large                      # full epochs, more sizes and repeats
    python benchmarks/bench.py --smoke                      # tiny sizes: checks the code runs (tests)

Prints one table and writes it to <out>/bench.csv, bench.md, bench.json (with the machine) and bench.png.
Every comparison is a ratio of two measurements of this run; the goal column marks the course's targets
(met / not met).  Sections: input (samples/s of the lessons' in-memory path vs the per-sample torchvision
path and the memory-copy limit), hdf5 (lesson 11's chunked streaming, cold and warm, vs memory), sync
(per-step gradient synchronization at world size 2: lesson 4 by hand vs torch DDP vs gloo's bandwidth),
train (1 process x all cores vs 2 ranks x 1 thread; one GPU when CUDA is present), startup (launch and
process-group init for 2 and 4 ranks, per launcher), precision (lesson 13's ViT step in fp32, bf16, fp16),
accumulation (lesson 14: all_reduce bytes and time per sample at K = 1, 2, 4 micro-batches; checkpointing's
bytes kept for backward and step time),
fsdp (lesson 15's FSDP2 against DDP at 2 and 4 ranks: bytes per rank and step time), dcp (lesson 16's
distributed checkpoints against torch.save on rank 0: save and load MB/s, the save's stall per step), memory
(the measured peak of a step: lesson 14 with and without checkpointing, lesson 15's FSDP2 against DDP),
parallel (lessons 18-20: what each rank holds of the layers tensor parallelism and 2-D meshes cut, the
all_reduce's bus bandwidth, TP's step against DDP's), gpt (lesson 22 run as a learner runs it: tokens/s per
rank and MFU, one process against FSDP2 at 2 ranks, the memory each holds; the Hugging Face export's cost).
"""
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/

import torch  # noqa: E402

from benchmarks.common import SECTIONS, Context, meta_line, table, write_reports  # noqa: E402
from course.launching import cli  # noqa: E402
from data_tools.datasets import DATASETS, DEFAULT_DATASET, default_data_dir, require  # noqa: E402

PROG = "benchmarks/bench.py"


def sections(text: str) -> list:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise cli.argparse.ArgumentTypeError(f"unknown section {', '.join(unknown) or repr(text)}; "
                                             f"choose from {','.join(SECTIONS)}")
    return [s for s in SECTIONS if s in names]  # always in the table's order


def build_parser():
    p = cli.Parser(prog=f"python {PROG}", description=__doc__.strip().split("\n\n")[0],
                   formatter_class=cli.argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sections", type=sections, default=",".join(SECTIONS),
                   help=f"comma-separated, from {','.join(SECTIONS)}")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--large", action="store_true", help="full epochs, more batch sizes and repeats")
    size.add_argument("--smoke", action="store_true",
                      help="tiny sizes and one repeat: checks every code path in seconds, numbers are noise")
    p.add_argument("--out", type=Path, default=Path("runs") / "bench", help="where the table files go")
    p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS))
    p.add_argument("--data-dir", type=Path, default=None,
                   help="prepared data dir (default: $COURSE_DATA_DIR or data/ in the repository)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: also measure the GPU rows when CUDA is available; cpu: never")
    return p


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()}" + (f" ({model})" if model else "")


def run(args):
    data_dir = args.data_dir or default_data_dir()
    require(args.dataset, data_dir)
    try:  # before minutes of measuring, not after
        args.out.mkdir(parents=True, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise cli.CourseError(f"--out {args.out} cannot be written ({e.strerror or e}); choose another") from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise cli.CourseError("--device cuda was asked for but no GPU is visible; use --device auto or cpu")
    cuda = args.device != "cpu" and torch.cuda.is_available()
    ctx = Context(args.dataset, data_dir, args.out, args.smoke, args.large, cuda)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "command": "python " + " ".join([PROG, *map(shlex.quote, sys.argv[1:])]),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if cuda else "", "sections": args.sections,
            "size": "smoke" if args.smoke else "large" if args.large else "default"}
    print(meta_line(meta), flush=True)

    from benchmarks import (accumulation, dcp, fsdp, gpt, grad_sync, hdf5_stream, input_pipeline, memory,
                            parallel, precision, startup, training)

    modules = {"input": input_pipeline, "hdf5": hdf5_stream, "sync": grad_sync, "train": training,
               "startup": startup, "precision": precision, "accumulation": accumulation, "fsdp": fsdp, "dcp": dcp,
               "memory": memory, "parallel": parallel, "gpt": gpt}
    rows, seconds = [], {}
    for name in args.sections:
        start = time.perf_counter()
        print(f"section {name} ...", flush=True)
        new = modules[name].run(ctx)
        seconds[name] = time.perf_counter() - start
        print(table(new), f"\n({name}: {seconds[name]:.0f} s)\n", sep="\n", flush=True)
        rows += new
    meta["section_seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    paths = write_reports(args.out, rows, meta)
    print(table(rows))
    goals = [r for r in rows if r.status]
    print(f"\ngoals met: {sum(r.status == 'met' for r in goals)} of {len(goals)}; "
          f"{sum(seconds.values()):.0f} s in all; wrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    cli.main(run, build_parser())
