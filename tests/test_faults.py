"""What goes wrong, and how the course behaves when it does.

- A rank killed with SIGKILL in the middle of training ends the whole job, under the lesson's own launcher
  and under torchrun: a non-zero exit within KILL_BOUND seconds (measured here: see test), a message that
  names the killed rank, and no process of the job left running.
- Every init_process_group has a timeout; a rank that cannot reach rank 0 fails within it, in one line.
- Bad input: one line that says what is wrong and how to fix it, a non-zero exit, nothing half-written.
- Two preparations of the data at once, and two runs writing the same default run dir at once, do not
  corrupt each other.
- Security: weights_only=True on every torch.load; TensorBoard and Jupyter bound to 127.0.0.1; no fixed port.
- A finished rank leaves no gloo thread running into interpreter shutdown, where it can abort the process.
"""
import ast
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import PYTHON, REPO, run
from test_fault_tolerance import Running, descendants, parent, start_time

KILL_BOUND = 60  # seconds from SIGKILL to the job's exit; the ranks' --timeout is far above it (120 s)
SMALL = ["--train-samples", "640", "--batch-size", "32"]  # 10 steps per epoch at 2 ranks
SRUN_RANK = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_LOCALID": "0",
             "SLURM_JOB_ID": "4242"}  # what srun gives a task: enough for course.launching to take the srun path


def one_line(proc, code, *phrases):
    """The process exited with `code` and said, in one line on stderr, everything in `phrases`."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stderr}"
    assert len(lines) == 1, f"expected one line:\n{proc.stderr}"
    for phrase in phrases:
        assert phrase in lines[0], f"{phrase!r} not in: {lines[0]}"
    return lines[0]


def files_under(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.exists() else []


# ------------------------------------------------------------------------------------------ SIGKILL

def socket_count(pid: int) -> int:
    """The sockets `pid` holds (TCP, UDP and Unix: psutil finds them among its open files)."""
    process = psutil.Process(pid) if psutil.pid_exists(pid) else None
    connections = getattr(process, "net_connections", None) or getattr(process, "connections", None)  # psutil < 6
    try:
        return len(connections(kind="all")) if connections else 0
    except psutil.Error:
        return 0


def self_launched_ranks(job: Running, world: int = 2) -> dict:
    """rank -> pid of `python lesson.py --nproc N`: the processes started for its ranks, in rank order.  They
    are forked from the launcher itself (its children, with its command line), or from its fork server, whose
    children they are (with COURSE_START_METHOD=spawn: fresh interpreters running multiprocessing's
    spawn_main)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        spawned = [pid for pid in descendants(job.proc.pid) if "spawn_main" in cmdline(pid)
                   or "forkserver" in cmdline(pid) and "forkserver" in cmdline(parent(pid))
                   or parent(pid) == job.proc.pid and cmdline(pid) == cmdline(job.proc.pid)]
        if len(spawned) == world:
            return dict(enumerate(sorted(spawned, key=lambda pid: (start_time(pid), pid))))
        time.sleep(0.1)
    raise AssertionError(f"no {world} ranks under {job.proc.pid}:\n{job.output}")


def torchrun_ranks(job: Running, world: int = 2) -> dict:
    """rank -> pid of the workers of a torchrun agent, from the RANK each one has in its environment."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ranks = {}
        for pid in descendants(job.proc.pid):
            env = environ(pid)
            if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
                ranks[int(env["RANK"])] = pid
        if len(ranks) == world:
            return ranks
        time.sleep(0.1)
    raise AssertionError(f"no {world} torchrun workers under {job.proc.pid}:\n{job.output}")


def cmdline(pid: int) -> str:
    """`pid`'s command line, its words joined by spaces; "" where it has gone (or is a zombie)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def environ(pid: int) -> dict:
    """The environment `pid` started with; {} where it has gone or is not ours to read."""
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


