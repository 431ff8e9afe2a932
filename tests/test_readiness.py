"""The trainer's readiness check (scripts/readiness_check.sh, course/readiness.py): READY only when every row of
its verdict holds, and each row that does not gives its fix in one line.

- On the course's two-node test Slurm, two real jobs at once: the CPU-only profile on 2 nodes x 2 ranks
  (gloo) checks every rank and both nodes, runs lessons 9, 6, 10, 15 and 20, measures all_reduce bus bandwidth
  against the profile's link speed, and says READY; a GPU profile on one node with no data (the test nodes'
  GPUs are device files: Slurm grants them, torch sees none) says NOT READY and names the node count, the
  ranks on the CPU and the data.
- Simulated: the real rank step (`python course/readiness.py rank`) on two "nodes" of this machine with a GPU
  cluster's answers faked (tests/fake_cuda/sitecustomize.py), bandwidth.json and NCCL's log as the job's steps
  write them (NCCL's own line formats), then the real verdict: READY when all holds; NOT READY with the fix for
  each of: no visible GPU, two ranks on one GPU, Socket where the profile declares IB, bus bandwidth below the
  declared share, no declared link speed, torch below a lesson's floor, a missing package, GPUs without
  native bf16 (the default of lessons 13 and 14).
- The profile's readiness values (SITE_NCCL_TRANSPORT, SITE_LINK_GBPS, SITE_MIN_BUSBW_SHARE): each bad one is
  one line and nothing is submitted.
"""
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from conftest import PYTHON, REPO
from course.checkpoints import hf
from course.gpt import GPT

READINESS = REPO / "course" / "readiness.py"
FAKE_CUDA = REPO / "tests" / "fake_cuda"
H100, V100 = "NVIDIA H100 80GB HBM3|9.0", "Tesla V100-SXM2-32GB|7.0"
GPU_SITE = {"site": "slurm/sites/mycluster.env", "gpu_flag": "gres", "nccl_transport": "IB", "link_gbps": "200"}
STEPS = ("environment, data and GPUs", "all_reduce across nodes", "bus bandwidth", "day-1 lesson (6)",
         "DDP lesson (10)", "day-3 lesson (15)", "day-4 lesson (20)")


def table(out: str) -> str:
    """The verdict as readiness_check.sh prints it: from its title to the end."""
    return out[out.index("readiness verdict"):]


def row(out: str, name: str) -> tuple:
    """(status, detail) of the verdict's row `name`."""
    found = re.search(rf"^  {re.escape(name)} +(pass|FAIL(?: \(exit \d+\))?|not judged(?: \(gloo\))?) +(.*)$",
                      out, flags=re.M)
    assert found, (name, out)
    return found[1], found[2]


