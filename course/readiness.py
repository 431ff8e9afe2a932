"""The trainer's readiness check, the pieces its job runs (scripts/readiness_check.sh submits the job):

    python course/readiness.py settings RESULTS_DIR [what the profile declares]  # first: the declared values, checked
    python course/readiness.py rank RESULTS_DIR        # every rank (srun): its device and GPU; a node's first rank
                                                       # also the node: torch, every lesson's packages, the data
    python course/readiness.py bandwidth RESULTS_DIR [--max-mib N]  # every rank: all_reduce bus bandwidth
    python course/readiness.py verdict RESULTS_DIR [what the profile declares]  # last: the table, what to fix

What the profile declares: --site (its file, named in the fixes), --nodes and --ranks (the job's
SLURM_JOB_NUM_NODES and SLURM_NTASKS), --gpu-flag (SITE_GPU_FLAG: none is a CPU-only profile),
--nccl-transport (SITE_NCCL_TRANSPORT), --link-gbps (SITE_LINK_GBPS), --min-busbw-share (SITE_MIN_BUSBW_SHARE).

`bandwidth` is nccl-tests' all_reduce_perf in a few lines of torch: for each size, the time of one
all_reduce (the median of several, after warm-up ones), the algorithm bandwidth (bytes / time) and the bus
bandwidth, algbw x 2 (n - 1) / n for n ranks: what each rank's link carries in a ring all_reduce, comparable
across world sizes and with the hardware's link speed (nccl-tests, doc/PERFORMANCE.md).  NCCL on GPUs (one rank
per GPU), gloo on the CPU.  The job runs it with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET and
NCCL_DEBUG_FILE=RESULTS_DIR/nccl-%h-%p.log: NCCL's own lines say which network joined the nodes.

`verdict` says READY only when every row passes: every step exited 0; every rank ran on a GPU of its own (a
CPU-only profile: on the CPU); the ranks ran on all the job's nodes, at least 2; NCCL joined the nodes over the
network the profile declares; the all_reduce bus bandwidth reached the declared share of the declared link
speed; every lesson of docs/lessons.toml has its torch release and packages; the GPUs compute the precision
the lessons default to (bf16: compute capability 8.0); a model staged for lesson 23 ($COURSE_MODEL_DIR, where
the profile exports it) is on every node as its SHA256SUMS says.  A row that cannot be judged (nothing declared to judge
against, nothing measured) is "not judged" and NOT READY too, never READY by silence; the one exception is the
NCCL transport on a CPU-only profile, "not judged (gloo)": no NCCL there.
"""
import argparse
import functools
import json
import math
import os
import re
import socket
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository root: course/, data_tools/

MIB = 2 ** 20
CPU_MAX_MIB = 256  # gloo's largest all_reduce by default (GPUs: top_mib)
GPU_FLAGS = ("none", "gpus-per-node", "gres", "gpus")  # slurm/submit.sh's SITE_GPU_FLAG
DEFAULT_MIN_SHARE = 0.5  # of SITE_LINK_GBPS: NCCL over TCP, or one NIC of four, is far below; a busy fabric is not
# NCCL's INFO lines (src/transport/net.cc, src/init.cc; NCCL_DEBUG_SUBSYS INIT prints them, NET too), e.g.
#   node1:1234:1260 [0] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/IB/0/GDRDMA
#   node1:1234:1260 [0] NCCL INFO Channel 01 : 2[c7000] -> 0[87000] [receive] via NET/Socket/1   (NCCL < 2.12)
#   ip-10-0-0-1:35480:35545 [0] NCCL INFO Ring 00 : 15 -> 0 [receive] via NET/AWS Libfabric/0  (NCCL 2.4, a plugin)
#   node1:1234:1234 [0] NCCL INFO Using network IB
# A connection to another node is "via NET/<network>/<device>"; the name ends at the "/" before the device.
NET_CHANNEL = re.compile(r"NCCL INFO .*\[(?:send|receive)\] via NET/(.+?)/\d")
NET_USING = re.compile(r"NCCL INFO Using network (.+?)\s*$")