# lesson, launcher, extra arguments, what shows that training has started (a line, or: its sockets are up).
# One case per way the survivors meet the dead rank: lesson 3's broadcast, lesson 4's own all_reduce, lesson
# 5's under the profiler, DDP's buckets (lesson 6; lessons 7 and 8 train through the same DDP wrap and
# launcher), lesson 12's stop-flag all_reduce, and torchrun's agent (lesson 10; lesson 12 under torchrun with
# a killed rank: tests/test_fault_tolerance.py, where torchrun restarts it).
KILL_CASES = [
    ("day1/3_mnist_distributed.py", "self", ["--epochs", "1000"], None),
    ("day1/4_mnist_manual_ddp.py", "self", ["--epochs", "1000"], r"^\[rank 0\] epoch 0:"),
    ("day1/6_mnist_ddp_pt.py", "self", ["--epochs", "1000"], r"^\[rank 0\] epoch 0:"),
    ("day2/12_ddp_fault_tolerance.py", "self", ["--epochs", "1000"], r"^\[rank 0\] epoch 0:"),
    ("day1/5_mnist_manual_ddp_profile.py", "self", ["--epochs", "1000"], r"^\[rank 0\] epoch 0:"),
    ("day2/10_mnist_ddp_pt_multinode.py", "torchrun", ["--epochs", "1000"], r"^\[rank 0\] epoch 0:"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script, launcher, extra, started", KILL_CASES,
                         ids=[f"{Path(c[0]).stem.split('_')[0]}-{c[1]}" for c in KILL_CASES])
def test_a_rank_killed_mid_training_ends_the_whole_job(dataset, tmp_path, script, launcher, extra, started):
    args = [*SMALL, *extra, "--run-dir", tmp_path]
    if launcher == "self":
        job = Running([PYTHON, REPO / script, "--nproc", "2", *args])
    else:
        job = Running([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       REPO / script, *args])
    victim = 1
    try:
        ranks = self_launched_ranks(job) if launcher == "self" else torchrun_ranks(job)
        if started:
            job.wait_for(started)
        else:  # lesson 3 prints nothing until the end: its process group is up once it holds its sockets
            deadline = time.monotonic() + 120
            while socket_count(ranks[victim]) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # then it loads the data and trains, alone
        job.record_tree()
        assert job.proc.poll() is None, f"the job ended before the kill:\n{job.output}"
        os.kill(ranks[victim], signal.SIGKILL)
        killed = time.monotonic()
        code = job.finish(timeout=KILL_BOUND + 60)
        seconds = time.monotonic() - killed
    finally:
        job.kill()
    print(f"{script} ({launcher}): exit {code} {seconds:.1f} s after SIGKILL")
    assert code != 0, job.output
    assert seconds <= KILL_BOUND, f"{seconds:.1f} s\n{job.output}"
    if launcher == "self":
        assert f"error: rank {victim} was killed by SIGKILL; the other ranks were stopped" in job.output, job.output
    else:  # torchrun's summary names the failed rank, its exit code -9 and its pid
        assert re.search(rf"rank\s*:\s*{victim} \(local_rank: {victim}\)\s*\n\s*exitcode\s*:\s*-9 \(pid: "
                         rf"{ranks[victim]}\)", job.output), job.output
    assert not job.left_behind(), f"left running: {job.left_behind()}\n{job.output}"
    assert not (tmp_path / "metrics.json").exists()


# ------------------------------------------------------------------------------------------ init timeouts

def test_every_process_group_init_has_a_timeout():
    calls = []
    for path in [*REPO.glob("day*/*.py"), *REPO.glob("course/**/*.py"), *REPO.glob("benchmarks/*.py"),
                 *REPO.glob("data_tools/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == \
                    "init_process_group":
                calls.append((path.relative_to(REPO), node.lineno, {k.arg for k in node.keywords}))
    assert len(calls) >= 12, calls  # lessons 0-12 but 2, and the benchmarks
    assert [c for c in calls if "timeout" not in c[2]] == []


def test_every_group_a_lesson_creates_has_a_timeout():
    """A group made after init_process_group does not inherit its timeout (torch 2.14.1: new_group and
    split_group wait 30 minutes with gloo, 10 with NCCL, unless told): every dist.new_group names one, and every
    init_device_mesh of two or more dimensions passes backend_override (course/launching/devices.py,
    mesh_timeouts).  A 1-D mesh over every rank is the default group itself.  tests/test_device_check.py reads
    the timeouts of the running groups."""
    calls = []
    for path in [*REPO.glob("day*/*.py"), *REPO.glob("course/**/*.py")]:
        if path == REPO / "course" / "fit.py":  # meshes on the fake process group, whose collectives never wait
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node.func, "attr", getattr(node.func, "id", "")) if isinstance(node, ast.Call) else ""
            dims = len(node.args[1].elts) if name == "init_device_mesh" and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Tuple) else 1
            if name == "new_group" or dims > 1:
                calls.append((str(path.relative_to(REPO)), node.lineno, {k.arg for k in node.keywords}))
    assert {c[0] for c in calls} >= {"day3/16_distributed_checkpoint.py", "day4/20_device_mesh_2d.py"}, calls
    assert [c for c in calls if not {"timeout", "backend_override"} & c[2]] == []


@pytest.mark.parametrize("addr", ["192.0.2.1", "no-such-host.invalid"])  # TEST-NET-1 is never routed
def test_a_rank_that_cannot_reach_rank0_gives_up_within_the_timeout(monkeypatch, addr):
    from course.launching.cli import CourseError
    from course.launching.ports import wait_for_rank0

    with socket.socket() as s:  # a port nobody listens on (for the address that does answer)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", addr)
    monkeypatch.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    with pytest.raises(CourseError, match=rf"rank 1 could not reach rank 0 at MASTER_ADDR={re.escape(addr)} "
                                          rf"MASTER_PORT={port} within --timeout 3 s"):
        wait_for_rank0(1, 3)
    assert time.monotonic() - start <= 3.5  # init_process_group alone took up to 2x its timeout here


@pytest.mark.slow
def test_unreachable_master_addr_is_one_line_and_no_hang(dataset, tmp_path):
    """Rank 1 of an srun job whose MASTER_ADDR points nowhere.  (Rank 0 told to listen on another host stops
    before it starts: tests/test_every_input.py.)"""
    env = {**SRUN_RANK, "SLURM_PROCID": "1", "SLURM_NODEID": "1", "MASTER_ADDR": "192.0.2.1",
           "MASTER_PORT": "29731"}
    start = time.monotonic()
    proc = run([PYTHON, REPO / "day2/12_ddp_fault_tolerance.py", "--timeout", "3", "--run-dir", tmp_path],
               env=env, check=False, timeout=120)
    print(f"rank 1, unreachable MASTER_ADDR, --timeout 3: exit after {time.monotonic() - start:.1f} s "
          f"(including Python and torch start-up)")
    one_line(proc, 1, "[rank 1] error: rank 1 could not reach rank 0 at MASTER_ADDR=192.0.2.1",
             "within --timeout 3 s")
    assert files_under(tmp_path) == []


@pytest.mark.slow
def test_a_rank_stuck_after_its_work_does_not_hang_the_job():
    """Rank 1 finishes but cannot exit (a thread that never ends: Python waits for it).  The job ends
    COURSE_EXIT_GRACE seconds later (60 by default; 3 here), names the rank, and exits 1."""
    start = time.monotonic()
    proc = run([PYTHON, REPO / "tests" / "stuck_at_exit.py", "--nproc", "2"], env={"COURSE_EXIT_GRACE": "3"},
               check=False, timeout=120)
    took = time.monotonic() - start
    assert proc.stdout.count("] done") == 2
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "rank 1 finished its work but had not exited 3 s later" in lines[0]
    assert took < 60, f"{took:.0f} s"


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**SRUN_RANK, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        proc = run([PYTHON, REPO / "day1/0_torch_dist.py"], env=env, check=False, timeout=120)
    one_line(proc, 1, f"port {port} on 127.0.0.1 is already in use", "MASTER_PORT=<free port>")


# ------------------------------------------------------------------------------------------ bad input

LESSON12 = REPO / "day2/12_ddp_fault_tolerance.py"


def test_bad_arguments_from_the_command_line(tmp_path):
    """End to end, in a fresh interpreter, the exit code the shell sees: the one such refusal of `python lesson.py`.
    The other refusals before any rank starts run in this process: tests/test_every_input.py (which names the
    one end-to-end refusal of each other way of launching), and the damaged inputs below."""
    proc = run([PYTHON, LESSON12, "--nproc", "0", "--run-dir", tmp_path / "run"], check=False)
    one_line(proc, 2, "python day2/12_ddp_fault_tolerance.py: error: argument --nproc: 0 must be at least 1")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["day1/4_mnist_manual_ddp.py", "day1/6_mnist_ddp_pt.py",
                                    "day1/7_mnist_ddp_pt_timing.py", "day1/8_mnist_ddp_pt_lr.py",
                                    "day2/12_ddp_fault_tolerance.py"])
