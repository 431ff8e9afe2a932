"""The trainer's readiness check, the pieces its job runs (scripts/readiness_check.sh submits the job):

    python course/readiness.py node                  # one task per node: the environment and the data here
    python course/readiness.py bandwidth [--max-mib N]  # every rank: all_reduce bus bandwidth against size
    python course/readiness.py verdict RESULTS_DIR   # the job's last step: one table, what passed, what to fix

`bandwidth` is nccl-tests' all_reduce_perf in a few lines of torch: for each size, the time of one
all_reduce (the median of several, after warm-up ones), the algorithm bandwidth (bytes / time) and the bus
bandwidth, algbw x 2 (n - 1) / n for n ranks: what each rank's link carries in a ring all_reduce, comparable
across world sizes and with the hardware's link speed (nccl-tests, doc/PERFORMANCE.md).  NCCL on GPUs (one rank
per GPU), gloo on the CPU.
"""
import argparse
import json
import os
import socket
import statistics
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: course/, data_tools/

LESSONS = ["day1/0_torch_dist.py", "day2/9_torch_dist_multi_node.py", "day2/10_mnist_ddp_pt_multinode.py",
           "day2/11_mnist_ddp_pt_multinode_streaming.py", "day3/15_fsdp2.py", "day3/17_debugging_hangs.py"]
MIB = 2 ** 20
CPU_MAX_MIB = 256  # gloo's largest all_reduce by default (GPUs: top_mib)