@functools.lru_cache(maxsize=None)
def catalog() -> dict:
    """{script: lesson id} of every lesson, in course order, from the catalog docs/lessons.toml (each entry's
    `id = "..."` and `script = "..."` lines, read without tomllib: a site's Python may be older than 3.11)."""
    found = {}
    for entry in (REPO / "docs" / "lessons.toml").read_text().split("[[lesson]]")[1:]:
        ids, scripts = (re.findall(rf'^{key} = "([^"]+)"', entry, flags=re.M) for key in ("id", "script"))
        found[scripts[0]] = ids[0]
    return found


def lessons() -> list:
    return list(catalog())


def lesson_id(script: str) -> str:
    return catalog().get(script, Path(script).stem)


def default_precisions() -> dict:
    """{precision: [lesson ids]} for every precision but fp32 that a lesson's --precision defaults to
    (lessons 13 and 14: bf16), read from the lessons' own add_argument lines."""
    found = {}
    for script in lessons():
        default = re.search(r'"--precision",\s*default="(\w+)"', (REPO / script).read_text())
        if default and default[1] != "fp32":
            found.setdefault(default[1], []).append(lesson_id(script))
    return found


def _bare_uuid(uuid) -> str:
    uuid = str(uuid).strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def precision_problems(device) -> dict:
    """{precision: None, or the line the lessons print} for the precisions the lessons default to, on this
    rank's device: course/training/precision.py's own check (on a GPU: native bf16, compute capability 8.0)."""
    from course.launching.cli import CourseError
    from course.training.precision import check_precision

    found = {}
    for precision in default_precisions():
        try:
            check_precision(argparse.Namespace(device=device.type, precision=precision, compile=False, nproc=1))
            found[precision] = None
        except CourseError as e:
            found[precision] = str(e)
    return found