def test_more_nccl_ranks_than_gpus_is_one_line(lesson_main, dataset, tmp_path, script):
    gpus = torch.cuda.device_count()
    proc = lesson_main(script, "--backend", "nccl", "--nproc", gpus + 1, "--run-dir", tmp_path)
    one_line(proc, 1, f"--backend nccl with {gpus + 1} ranks needs {gpus + 1} GPUs", "--backend gloo")
    assert files_under(tmp_path) == []


def make_data_dir(root: Path, damage=None) -> Path:
    """A prepared data dir made of links to the real files, with one file replaced by a damaged copy."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    real = REPO / "data" / "FashionMNIST"
    for f in (real / "raw").iterdir():
        (raw / f.name).symlink_to(f)
    (root / "FashionMNIST" / "READY").write_text((real / "READY").read_text())
    if damage:
        name, data = damage((real / "raw" / "t10k-labels-idx1-ubyte").read_bytes())
        (raw / name).unlink()
        (raw / name).write_bytes(data)
    return root


@pytest.mark.parametrize("case, phrases", [
    ("missing", ["fashion-mnist is not prepared in", "run: python data_tools/prepare_data.py"]),
    ("empty", ["fashion-mnist is not prepared in", "run: python data_tools/prepare_data.py"]),
    ("truncated", ["is damaged", "t10k-labels-idx1-ubyte: truncated: 5000 bytes, expected 10008", "--force",
                   "rebuild it with: python data_tools/prepare_data.py --dataset fashion-mnist --data-dir"]),
    ("wrong magic", ["is damaged", "magic number 0x00000803, expected 0x00000801", "--force"]),
    ("no READY", ["fashion-mnist is not prepared in", "run: python data_tools/prepare_data.py"]),
])
def test_a_missing_empty_or_corrupt_data_dir_is_one_line(lesson_main, dataset, tmp_path, case, phrases):
    data = tmp_path / "data"
    if case == "empty":
        data.mkdir()
    elif case == "truncated":
        make_data_dir(data, lambda b: ("t10k-labels-idx1-ubyte", b[:5000]))
    elif case == "wrong magic":
        make_data_dir(data, lambda b: ("t10k-labels-idx1-ubyte", b"\x00\x00\x08\x03" + b[4:]))
    elif case == "no READY":
        make_data_dir(data)
        (data / "FashionMNIST" / "READY").unlink()
    for script in ("day2/12_ddp_fault_tolerance.py", "day1/6_mnist_ddp_pt.py"):
        one_line(lesson_main(script, "--data-dir", data, "--run-dir", tmp_path / "run"), 1, *phrases)
    assert not (tmp_path / "run").exists()  # nothing written, not even an empty run dir


def _h5_file(path, width=28):
    import h5py
    import numpy as np

    with h5py.File(path, "w") as f:
        f.attrs.update(format="course-mnist-h5", version=1, dataset="fashion-mnist", chunk_samples=100)
        for split, n in (("train", 60000), ("test", 10000)):
            f.create_dataset(f"{split}/images", shape=(n, 28, width), dtype=np.uint8, chunks=(100, 28, width))
            f.create_dataset(f"{split}/labels", shape=(n,), dtype=np.uint8, chunks=(100,))


def _h5_wrong_shape(path):
    _h5_file(path, width=27)


def _h5_missing_group(path):
    import h5py

    _h5_file(path)
    with h5py.File(path, "a") as f:
        del f["test"]


@pytest.mark.parametrize("make, phrase", [(_h5_wrong_shape, "train/images is uint8 (60000, 28, 27), expected"),
                                          (_h5_missing_group, "no dataset test/")])
def test_an_hdf5_file_with_wrong_shapes_or_missing_groups_is_one_line(lesson_main, dataset, tmp_path, make,
                                                                      phrase):
    bad = tmp_path / "bad.h5"
    make(bad)
    env = {**SRUN_RANK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # lesson 11 as the one task of an srun step
    proc = lesson_main("day2/11_mnist_ddp_pt_multinode_streaming.py", "--h5-file", bad,
                       "--run-dir", tmp_path / "run", env=env)
    one_line(proc, 1, phrase, "create_mnist_h5.py", "--force")
    assert files_under(tmp_path / "run") == []


def test_the_multinode_launchers_outside_any_allocation_say_so():
    """The lessons themselves, outside any launcher: tests/test_day2_lessons.py and tests/test_every_input.py."""
    env = {k: "" for k in os.environ if k.startswith("SLURM_")}
    for script in ("day2/multinode_setup_and_run.sh", "slurm/12_ddp_fault_tolerance.sh"):
        proc = run(["env", *[f"-u{k}" for k in env], "bash", REPO / script, "10_mnist_ddp_pt_multinode.py"],
                   check=False)
        assert proc.returncode == 1, proc.stderr
        assert re.match(r"error: not inside a Slurm (allocation|job)", proc.stderr), proc.stderr


def test_a_site_profile_without_a_required_value_is_one_line(tmp_path):
    profile = tmp_path / "mysite.env"
    profile.write_text("SITE_DESCRIPTION='needs an account'\nSITE_ACCOUNT=''\nSITE_ACCOUNT_REQUIRED=yes\n"
                       "SITE_GPU_FLAG=none\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITE_")}
    proc = subprocess.run(["bash", REPO / "slurm/submit.sh", "12_ddp_fault_tolerance", "--site", profile,
                           "--dry-run"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    one_line(proc, 1, "site mysite needs an account", "SITE_ACCOUNT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mysite.env"]  # no logs/, nothing submitted


# ------------------------------------------------------------------------------------------ concurrency

@pytest.mark.slow
def test_two_preparations_at_once_do_not_corrupt_the_data_dir(tmp_path):
    data = tmp_path / "data"
    cmd = [PYTHON, REPO / "data_tools/prepare_data.py", "--dataset", "fashion-mnist", "--data-dir", data,
           "--source", REPO / "data" / "FashionMNIST" / "raw"]
    procs = [subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(p.name for p in data.iterdir()) == [".FashionMNIST.lock", "FashionMNIST"]  # no temp dirs
    from data_tools.datasets import load_split, read_split

    for split in ("train", "test"):
        mine, real = load_split("fashion-mnist", split, data), read_split(REPO / "data/FashionMNIST/raw", split)
        assert torch.equal(mine[0], torch.from_numpy(real[0].copy()))


@pytest.mark.slow
def test_two_runs_writing_the_same_default_run_dir_at_once_leave_complete_files(dataset, tmp_path):
    """Both runs of lesson 2 use the default run dir (runs/2_mnist_training under their working directory);
    every file is written to a temporary name and renamed, so each file is one run's, whole."""
    cmd = [PYTHON, REPO / "day1/2_mnist_training.py", *SMALL, "--max-steps", "15"]
    jobs = [Running(cmd, cwd=tmp_path), Running([*cmd[:-2], "--max-steps", "12"], cwd=tmp_path)]
    codes = [job.finish(timeout=400) for job in jobs]
    assert codes == [0, 0], [job.output for job in jobs]
    run_dir = tmp_path / "runs" / "2_mnist_training"
    assert sorted(p.name for p in run_dir.iterdir()) == ["loss.png", "metrics.json", "model.pt"]  # no temp files
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["steps"] in (12, 15) and len(m["loss_per_step"]) == m["steps"]
    state = torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)
    assert len(state) == 4 and all(torch.isfinite(t).all() for t in state.values())  # the MLP's 2 layers
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ security