def fixes(out: str) -> list:
    said = out.split("NOT READY; to fix:\n", 1)[1] if "NOT READY; to fix:" in out else ""
    return [line.strip() for line in said.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------- simulated: the verdict

def rank_steps(results, data_dir, gpu=H100, nodes=2, per_node=2, visible=None, env=None):
    """The real rank step for every rank of a simulated job (srun's variables, Slurm's GPU variables, a faked
    GPU model or none), all at once: the processes."""
    procs = []
    for node in range(nodes):
        for local in range(per_node):
            rank = node * per_node + local
            variables = {k: v for k, v in os.environ.items()
                         if not k.startswith(("SLURM_", "COURSE_FAKE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
            variables.update({
                "PYTHONPATH": str(FAKE_CUDA), "COURSE_FAKE_HOST": f"node{node + 1}", "COURSE_DATA_DIR": str(data_dir),
                "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
                "SLURM_STEP_NUM_TASKS": str(nodes * per_node), "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
                "SLURM_GPUS_ON_NODE": str(per_node),
                "CUDA_VISIBLE_DEVICES": visible if visible is not None else ",".join(map(str, range(per_node))),
                **(env or {})})
            if gpu:
                variables["COURSE_FAKE_GPU"] = f"{gpu}|{len(variables['CUDA_VISIBLE_DEVICES'].split(','))}"
            procs.append(subprocess.Popen([PYTHON, READINESS, "rank", results], env=variables, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def nccl_log(results, network, hosts=("node1", "node2"), per_node=2):
    """NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET lines of the bandwidth step, one file per process as
    NCCL_DEBUG_FILE=nccl-%h-%p.log writes them, in NCCL's formats (src/debug.cc: "host:pid:tid [dev] NCCL INFO
    ..."; src/transport/net.cc, net_ib, net_socket, src/init.cc): a ring that crosses to the other node once."""
    n = len(hosts) * per_node
    for h, host in enumerate(hosts):
        for local in range(per_node):
            rank, pid = h * per_node + local, 4100 + h * per_node + local
            lines = ["NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.%d<0>" % (h + 1)
                     if network == "IB" else "NET/IB : No device found.",
                     f"NET/Socket : Using [0]eth0:192.168.0.{h + 1}<0>", f"Using network {network}"]
            peer = (rank + 1) % n
            gdr = "/GDRDMA" if network == "IB" else ""
            if peer // per_node != h:  # the ring leaves the node here: the network
                lines.append(f"Channel 00/0 : {rank}[{local}] -> {peer}[0] [send] via NET/{network}/0{gdr}")
            else:
                lines.append(f"Channel 00/0 : {rank}[{local}] -> {peer}[{local + 1}] via P2P/CUMEM/read")
            before = (rank - 1) % n
            if before // per_node != h:
                lines.append(f"Channel 00/0 : {before}[{per_node - 1}] -> {rank}[{local}] [receive] "
                             f"via NET/{network}/0{gdr}")
            (results / f"nccl-{host}-{pid}.log").write_text(
                "".join(f"{host}:{pid}:{pid + 40} [{local}] NCCL INFO {line}\n" for line in lines))


def bandwidth_json(results, backend="nccl", busbw=22.0, ranks=4, nodes=2):
    """bandwidth.json as the bandwidth step writes it: its largest size is the peak here."""
    algbw = busbw * ranks / (2 * (ranks - 1))
    rows = [{"bytes": 2 ** 30, "seconds": 2 ** 30 / (algbw * 1e9), "algbw_gbps": algbw, "busbw_gbps": busbw}]
    (results / "bandwidth.json").write_text(json.dumps(
        {"backend": backend, "world_size": ranks, "nodes": nodes, "rows": rows, "peak": rows[-1]}))


def steps_tsv(results):
    (results / "steps.tsv").write_text("".join(f"{step}\t0\t9\n" for step in STEPS))


def verdict(results, capsys, nodes=2, ranks=4, **declared) -> tuple:
    """The real verdict (course/readiness.py verdict) of a results directory: (exit code, what it printed)."""
    from course import readiness

    options = {**GPU_SITE, **declared}
    argv = ["verdict", str(results), "--nodes", str(nodes), "--ranks", str(ranks)]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", value]
    capsys.readouterr()
    code = readiness.main(argv)
    out = capsys.readouterr().out
    print(out)  # the table, for pytest -rP
    return code, out


# Each case: the rank step's simulated cluster (rank_steps' arguments), what the other steps wrote.
CASES = {
    "ready": {"env": {"COURSE_MODEL_DIR": "{staged}"}},  # a model staged for lesson 23, whole
    "damaged model": {"env": {"COURSE_MODEL_DIR": "{damaged}"}, "per_node": 1},  # one byte of it changed since
    "no visible GPU": {"gpu": None, "per_node": 1},  # Slurm granted a GPU (CUDA_VISIBLE_DEVICES=0); torch sees none
    "two ranks on one GPU": {"visible": "0"},  # both tasks of a node bound to GPU 0
    "V100": {"gpu": V100, "per_node": 1},
    "torch 2.5": {"env": {"COURSE_FAKE_TORCH": "2.5.1"}, "per_node": 1},
    "no h5py": {"env": {"COURSE_FAKE_MISSING": "h5py"}, "per_node": 1},
}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, dataset):
    """{case: results directory} after the real rank step of every case's ranks (all at once) and the other
    steps' files; the data is prepared (the HDF5 file of lesson 11 is only looked for: an empty one)."""
    from data_tools.datasets import default_data_dir, spec
    from data_tools.h5layout import default_h5_path

    root = tmp_path_factory.mktemp("simulated")
    data = root / "data"
    data.mkdir()
    (data / spec(dataset).folder).symlink_to(default_data_dir() / spec(dataset).folder)
    default_h5_path(dataset, data).touch()
    models = {"{staged}": root / "staged", "{damaged}": root / "damaged"}
    for model_dir in models.values():  # as lesson 22 writes a model: config.json, model.safetensors, SHA256SUMS
        hf.save_whole(model_dir, GPT().state_dict(), GPT().sizes, 64)
    weights = models["{damaged}"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1]))
    started, dirs = {}, {}
    for case, cluster in CASES.items():
        dirs[case] = root / case.replace(" ", "-")
        env = {k: str(models.get(v, v)) for k, v in cluster.get("env", {}).items()}
        started[case] = rank_steps(dirs[case], data, **{**cluster, "env": env})
    for case, procs in started.items():
        for proc in procs:
            out, _ = proc.communicate(timeout=900)  # a hang guard: 17 ranks at once under the suite's load
            assert proc.returncode == 0, (case, out)
        per_node = CASES[case].get("per_node", 2)
        gpus = CASES[case].get("gpu", H100) is not None
        bandwidth_json(dirs[case], "nccl" if gpus else "gloo", 22.0 if gpus else 1.1, ranks=2 * per_node)
        if gpus:
            nccl_log(dirs[case], "IB", per_node=per_node)
        steps_tsv(dirs[case])
    return dirs


def ranks_of(case):
    return 2 * CASES[case].get("per_node", 2)


def test_ready_when_every_row_holds(simulated, capsys):
    code, out = verdict(simulated["ready"], capsys)
    assert code == 0 and out.rstrip().endswith("READY: every check passed"), out
    status, detail = row(out, "GPU per rank")
    assert status == "pass" and "4 ranks on 4 GPUs of their own (NVIDIA H100 80GB HBM3; 2/2 per node)" in detail
    assert row(out, "nodes") == ("pass", "2 nodes, as the job asked (node1, node2)")
    assert row(out, "NCCL transport")[0] == "pass" and "via NET/IB (4 channel ends)" in out
    assert row(out, "all_reduce bus bandwidth") == (
        "pass", "22.00 GB/s = 176.0 Gbit/s at 1024 MiB, nccl, 4 ranks on 2 nodes; at least 0.5 x 200 Gbit/s "
                "declared = 100 Gbit/s")
    lessons = len(tomllib.loads((REPO / "docs" / "lessons.toml").read_text())["lesson"])
    assert row(out, "torch and packages")[0] == "pass" and f"the {lessons} lessons of docs/lessons.toml" in out
    assert row(out, "precision of the defaults") == (
        "pass", "bf16, the default of lessons 13, 14: native on every GPU (NVIDIA H100 80GB HBM3 9.0)")
    ranks = [json.loads((simulated["ready"] / f"rank-{r}.json").read_text()) for r in range(4)]
    assert len({(r["host"], r["gpu"]["uuid"]) for r in ranks}) == 4
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_ranks_on_fewer_nodes_than_the_job_has_are_not_ready(simulated, capsys):
    code, out = verdict(simulated["ready"], capsys, nodes=3)  # a job of 3 nodes whose ranks ran on 2
    assert code == 1 and row(out, "nodes") == ("FAIL", "the ranks ran on 2 of the job's 3 nodes (node1, node2)")
    assert fixes(out) == ["nodes: the ranks did not spread over the job's 3 nodes: give every node its ranks "
                          "(--ntasks-per-node, not --ntasks; see the job's settings at the top of the log)"]


def test_a_gpu_profile_whose_ranks_see_no_gpu_is_not_ready(simulated, capsys):
    code, out = verdict(simulated["no visible GPU"], capsys, ranks=ranks_of("no visible GPU"))
    assert code == 1 and "NOT READY" in out
    assert row(out, "GPU per rank")[0] == "FAIL" and "2 of 2 ranks ran on the CPU (node1, node2)" in out
    assert any(line.startswith("GPU per rank: torch 2.14") and "sees no GPU on node1, though Slurm gave the job "
               "GPUs (CUDA_VISIBLE_DEVICES=0)" in line for line in fixes(out)), out
    # what cannot be judged without GPUs is not READY either
    assert row(out, "NCCL transport")[0] == "not judged (gloo)"
    assert row(out, "precision of the defaults")[0] == "not judged"


def test_two_ranks_on_one_gpu_are_not_ready(simulated, capsys):
    code, out = verdict(simulated["two ranks on one GPU"], capsys)
    assert code == 1 and row(out, "GPU per rank")[0] == "FAIL"
    assert any(line.startswith("GPU per rank: ranks 0, 1 on node1 share one GPU: give each task its own")
               for line in fixes(out)), out


def test_nccl_over_sockets_where_the_profile_declares_ib_is_not_ready(simulated, capsys, tmp_path):
    results = tmp_path / "socket"
    results.mkdir()
    for path in simulated["ready"].glob("*.json"):
        (results / path.name).write_text(path.read_text())
    steps_tsv(results)
    nccl_log(results, "Socket")
    code, out = verdict(results, capsys)
    assert code == 1 and row(out, "NCCL transport")[0] == "FAIL"
    assert "NCCL joined the nodes via NET/Socket (4 channel ends); the profile declares IB" in out
    assert any(line.startswith("NCCL transport: NCCL fell back to TCP sockets between the nodes instead of IB: "
                               "make IB usable to NCCL in site_setup of slurm/sites/mycluster.env")
               for line in fixes(out)), out


def test_bandwidth_below_the_declared_share_or_without_a_declared_speed_is_not_ready(simulated, capsys, tmp_path):
    results = tmp_path / "slow"
    results.mkdir()
    for path in [*simulated["ready"].glob("*.json"), *simulated["ready"].glob("*.log"), simulated["ready"] / "steps.tsv"]:
        (results / path.name).write_text(path.read_text())
    bandwidth_json(results, busbw=9.0)  # 72 Gbit/s: under 0.5 x 200
    code, out = verdict(results, capsys)
    assert code == 1 and row(out, "all_reduce bus bandwidth")[0] == "FAIL"
    assert "NOT READY; to fix:\n  all_reduce bus bandwidth: 72.0 Gbit/s is under 0.5 x 200 Gbit/s declared = " \
           "100 Gbit/s: check the row 'NCCL transport'" in out
    code, out = verdict(results, capsys, min_busbw_share="0.3")  # a share of the profile's own: 60 Gbit/s
    assert code == 0, out
    code, out = verdict(results, capsys, link_gbps="")  # never READY by silence
    assert code == 1 and row(out, "all_reduce bus bandwidth") == (
        "not judged", "set SITE_LINK_GBPS in the profile; measured 9.00 GB/s = 72.0 Gbit/s at 1024 MiB, nccl, "
                      "4 ranks on 2 nodes")
    assert fixes(out) == ["all_reduce bus bandwidth: set SITE_LINK_GBPS in slurm/sites/mycluster.env: one node's "
                          "network bandwidth to the others, Gbit/s, all its NICs together (e.g. 4 x 200 Gbit/s "
                          "InfiniBand: 800)"]
    code, out = verdict(results, capsys, nccl_transport="")
    assert code == 1 and row(out, "NCCL transport")[0] == "not judged"
    assert "SITE_NCCL_TRANSPORT=IB for InfiniBand (this run: IB)" in out


def test_torch_below_a_lessons_floor_is_not_ready(simulated, capsys):
    code, out = verdict(simulated["torch 2.5"], capsys, ranks=ranks_of("torch 2.5"))
    assert code == 1 and row(out, "torch and packages")[0] == "FAIL"
    lines = [line for line in fixes(out) if line.startswith("torch and packages:")]
    assert len(lines) == 3, out  # day 3's floor, day 4's and day 5's, each once for both nodes
    assert lines[0].startswith("torch and packages: node1, node2: torch >= 2.6 for torch.distributed.fsdp.fully_shard")
    assert "this is torch 2.5.1 (lessons 13, 14, 15, 16, 17): install it in the site's environment" in lines[0]
    assert "torch >= 2.14 for" in lines[1] and "(lessons 18, 19, 20, 21)" in lines[1]
    assert "torch >= 2.14 for" in lines[2] and "(lessons 22, 23)" in lines[2]


def test_a_staged_model_that_changed_since_its_digests_is_not_ready(simulated, capsys):
    code, out = verdict(simulated["damaged model"], capsys, ranks=ranks_of("damaged model"))
    assert code == 1 and row(out, "node node1")[0] == "FAIL" and row(out, "node node2")[0] == "FAIL"
    said = [line for line in fixes(out) if line.startswith("node node1: model: ")]
    assert said and "model.safetensors: its SHA-256 is not the one SHA256SUMS lists" in said[0], out


def test_a_missing_package_is_not_ready(simulated, capsys):
    code, out = verdict(simulated["no h5py"], capsys, ranks=ranks_of("no h5py"))
    assert code == 1 and row(out, "torch and packages")[0] == "FAIL"
    assert "torch and packages: node1, node2: h5py (import h5py) (lessons create_mnist_h5, 11): install it in the " \
           "site's environment (site_setup of slurm/sites/mycluster.env; pip install -r requirements.txt)" in out


def test_gpus_without_native_bf16_are_not_ready_for_day_3s_defaults(simulated, capsys):
    code, out = verdict(simulated["V100"], capsys, ranks=ranks_of("V100"))
    assert code == 1 and row(out, "precision of the defaults")[0] == "FAIL"
    assert row(out, "GPU per rank")[0] == "pass"
    assert "precision of the defaults: lessons 13, 14 default to --precision bf16, which Tesla V100-SXM2-32GB " \
           "(compute capability 7.0) on node1, node2 cannot compute natively: have the learners add --precision " \
           "fp16" in out
    ranks = [json.loads((simulated["V100"] / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["gpu"]["bf16_native"] for r in ranks] == [False, False]  # torch.cuda.is_bf16_supported's own answer


def test_the_catalog_and_the_precision_defaults_are_read_from_the_course():
    import tomllib

    from course import readiness

    with open(REPO / "docs" / "lessons.toml", "rb") as f:
        entries = tomllib.load(f)["lesson"]
    assert readiness.catalog() == {entry["script"]: entry["id"] for entry in entries}
    assert readiness.default_precisions() == {"bf16": ["13", "14"]}


# ------------------------------------------------------------------------------ the profile's readiness values

BAD_READINESS_VALUES = {
    "SITE_LINK_GBPS": ["fast", "0", "-5", "1e3", "200 Gbit/s"],
    "SITE_MIN_BUSBW_SHARE": ["0", "1.5", "half"],
    "SITE_NCCL_TRANSPORT": ["IB,Socket", "NET/IB", "9x"],
}


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD_READINESS_VALUES.items() for v in vs])
def test_a_bad_readiness_value_is_one_line_and_nothing_is_submitted(name, value, tmp_path, capsys):
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {calls}\necho "Submitted batch job 1"\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", name: value}
    done = subprocess.run([REPO / "scripts" / "readiness_check.sh", "--site", "cpu-only"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith(f"readiness_check.sh: error: {name}='{value}' (from the environment): ")
    assert lines[0].endswith("Nothing was submitted.") and not calls.exists()
    # the job's own first step says the same, should it be submitted another way
    from course import readiness

    option = {"SITE_LINK_GBPS": "--link-gbps", "SITE_MIN_BUSBW_SHARE": "--min-busbw-share",
              "SITE_NCCL_TRANSPORT": "--nccl-transport"}[name]
    capsys.readouterr()
    assert readiness.main(["settings", str(tmp_path), option, value]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"readiness: error: {name}={value!r}"), said


def test_a_bad_value_in_the_profile_file_is_named_there_and_a_missing_profile_is_submit_shs_line(tmp_path):
    profile = tmp_path / "mycluster.env"
    profile.write_text((REPO / "slurm/sites/cpu-only.env").read_text().replace('SITE_LINK_GBPS=""', "SITE_LINK_GBPS=ten"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITE_")}
    done = subprocess.run([REPO / "scripts/readiness_check.sh", "--site", profile, "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip() == (
        f"readiness_check.sh: error: SITE_LINK_GBPS='ten' in {profile}: the network bandwidth of one node to the "
        f"others in Gbit/s, a number above 0 such as 200, or empty (then the bandwidth is not judged, and the check "
        f"says NOT READY). Nothing was submitted."), done.stderr
    done = subprocess.run([REPO / "scripts/readiness_check.sh", "--site", "nosuch", "--dry-run"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("submit.sh: error: no site profile 'nosuch'"), done.stderr


# ------------------------------------------------------------------------------------------ the real test Slurm

@pytest.fixture(scope="module")
def checks(slurm_cluster, dataset, tmp_path_factory):
    """Both real readiness checks, started at once: the CPU-only profile on 2 nodes x 2 ranks with the data
    (both nodes, 2 of their 4 CPUs), and a GPU profile submitted with --nodes 1 and no data (node1's other 2
    CPUs).  {name: (exit, output, log)}."""
    from data_tools.datasets import default_data_dir, spec
    from data_tools.h5layout import default_h5_path

    work = tmp_path_factory.mktemp("readiness")
    data = work / "data"
    data.mkdir()
    (data / spec(dataset).folder).symlink_to(default_data_dir() / spec(dataset).folder)
    subprocess.run([sys.executable,
                    REPO / "data_tools" / "create_mnist_h5.py", "--data-dir", data], check=True, timeout=120,
                   capture_output=True)
    assert default_h5_path(dataset, data).is_file()
    (work / "empty").mkdir()
    jobs = {
        # the test nodes' link is a veth pair on 2 shared cores: gloo reached 1.7 Gbit/s here (4 MiB, with the
        # other job running), so this job declares 0.5 Gbit/s instead of the profile's 10
        "ready": ([], {"COURSE_DATA_DIR": str(data), "SITE_LINK_GBPS": "0.5"}),
        "one node, GPUs unseen, no data": (["--nodes", "1"], {
            "COURSE_DATA_DIR": str(work / "empty"), "SITE_GPU_FLAG": "gres", "SITE_GPUS_PER_NODE": "2",
            "SITE_NCCL_TRANSPORT": "IB", "SITE_LINK_GBPS": "200"}),
    }
    started = {}
    for name, (options, env) in jobs.items():
        env = {**slurm_cluster.env, "SITE_TASKS_PER_NODE": "2", "SITE_CPUS_PER_TASK": "1", "READINESS_MAX_MIB": "4",
               **env}
        cwd = work / name.replace(" ", "-").replace(",", "")
        cwd.mkdir()
        started[name] = (cwd, subprocess.Popen([REPO / "scripts" / "readiness_check.sh", "--site", "cpu-only",
                                                *options], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True))
    done = {}
    for name, (cwd, proc) in started.items():
        out, _ = proc.communicate(timeout=600)
        log = next((cwd / "logs").glob("readiness-*.out"))
        done[name] = (proc.returncode, out, log.read_text())
    return done


@pytest.mark.slurm
@pytest.mark.slow
def test_the_readiness_check_passes_on_a_ready_cluster_and_reports_its_bandwidth(checks):
    code, out, log = checks["ready"]
    print(out)  # the verdict table, for `pytest -s` or -rP
    assert code == 0, out + log
    assert "READY: every check passed" in out
    for step in STEPS:
        assert re.search(rf"^  {re.escape(step)} +pass +\d+ s$", out, flags=re.M), (step, out)
    for node in ("node1", "node2"):
        assert re.search(rf"^  node {node} +pass +torch 2\.\d+", out, flags=re.M), (node, out)
    assert row(out, "GPU per rank") == ("pass", "CPU-only profile (SITE_GPU_FLAG=none): 4 ranks on the CPU, gloo")
    assert row(out, "nodes") == ("pass", "2 nodes, as the job asked (node1, node2)")
    assert row(out, "NCCL transport") == ("not judged (gloo)", "CPU-only profile: gloo joins the ranks over TCP; "
                                                               "no NCCL")
    assert row(out, "torch and packages")[0] == "pass"
    assert row(out, "precision of the defaults") == (
        "pass", "bf16, the default of lessons 13, 14: native in the CPU's autocast on every rank")
    bw = re.fullmatch(r"([\d.]+) GB/s = ([\d.]+) Gbit/s at [\d.]+ MiB, gloo, 4 ranks on 2 nodes; at least 0.5 x 0.5 "
                      r"Gbit/s declared = 0.25 Gbit/s", row(out, "all_reduce bus bandwidth")[1])
    assert bw and float(bw[2]) >= 0.25, out
    # the table of sizes, nccl-tests' columns, up to READINESS_MAX_MIB
    assert re.search(r"^\s+4194304\s+[\d.]+\s+[\d.]+\s+[\d.]+$", log, flags=re.M), log
    assert "all_reduce(SUM) = 10, mean = 2.5" in log  # lesson 9 on 4 ranks
    assert len(re.findall(r"^readiness: rank \d on node\d: cpu$", log, flags=re.M)) == 4, log
    # Every step of the job listens on the job's derived port: the previous step's port, left in TIME_WAIT, is
    # free to listen on, and no step walks into the next job's derived port (both jobs run at once here).
    ports = set(re.findall(r"rank 0 at node1:(\d+)", log))
    assert len(ports) == 1 and "is in use" not in log, log


@pytest.mark.slurm
@pytest.mark.slow
def test_one_node_gpus_torch_cannot_see_and_no_data_are_not_ready_and_each_fix_is_named(checks):
    code, out, log = checks["one node, GPUs unseen, no data"]
    print(out)
    assert code == 1, out + log
    assert "NOT READY; to fix:" in out
    said = fixes(out)
    assert row(out, "nodes") == ("FAIL", "the job had 1 node (node1); the check needs 2 or more")
    assert any(line.startswith("nodes: submit the check on 2 nodes (its default; no --nodes 1)") for line in said)
    # the test nodes' GPUs are device files: Slurm hands them out, torch sees none, the lessons ran on the CPU
    assert row(out, "GPU per rank")[0] == "FAIL" and "2 of 2 ranks ran on the CPU (node1)" in out
    assert any(re.match(r"GPU per rank: torch 2\.\S+ \(CUDA [\d.]+\) sees no GPU on node1, though Slurm gave the "
                        r"job GPUs \(CUDA_VISIBLE_DEVICES=0,1\)", line) for line in said), out
    assert row(out, "all_reduce bus bandwidth")[0] == "not judged"
    assert row(out, "environment, data and GPUs")[0] == "pass"  # the check itself ran
    assert re.search(r"^  node node1 +FAIL", out, flags=re.M)
    assert any(line.startswith("node node1: data: fashion-mnist is not prepared in") for line in said), out
    assert re.search(r"^  DDP lesson \(10\) +FAIL \(exit \d+\)", out, flags=re.M), out
    assert row(out, "all_reduce across nodes")[0] == "pass"  # the network is fine