def rank(results: Path) -> int:
    """One rank (srun starts one per task): its host, device, GPU (index, UUID, name, compute capability,
    native bf16) and the lessons' default precisions there, in results/rank-R.json; the first rank of each node
    (SLURM_LOCALID 0) also checks the node (node())."""
    env = os.environ
    me, local = int(env.get("SLURM_PROCID", "0")), int(env.get("SLURM_LOCALID", "0"))
    found = {"rank": me, "local_rank": local, "host": socket.gethostname(),
             "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"), "slurm_gpus_on_node": env.get("SLURM_GPUS_ON_NODE"),
             "torch": None, "torch_cuda": None, "gpus_visible": 0, "device": None, "gpu": None, "precision": {},
             "problem": None}
    try:
        import torch

        from course.launching.cli import CourseError
        from course.launching.devices import setup_device

        found.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        found["gpus_visible"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        try:
            device = setup_device("auto", local)  # the lessons' own choice: cuda:<its GPU>, or the CPU
        except CourseError as e:  # more ranks than GPUs, GPUs bound twice: the lessons' line
            found["problem"] = str(e)
        else:
            found["device"] = str(device)
            if device.type == "cuda":
                props = torch.cuda.get_device_properties(device.index)
                found["gpu"] = {"index": device.index, "uuid": _bare_uuid(props.uuid), "name": props.name,
                                "capability": f"{props.major}.{props.minor}",
                                "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False)}
            found["precision"] = precision_problems(device)
    except Exception as e:  # no torch, a broken CUDA: said in the table
        found["problem"] = f"{type(e).__name__}: {e}"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"rank-{me}.json").write_text(json.dumps(found, indent=1))
    gpu = found["gpu"]
    print(f"readiness: rank {me} on {found['host']}: {found['device'] or 'no device'}"
          + (f" ({gpu['name']}, GPU-{gpu['uuid']}, compute capability {gpu['capability']})" if gpu else "")
          + (f"; {found['problem']}" if found["problem"] else ""), flush=True)
    if local == 0:
        node(results)
    return 0


def node(results: Path) -> None:
    """This node's Python, torch, GPUs, the torch release and packages of every lesson of the catalog, the
    data, and the model staged for lesson 23 ($COURSE_MODEL_DIR, when set: its digests): results/node-HOST.json."""
    from course.checkpoints import hf
    from course.launching import requires
    from data_tools.datasets import DEFAULT_DATASET, DataError, default_data_dir, require
    from data_tools.h5layout import default_h5_path

    host = socket.gethostname()
    found = {"host": host, "python": sys.executable, "problems": [], "lessons": []}
    try:
        import torch

        found["torch"] = torch.__version__
        found["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        found["gpu_names"] = sorted({torch.cuda.get_device_name(i) for i in range(found["gpus"])})
    except Exception as e:  # no torch, a broken CUDA: said in the table
        found["problems"].append(f"torch: {type(e).__name__}: {e}")
    # each lesson as it runs by default, and with the options that need packages of their own (--profile,
    # --watch-hardware): the workshop may use them
    for lesson in lessons():
        found["lessons"] += [[lesson, p] for p in requires.problems(str(REPO / lesson), list(requires.BY_OPTION))]
    data_dir = default_data_dir()
    try:
        require(DEFAULT_DATASET, data_dir)
    except DataError as e:
        found["problems"].append(f"data: {e}")
    if not default_h5_path(DEFAULT_DATASET, data_dir).is_file():
        found["problems"].append(f"data: no {default_h5_path(DEFAULT_DATASET, data_dir)} for lesson 11 "
                                 f"(python data_tools/create_mnist_h5.py)")
    found["data_dir"] = str(data_dir)
    staged = os.environ.get("COURSE_MODEL_DIR")  # a model staged for lesson 23: readable here, whole, as written
    if staged:
        problem = hf.staged_problem(Path(staged))
        if problem:
            found["problems"].append(f"model: {problem}")
        found["model_dir"] = staged
    results.mkdir(parents=True, exist_ok=True)
    (results / f"node-{host}.json").write_text(json.dumps(found, indent=1))
    problems = found["problems"] + [f"{lesson}: {p}" for lesson, p in found["lessons"]]
    print(f"readiness: node {host}: torch {found.get('torch', '-')}, {found.get('gpus', 0)} GPU(s), "
          + ("ok" if not problems else "; ".join(problems)), flush=True)


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


# ------------------------------------------------------------------------------------------------ the verdict

@dataclass
class Declared:
    """What the job is judged against: the site profile's values and the job's size."""
    site: str = "the site profile"
    nodes: int | None = None  # SLURM_JOB_NUM_NODES
    ranks: int | None = None  # SLURM_NTASKS
    gpu_flag: str = "none"  # SITE_GPU_FLAG
    transport: str = ""  # SITE_NCCL_TRANSPORT
    link_gbps: float | None = None  # SITE_LINK_GBPS
    min_share: float = DEFAULT_MIN_SHARE  # SITE_MIN_BUSBW_SHARE

    @property
    def gpus(self) -> bool:
        return self.gpu_flag != "none"

    @property
    def link(self) -> str:
        return "" if self.link_gbps is None else f"{self.link_gbps:g}"


def declared_from(args) -> tuple:
    """(Declared, [one line per value that cannot be one]) from the command line's raw strings."""
    problems, given = [], Declared(site=args.site or "the site profile")

    def number(text, lowest, highest):
        if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", text.strip()):  # as readiness_check.sh accepts it
            return None
        value = float(text)
        return value if lowest < value <= highest else None

    if args.gpu_flag not in GPU_FLAGS:
        problems.append(f"SITE_GPU_FLAG={args.gpu_flag!r} in {given.site}: one of {', '.join(GPU_FLAGS)}")
    else:
        given.gpu_flag = args.gpu_flag
    for name, text in (("nodes", args.nodes), ("ranks", args.ranks)):
        if text:
            if not text.isdigit() or int(text) < 1:
                problems.append(f"--{name} {text!r}: a whole number of the job's {name}, at least 1")
            else:
                setattr(given, name, int(text))
    transport = (args.nccl_transport or "").strip()
    if transport and not re.fullmatch(r"[A-Za-z][A-Za-z0-9_ -]{0,39}", transport):
        problems.append(f"SITE_NCCL_TRANSPORT={transport!r} in {given.site}: one network name as NCCL prints it "
                        f"in 'via NET/<name>/' (IB, Socket, or a plugin's, e.g. 'AWS Libfabric'), or empty")
    else:
        given.transport = transport
    if args.link_gbps not in (None, ""):
        given.link_gbps = number(args.link_gbps, 0, math.inf)
        if given.link_gbps is None:
            problems.append(f"SITE_LINK_GBPS={args.link_gbps!r} in {given.site}: the network bandwidth of one node "
                            f"to the others in Gbit/s, a number above 0 such as 200, or empty (then the bandwidth "
                            f"is not judged, and the check says NOT READY)")
    if args.min_busbw_share not in (None, ""):
        share = number(args.min_busbw_share, 0, 1)
        if share is None:
            problems.append(f"SITE_MIN_BUSBW_SHARE={args.min_busbw_share!r} in {given.site}: the share of "
                            f"SITE_LINK_GBPS the bus bandwidth must reach, above 0 and at most 1 (empty: "
                            f"{DEFAULT_MIN_SHARE})")
        else:
            given.min_share = share
    return given, problems


@dataclass
class Row:
    name: str
    status: str  # pass, FAIL..., not judged...
    detail: str
    fix: str | None = None  # one line, for a row that keeps the check from READY
    blocks: bool = False  # a "not judged" that keeps it from READY too

    @property
    def ready(self) -> bool:
        return self.status == "pass" or (self.status.startswith("not judged") and not self.blocks)


def _records(results: Path, pattern: str) -> list:
    return [json.loads(p.read_text()) for p in sorted(results.glob(pattern))]


def _nodes(n) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def _names(items) -> str:
    return ", ".join(sorted(set(items)))


def nodes_row(ranks: list, want: Declared) -> Row:
    hosts = sorted({r["host"] for r in ranks})
    asked = want.nodes
    if asked is None:
        return Row("nodes", "not judged", f"the ranks ran on {len(hosts)} node(s) ({_names(hosts)}); the job's "
                   f"node count was not given", "pass the job's SLURM_JOB_NUM_NODES (--nodes) to the verdict",
                   blocks=True)
    if asked < 2:
        return Row("nodes", "FAIL", f"the job had {asked} node ({_names(hosts)}); the check needs 2 or more",
                   f"nodes: submit the check on 2 nodes (its default; no --nodes 1): days 2-4 run across nodes, "
                   f"and only then does the all_reduce cross the network")
    if len(hosts) != asked:
        return Row("nodes", "FAIL", f"the ranks ran on {len(hosts)} of the job's {asked} nodes ({_names(hosts)})",
                   f"nodes: the ranks did not spread over the job's {asked} nodes: give every node its ranks "
                   f"(--ntasks-per-node, not --ntasks; see the job's settings at the top of the log)")
    return Row("nodes", "pass", f"{asked} nodes, as the job asked ({_names(hosts)})")


def gpu_row(ranks: list, want: Declared) -> Row:
    name = "GPU per rank"
    n = len(ranks)
    if want.ranks and n < want.ranks:
        return Row(name, "FAIL", f"{n} of the job's {want.ranks} ranks wrote their record (rank-*.json)",
                   f"{name}: read the log of the step 'environment, data and GPUs' above: a rank failed before "
                   f"it could say which device it has")
    broken = [r for r in ranks if r["problem"]]
    if broken:
        r = broken[0]
        return Row(name, "FAIL", f"{len(broken)} of {n} ranks could not take a device",
                   f"{name}: rank {r['rank']} on {r['host']}: {r['problem']}")
    on_cpu = [r for r in ranks if r["device"] == "cpu"]
    if not want.gpus:
        if len(on_cpu) < n:
            return Row(name, "FAIL", f"{n - len(on_cpu)} of {n} ranks ran on a GPU with a CPU-only profile",
                       f"{name}: {want.site} says SITE_GPU_FLAG=none but the ranks see GPUs: use a GPU profile "
                       f"(SITE_GPU_FLAG, SITE_GPUS_PER_NODE) for GPU nodes")
        return Row(name, "pass", f"CPU-only profile (SITE_GPU_FLAG=none): {n} ranks on the CPU, gloo")
    if on_cpu:
        r = on_cpu[0]
        hosts = _names(x["host"] for x in on_cpu)
        given = (f"Slurm gave the job GPUs (CUDA_VISIBLE_DEVICES={r['cuda_visible_devices']})"
                 if r["cuda_visible_devices"] else "Slurm gave the ranks no GPU (no CUDA_VISIBLE_DEVICES)")
        if not r["cuda_visible_devices"] and not r["slurm_gpus_on_node"]:
            fix = (f"{given}: check the profile's GPU request (SITE_GPU_FLAG={want.gpu_flag}, SITE_GPUS_PER_NODE) "
                   f"with slurm/submit.sh 9 --site ... --dry-run")
        elif r["torch_cuda"] is None:
            fix = (f"torch {r['torch']} on {r['host']} is a CPU-only build, and {given}: install a CUDA build of "
                   f"torch in the site's environment (site_setup of {want.site}: the centre's PyTorch module, or "
                   f"pip's CUDA wheel)")
        else:
            fix = (f"torch {r['torch']} (CUDA {r['torch_cuda']}) sees no GPU on {r['host']}, though {given}: run "
                   f"nvidia-smi on that node (the driver), and load the CUDA the driver supports in site_setup of "
                   f"{want.site}")
        return Row(name, "FAIL", f"{len(on_cpu)} of {n} ranks ran on the CPU ({hosts}); the profile asks for GPUs "
                   f"(SITE_GPU_FLAG={want.gpu_flag}), the lessons would fall back to the CPU", f"{name}: {fix}")
    holders = {}
    for r in ranks:
        holders.setdefault((r["host"], r["gpu"]["uuid"]), []).append(r["rank"])
    shared = [(key, rs) for key, rs in holders.items() if len(rs) > 1]
    if shared:
        (host, uuid), rs = shared[0]
        return Row(name, "FAIL", f"{len(shared)} GPU(s) serve several ranks: ranks {', '.join(map(str, rs))} on "
                   f"{host} share GPU-{uuid}",
                   f"{name}: ranks {', '.join(map(str, rs))} on {host} share one GPU: give each task its own "
                   f"(--gpus-per-task=1 or --gpu-bind=single:1 in SITE_SBATCH_EXTRA, or as many tasks per node as "
                   f"GPUs)")
    per_node = Counter(r["host"] for r in ranks)
    return Row(name, "pass", f"{n} ranks on {n} GPUs of their own ({_names(r['gpu']['name'] for r in ranks)}; "
               f"{'/'.join(str(c) for c in sorted(per_node.values()))} per node), by UUID")


def transport_row(results: Path, ranks: list, want: Declared) -> Row:
    name = "NCCL transport"
    if not any(r["gpu"] for r in ranks):
        if not want.gpus:
            return Row(name, "not judged (gloo)", "CPU-only profile: gloo joins the ranks over TCP; no NCCL")
        return Row(name, "not judged (gloo)", "the ranks ran on the CPU (row 'GPU per rank'): NCCL never ran",
                   f"{name}: judged once the ranks run on GPUs: fix 'GPU per rank' first", blocks=True)
    logs = sorted(results.glob("nccl-*.log"))
    lines = [line for log in logs for line in log.read_text(errors="replace").splitlines()]
    between = Counter(m[1] for line in lines for m in [NET_CHANNEL.search(line)] if m)
    using = sorted({m[1] for line in lines for m in [NET_USING.search(line)] if m})
    where = f"{results}/nccl-*.log"
    if not logs:
        return Row(name, "not judged", f"no NCCL log ({where}): the bandwidth step did not run NCCL with "
                   f"NCCL_DEBUG_FILE", f"{name}: read the log of the step 'bus bandwidth' above", blocks=True)
    if not between:
        return Row(name, "not judged", f"NCCL's log shows no connection between nodes (no 'via NET/' line; "
                   f"network {', '.join(using) or 'not named'})",
                   f"{name}: the all_reduce did not cross nodes: fix the row 'nodes' first", blocks=True)
    used = ", ".join(f"NET/{net} ({count} channel ends)" for net, count in sorted(between.items()))
    if not want.transport:
        return Row(name, "not judged", f"NCCL joined the nodes via {used}; the profile declares no transport",
                   f"{name}: declare the network NCCL must use between the nodes in {want.site}: "
                   f"SITE_NCCL_TRANSPORT=IB for InfiniBand (this run: {', '.join(sorted(between))})", blocks=True)
    wrong = sorted(net for net in between if not net.startswith(want.transport))
    if wrong:
        why = (f"NCCL fell back to TCP sockets between the nodes instead of {want.transport}"
               if "Socket" in wrong else f"NCCL joined the nodes via {', '.join(wrong)}, not {want.transport}")
        return Row(name, "FAIL", f"NCCL joined the nodes via {used}; the profile declares {want.transport}",
                   f"{name}: {why}: make {want.transport} usable to NCCL in site_setup of {want.site} (the "
                   f"centre's NCCL or its network plugin; NCCL_IB_HCA; no NCCL_IB_DISABLE=1 or NCCL_NET), and "
                   f"read NCCL's own 'NET/' lines in {where}")
    return Row(name, "pass", f"NCCL joined the nodes via {used}, as the profile declares ({want.transport})")


def bandwidth_row(results: Path, want: Declared) -> Row:
    name = "all_reduce bus bandwidth"
    path = results / "bandwidth.json"
    if not path.is_file():
        return Row(name, "FAIL", "nothing measured (no bandwidth.json)",
                   f"{name}: read the log of the step 'bus bandwidth' above")
    b = json.loads(path.read_text())
    peak = b["peak"]
    gbit = peak["busbw_gbps"] * 8
    measured = (f"{peak['busbw_gbps']:.2f} GB/s = {gbit:.1f} Gbit/s at {peak['bytes'] / MIB:g} MiB, {b['backend']}, "
                f"{b['world_size']} ranks on {_nodes(b['nodes'])}")
    if b["nodes"] < 2:
        return Row(name, "not judged", f"{measured}: nothing crossed the network",
                   f"{name}: fix the row 'nodes' first", blocks=True)
    if want.link_gbps is None:
        return Row(name, "not judged", f"set SITE_LINK_GBPS in the profile; measured {measured}",
                   f"{name}: set SITE_LINK_GBPS in {want.site}: one node's network bandwidth to the others, "
                   f"Gbit/s, all its NICs together (e.g. 4 x 200 Gbit/s InfiniBand: 800)", blocks=True)
    needed = want.min_share * want.link_gbps
    against = f"{want.min_share:g} x {want.link_gbps:g} Gbit/s declared = {needed:g} Gbit/s"
    if gbit < needed:
        look = ("GLOO_SOCKET_IFNAME in site_setup (gloo may be on the slow network)" if b["backend"] == "gloo" else
                "the row 'NCCL transport', and that NCCL uses every NIC of the node (NCCL_IB_HCA)")
        return Row(name, "FAIL", f"{measured}; below {against}",
                   f"{name}: {gbit:.1f} Gbit/s is under {against}: check {look}; or correct SITE_LINK_GBPS in "
                   f"{want.site} if the nodes' network is slower")
    return Row(name, "pass", f"{measured}; at least {against}")


def lessons_row(nodes: list, want: Declared) -> Row:
    name = "torch and packages"
    count = len(lessons())
    if not nodes:
        return Row(name, "FAIL", "no node wrote its record (node-*.json)",
                   f"{name}: read the log of the step 'environment, data and GPUs' above")
    found = {}  # problem -> (hosts, lesson ids)
    for record in nodes:
        for lesson, problem in record["lessons"]:
            hosts, ids = found.setdefault(problem, (set(), []))
            hosts.add(record["host"])
            if lesson_id(lesson) not in ids:
                ids.append(lesson_id(lesson))
    if not found:
        return Row(name, "pass", f"every one of the {count} lessons of docs/lessons.toml: its torch release "
                   f"({_names(r.get('torch', '-') for r in nodes)}) and packages, on every node")
    lesson_count = len({i for _, ids in found.values() for i in ids})
    return Row(name, "FAIL", f"{lesson_count} of the {count} lessons lack something: "
               + "; ".join(problem for problem in found),
               "\n".join(f"{name}: {_names(hosts)}: {problem} (lessons {', '.join(ids)}): install it in the "
                         f"site's environment (site_setup of {want.site}; pip install -r requirements.txt)"
                         for problem, (hosts, ids) in found.items()))


def precision_row(ranks: list, want: Declared) -> Row:
    name = "precision of the defaults"
    needed = default_precisions()
    if not needed:
        return Row(name, "pass", "every lesson defaults to fp32")
    said = "; ".join(f"{p}, the default of lessons {', '.join(ids)}" for p, ids in needed.items())
    if want.gpus and not any(r["gpu"] for r in ranks):
        return Row(name, "not judged", f"{said}: the ranks ran on the CPU (row 'GPU per rank')",
                   f"{name}: judged on the GPUs: fix 'GPU per rank' first", blocks=True)
    problems = [(r, p, line) for r in ranks for p, line in r["precision"].items() if line]
    if problems:
        r, p, line = problems[0]
        what = (f"{r['gpu']['name']} (compute capability {r['gpu']['capability']}) on "
                f"{_names(x['host'] for x, q, _ in problems if q == p)}" if r["gpu"] else f"the CPU of {r['host']}")
        other = "fp16" if r["gpu"] else "fp32"
        return Row(name, "FAIL", f"{said}: not on {len({x['rank'] for x, _, _ in problems})} of {len(ranks)} "
                   f"ranks ({what}): {line}",
                   f"{name}: lessons {', '.join(needed[p])} default to --precision {p}, which {what} cannot compute "
                   f"natively: have the learners add --precision {other} (and say why), or book GPUs of compute "
                   f"capability 8.0 or newer")
    gpus = sorted({f"{r['gpu']['name']} {r['gpu']['capability']}" for r in ranks if r["gpu"]})
    where = f"on every GPU ({', '.join(gpus)})" if gpus else "in the CPU's autocast on every rank"
    return Row(name, "pass", f"{said}: native {where}")


def step_rows(results: Path) -> list:
    steps = [line.split("\t") for line in (results / "steps.tsv").read_text().splitlines() if line.strip()]
    hints = {"environment, data and GPUs": "read its log above; the rows below say what each rank and node found",
             "all_reduce across nodes": "ranks on different nodes cannot reach each other: NCCL_SOCKET_IFNAME/"
                                        "GLOO_SOCKET_IFNAME in the profile's site_setup, the open port range",
             "bus bandwidth": "as for all_reduce across nodes",
             "day-1 lesson (6)": "read its log above: DDP on one node, what day 1 stands on",
             "DDP lesson (10)": "read its log above; lesson 9 passing means the network is fine",
             "day-3 lesson (15)": "read its log above; a torch too old for it is named in the row 'torch and packages'",
             "day-4 lesson (20)": "read its log above; a torch too old for it is named in the row 'torch and packages'"}
    rows = []
    for step, code, seconds in steps:
        ok = code == "0"
        rows.append(Row(step, "pass" if ok else f"FAIL (exit {code})", f"{float(seconds):.0f} s",
                        None if ok else f"{step}: {hints.get(step, 'read its log above')}"))
    return rows


def verdict(results: Path, want: Declared) -> int:
    """The job's table: every step (results/steps.tsv: name, exit code, seconds), then each judged row, then
    the nodes; READY (exit 0) only when every row passes."""
    ranks, nodes = _records(results, "rank-*.json"), _records(results, "node-*.json")
    rows = step_rows(results)
    if ranks:
        rows += [nodes_row(ranks, want), gpu_row(ranks, want), transport_row(results, ranks, want)]
    else:
        rows.append(Row("ranks", "FAIL", "no rank wrote its record (rank-*.json)",
                        "ranks: read the log of the step 'environment, data and GPUs' above"))
    rows += [bandwidth_row(results, want), lessons_row(nodes, want)]
    if ranks:
        rows.append(precision_row(ranks, want))
    for found in nodes:
        gpus = f"{found.get('gpus', 0)} GPU(s) {', '.join(found.get('gpu_names', []))}".strip()
        rows.append(Row(f"node {found['host']}", "pass" if not found["problems"] else "FAIL",
                        f"torch {found.get('torch', '-')}, {gpus}",
                        "\n".join(f"node {found['host']}: {p}" for p in found["problems"]) or None))
    width = max(len(r.name) for r in rows)
    print("\nreadiness verdict", flush=True)
    print(f"  (against {want.site}: {_nodes(want.nodes) if want.nodes else '? nodes'}, SITE_GPU_FLAG={want.gpu_flag}, SITE_NCCL_TRANSPORT="
          f"{want.transport or '(none)'}, SITE_LINK_GBPS={want.link or '(none)'},"
          f" SITE_MIN_BUSBW_SHARE={want.min_share:g})", flush=True)
    for row in rows:
        print(f"  {row.name:{width}}  {row.status:18}  {row.detail}", flush=True)
    ready = all(row.ready for row in rows)
    fixes = [line for row in rows if not row.ready and row.fix for line in row.fix.splitlines()]
    print("READY: every check passed" if ready else "NOT READY; to fix:\n  " + "\n  ".join(fixes), flush=True)
    return 0 if ready else 1


def main(argv=None) -> int:
    from course.launching.cli import Parser

    p = Parser(prog="python course/readiness.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("settings", "rank", "bandwidth", "verdict"):
        s = sub.add_parser(name)
        s.add_argument("results", type=Path, help="the job's results directory")
    for name in ("settings", "verdict"):
        s = sub.choices[name]
        s.add_argument("--site", default="", help="the site profile's file, named in the fixes")
        s.add_argument("--nodes", default="", help="the job's nodes (SLURM_JOB_NUM_NODES)")
        s.add_argument("--ranks", default="", help="the job's ranks (SLURM_NTASKS)")
        s.add_argument("--gpu-flag", default="none", help="SITE_GPU_FLAG: none is a CPU-only profile")
        s.add_argument("--nccl-transport", default="", help="SITE_NCCL_TRANSPORT: IB, Socket, ...; empty: none")
        s.add_argument("--link-gbps", default="", help="SITE_LINK_GBPS: a node's network, Gbit/s; empty: none")
        s.add_argument("--min-busbw-share", default="",
                       help=f"SITE_MIN_BUSBW_SHARE: of --link-gbps; empty: {DEFAULT_MIN_SHARE}")
    sub.choices["bandwidth"].add_argument("--max-mib", type=int, default=None,
                                          help=f"largest message, MiB (not given: 1024 on GPUs, {CPU_MAX_MIB} on CPUs)")
    sub.choices["bandwidth"].add_argument("--iters", type=int, default=5, help="timed all_reduces per size")
    sub.choices["bandwidth"].add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits")
    args = p.parse_args(argv)
    if args.what == "rank":
        return rank(args.results)
    if args.what == "bandwidth":
        return bandwidth(args.results, args.max_mib, args.iters, args.timeout)
    want, problems = declared_from(args)
    for line in problems:
        print(f"readiness: error: {line}", file=sys.stderr, flush=True)
    if problems:
        return 2
    if args.what == "settings":
        print(f"readiness: judged against {want.site}: SITE_GPU_FLAG={want.gpu_flag}, SITE_NCCL_TRANSPORT="
              f"{want.transport or '(none: not judged, NOT READY)'}, SITE_LINK_GBPS="
              f"{want.link or '(none: not judged, NOT READY)'}, "
              f"SITE_MIN_BUSBW_SHARE={want.min_share:g}", flush=True)
        return 0
    return verdict(args.results, want)


if __name__ == "__main__":
    sys.exit(main())