def _sources() -> list:
    """The checkout's files of these kinds, outside its venv, its runs and git's own directory (not walked:
    the venv alone holds tens of thousands of files, and every pytest process collects this module)."""
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in (".venv", "runs", ".git"))
        found += [Path(root) / f for f in sorted(files) if Path(f).suffix in (".py", ".sh", ".md", ".ipynb", ".env")
                  and f != "test_faults.py"]
    return found


SOURCES = _sources()


def test_every_torch_load_is_weights_only():
    loads = []
    for path in SOURCES:
        text = path.read_text(errors="replace")
        if path.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code")
        for match in re.finditer(r"torch\.load\(", text):
            depth, end = 0, match.end() - 1
            for end in range(match.end() - 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            loads.append((path.relative_to(REPO), text[match.start():end + 1]))
    assert loads, "no torch.load found: the scan is broken"
    assert [load for load in loads if "weights_only=True" not in load[1]] == []


def test_tensorboard_and_jupyter_listen_on_localhost_only():
    """Every command line that starts TensorBoard or Jupyter (in code, scripts and docs) binds 127.0.0.1 (the
    docs then say how to reach it through an SSH tunnel); none opens it to the network."""
    commands = []
    for path in SOURCES:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"\btensorboard\s+--|\bjupyter[ -](lab|notebook)\b(?![\w.])", line) and \
                    not re.search(r"install|pip |import ", line):
                commands.append((f"{path.relative_to(REPO)}:{n}", line))
    assert commands, "no TensorBoard or Jupyter command found: the scan is broken"
    open_to_all = [where for where, line in commands
                   if re.search(r"--bind_all|--host[= ]0\.0\.0\.0|--ip[= ]['\"]?(0\.0\.0\.0|\*)", line)]
    assert open_to_all == []
    unbound = [where for where, line in commands
               if not re.search(r"(--host[= ]|--ip[= ]|ServerApp\.ip=)['\"]?(127\.0\.0\.1|localhost)", line)]
    assert unbound == [], "start TensorBoard with --host 127.0.0.1 and Jupyter with --ip=127.0.0.1"