def node(results: Path) -> int:
    """This node's Python, torch, GPUs, the packages of the lessons and the data: results/node-HOST.json."""
    from course.launching import requires
    from data_tools.datasets import DEFAULT_DATASET, DataError, default_data_dir, require
    from data_tools.h5layout import default_h5_path

    host = socket.gethostname()
    found = {"host": host, "python": sys.executable, "problems": []}
    try:
        import torch

        found["torch"] = torch.__version__
        found["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        found["gpu_names"] = sorted({torch.cuda.get_device_name(i) for i in range(found["gpus"])})
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if found["gpus"] else None
    except Exception as e:  # no torch, a broken CUDA: said in the table
        found["problems"].append(f"torch: {type(e).__name__}: {e}")
    for lesson in LESSONS:
        found["problems"] += [f"{lesson}: {p}" for p in requires.problems(lesson)]
    data_dir = default_data_dir()
    try:
        require(DEFAULT_DATASET, data_dir)
    except DataError as e:
        found["problems"].append(f"data: {e}")
    if not default_h5_path(DEFAULT_DATASET, data_dir).is_file():
        found["problems"].append(f"data: no {default_h5_path(DEFAULT_DATASET, data_dir)} for lesson 11 "
                                 f"(python data_tools/create_mnist_h5.py)")
    found["data_dir"] = str(data_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"node-{host}.json").write_text(json.dumps(found, indent=1))
    print(f"readiness: node {host}: torch {found.get('torch', '-')}, {found.get('gpus', 0)} GPU(s), "
          + ("ok" if not found["problems"] else "; ".join(found["problems"])), flush=True)
    return 0


def top_mib(device, max_mib: int | None = None) -> int:
    """The largest all_reduce of the sweep, MiB: --max-mib if given; else on GPUs (NCCL) the lessons' largest
    (course/measuring/hardware.py, sweep_sizes: NVLink and InfiniBand are not full at a few MiB), on CPUs
    CPU_MAX_MIB."""
    from course.measuring.hardware import sweep_sizes

    return max_mib or (int(sweep_sizes(device)[-1]) if device.type == "cuda" else CPU_MAX_MIB)


def bandwidth(results: Path, max_mib: int | None, iters: int, timeout: float) -> int:
    """Every rank: all_reduce of float32 tensors from 1 KiB to max_mib MiB (top_mib); rank 0 writes
    bandwidth.json."""
    import torch
    import torch.distributed as dist

    from course.launching.launch import backend_for, launch, setup_device
    from course.measuring.hardware import clock

    def worker(info, args):
        device = setup_device("auto", info.local_rank)
        backend = backend_for(device)
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                                timeout=timedelta(seconds=timeout))
        n, rows = info.world_size, []
        size = 1024
        while size <= top_mib(device, max_mib) * MIB:
            x = torch.ones(size // 4, device=device)
            for _ in range(2):  # warm-up: connections, buffers
                dist.all_reduce(x)
            times = []
            for _ in range(iters):
                clock(device)  # on a GPU: the work queued before has finished
                dist.barrier()
                start = clock(device)
                dist.all_reduce(x)
                times.append(clock(device) - start)
            seconds = torch.tensor([statistics.median(times)], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
            t = seconds.item()
            algbw = size / t / 1e9
            rows.append({"bytes": size, "seconds": t, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n})
            size *= 4
        if info.rank == 0:
            hosts = [None] * n
            dist.all_gather_object(hosts, socket.gethostname())
            peak = max(rows, key=lambda r: r["busbw_gbps"])
            (results / "bandwidth.json").write_text(json.dumps(
                {"backend": backend, "world_size": n, "nodes": len(set(hosts)), "rows": rows, "peak": peak}, indent=1))
            print(f"readiness: all_reduce ({backend}, {n} ranks on {len(set(hosts))} nodes)", flush=True)
            print(f"{'size':>10} {'time (us)':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}", flush=True)
            for r in rows:
                print(f"{r['bytes']:>10} {r['seconds'] * 1e6:>10.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f}",
                      flush=True)
        else:
            dist.all_gather_object([None] * n, socket.gethostname())
        dist.destroy_process_group()

    launch(worker, argparse.Namespace(nproc=None))
    return 0


def verdict(results: Path) -> int:
    """The job's table: every step (results/steps.tsv: name, exit code, seconds), the nodes, the bandwidth;
    exit 1 if anything failed."""
    rows, fixes = [], []
    steps = [line.split("\t") for line in (results / "steps.tsv").read_text().splitlines() if line.strip()]
    hints = {"environment and data": "see the node lines above: install what is missing in the site's environment "
                                     "(site_setup), prepare the data (docs/trainers/instructor-guide.md)",
             "all_reduce across nodes": "ranks on different nodes cannot reach each other: NCCL_SOCKET_IFNAME/"
                                        "GLOO_SOCKET_IFNAME in the profile's site_setup, the open port range",
             "bus bandwidth": "as for all_reduce across nodes",
             "DDP lesson (10)": "read its log above; lesson 9 passing means the network is fine",
             "day-3 lesson (15)": "read its log above; a torch older than 2.6 is named by the environment check"}
    for name, code, seconds in steps:
        ok = code == "0"
        rows.append((name, "pass" if ok else f"FAIL (exit {code})", f"{float(seconds):.0f} s"))
        if not ok:
            fixes.append(f"{name}: {hints.get(name, 'read its log above')}")
    for path in sorted(results.glob("node-*.json")):
        found = json.loads(path.read_text())
        gpus = f"{found.get('gpus', 0)} GPU(s) {', '.join(found.get('gpu_names', []))}".strip()
        rows.append((f"node {found['host']}", "pass" if not found["problems"] else "FAIL",
                     f"torch {found.get('torch', '-')}, {gpus}"))
        fixes += [f"node {found['host']}: {p}" for p in found["problems"]]
    bw = results / "bandwidth.json"
    if bw.is_file():
        b = json.loads(bw.read_text())
        peak = b["peak"]
        rows.append(("all_reduce bus bandwidth", f"{peak['busbw_gbps']:.2f} GB/s",
                     f"at {peak['bytes'] / MIB:g} MiB, {b['backend']}, {b['world_size']} ranks on {b['nodes']} nodes"))
    width = max(len(r[0]) for r in rows)
    print("\nreadiness verdict", flush=True)
    for name, status, detail in rows:
        print(f"  {name:{width}}  {status:18}  {detail}", flush=True)
    failed = any(code != "0" for _, code, _ in steps) or any(r[1] == "FAIL" for r in rows)
    print(("READY: every check passed" if not failed else "NOT READY; to fix:\n  " + "\n  ".join(fixes)), flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python course/readiness.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("node", "bandwidth", "verdict"):
        s = sub.add_parser(name)
        s.add_argument("results", type=Path, help="the job's results directory")
    sub.choices["bandwidth"].add_argument("--max-mib", type=int, default=None,
                                          help=f"largest message, MiB (not given: 1024 on GPUs, {CPU_MAX_MIB} on CPUs)")
    sub.choices["bandwidth"].add_argument("--iters", type=int, default=5, help="timed all_reduces per size")
    sub.choices["bandwidth"].add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits")
    args = p.parse_args(argv)
    if args.what == "node":
        return node(args.results)
    if args.what == "bandwidth":
        return bandwidth(args.results, args.max_mib, args.iters, args.timeout)
    return verdict(args.results)


if __name__ == "__main__":
    sys.exit(main())