def test_no_fixed_master_port_in_lessons_and_launchers():
    code = [p for p in SOURCES if p.suffix in (".py", ".sh") and p.parts[len(REPO.parts)] != "tests"]
    fixed = []
    for path in code:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"MASTER_PORT\s*[:=]\s*['\"]?\d{4,5}\b|--master[_-]port[= ]\d|\b29500\b", line):
                fixed.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert fixed == []


def _check_many(path_and_times):
    from course.launching.cli import unwritable

    path, times = path_and_times
    return [unwritable(Path(path)) for _ in range(times)]


def test_ranks_checking_one_new_run_dir_at_once_do_not_disturb_each_other(tmp_path):
    """Every rank parses its arguments, and so checks the same run dir, at the same moment (4 ranks of an srun
    step on a fresh checkout); a check that made and removed the run dir itself broke the others' checks."""
    import multiprocessing

    target = tmp_path / "runs" / "lesson"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(_check_many, [(str(target), 300)] * 4)
    assert {r for rs in results for r in rs} == {None}
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left: no run dir, no probe


@pytest.mark.slow
@pytest.mark.parametrize("lesson", ["day1/5_mnist_manual_ddp_profile.py",
                                    pytest.param("day1/6_mnist_ddp_pt.py", marks=pytest.mark.quick("6"))])
def test_the_process_group_ends_where_the_lesson_ends_it(lesson, tmp_path):
    """After destroy_process_group no gloo thread is left: a process group that outlives it still runs its
    threads while the interpreter shuts down, and a rank that has finished its work can then abort
    ('terminate called without an active exception', lesson 5: 2 of 50 runs in a stress loop under load).
    torch.optim imports torch._dynamo on first use, and imported after init_process_group it keeps the
    group alive (torch 2.14); course/launching/launch.py imports it in each rank first.  Lesson 5 also runs the
    profiler, whose thread lives on; lesson 6 wraps the model in DDP."""
    proc = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(REPO / "tests" / "threads_after_lesson.py"), str(REPO / lesson), "--quick",
                "--train-samples", "640", "--run-dir", str(tmp_path / "run")]
               + (["--log-dir", str(tmp_path / "log")] if "profile" in lesson else []),
               check=False, timeout=300, env={"OMP_NUM_THREADS": "1"})
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    for line in lines:
        rank, _, code, _, threads = line.split()[1:]
        assert code == "0", line
        gloo = [name for name in threads.split(",") if "gloo" in name]
        assert not gloo, f"rank {rank} still runs {gloo} after the lesson returned"
