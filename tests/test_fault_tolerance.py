"""Lesson 12: a run stopped by a signal at a random step, or by a crashed rank, resumes to the weights of the
run that was never interrupted, bit for bit; torn checkpoints and checkpoints with bytes flipped in place
(which torch.load loads without a word) are skipped, found by their sha256; the launcher requeues on Slurm.

All runs: 2 ranks (one test: 4), gloo on the CPU, one thread per rank, 1600 samples, batch 32 per rank: 25
steps per epoch, 2 epochs, a checkpoint every 7 steps.  The interrupted runs sleep 0.1 s per step (--step-sleep: it changes
the timing, not the arithmetic) so that a signal sent after a chosen step lands in the middle of training.
"""
import fcntl
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import PYTHON, REPO, environ, metrics, run
from slurm_cluster import follow_requeue

pytestmark = pytest.mark.slow

LESSON = REPO / "day2" / "12_ddp_fault_tolerance.py"
LAUNCHER = REPO / "slurm" / "12_ddp_fault_tolerance.sh"
LOG = "logs/12_ddp_fault_tolerance-{job}.out"  # the launcher's --output, in the cluster's work dir
STEPS = 50  # 2 epochs x 1600 samples / (2 ranks x 32)
TRAIN = ["--train-samples", "1600", "--epochs", "2", "--batch-size", "32", "--seed", "5",
         "--checkpoint-every", "7", "--log-every", "1"]
DETERMINISTIC = {"OMP_NUM_THREADS": "1"}  # the same threads per rank in every run: the same float sums
# torchrun shares its rendezvous store with the workers; after a restart they can read the previous round's
# addresses from it and fail to connect (pytorch/pytorch#135712, measured here 2 runs in 3): a store per round
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# ----------------------------------------------------------------------------------------------- helpers

class Running:
    """A command started in the background whose output (stdout and stderr together) is read as it comes."""

    def __init__(self, cmd, env=None, cwd=REPO):
        self.cmd = [str(c) for c in cmd]
        self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=environ(DETERMINISTIC, env),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines, self.changed = [], threading.Condition()
        self.tree = {}  # pid -> identity() of every process ever seen below this one
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    @property
    def output(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        """The first match of `pattern` in the output; fails if the process ends or time runs out first."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern, re.M)
        while True:
            self.record_tree()
            found = regex.search(self.output)
            if found:
                return found
            if self.proc.poll() is not None and found is None:
                time.sleep(0.2)  # the reader thread may still hold the last lines
                if not regex.search(self.output):
                    raise AssertionError(f"exited {self.proc.returncode} before /{pattern}/:\n{self.output}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no /{pattern}/ within {timeout} s:\n{self.output}")
            with self.changed:
                self.changed.wait(0.1)

    def record_tree(self):
        for pid in descendants(self.proc.pid):
            self.tree.setdefault(pid, identity(pid))

    def finish(self, timeout: float = 180) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.output}") from None
        time.sleep(0.2)
        return code

    def kill(self):
        """End this command and everything below it (test cleanup, by PID)."""
        self.record_tree()
        for pid, process in self.tree.items():
            if is_alive(process):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def left_behind(self, grace: float = 5.0) -> list:
        """Processes of this command still running `grace` seconds after it ended (zombies count as ended)."""
        deadline = time.monotonic() + grace
        while True:
            alive = [pid for pid, process in self.tree.items() if is_alive(process)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)


def identity(pid: int):
    """The process running as `pid` now (a psutil.Process), None where there is none.  psutil tells processes
    apart by pid and start time (in clock ticks since boot, which no change of the clock moves), so that
    is_alive() cannot take a later process given the same pid for this one."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def is_alive(process) -> bool:
    """`process` (an identity()) is still running: the same process, and not a zombie (one that has ended)."""
    try:
        return process is not None and process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_time(pid: int):
    """When `pid` started (seconds since the epoch, to the clock tick), for the order processes started in."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def parent(pid: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return 0


def descendants(root: int) -> list:
    """The pids of every process below `root` (children, theirs, ...), as psutil finds them by parent pid."""
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []


def rank_pids(running: Running, world: int = 2) -> dict:
    """rank -> pid, from the "[rank r] pid P on HOST" line every rank of lesson 12 prints after init."""
    pids = {}
    for r in range(world):
        pids[r] = int(running.wait_for(rf"^\[rank {r}\] pid (\d+) on ").group(1))
    return pids


def lesson12(*args, run_dir, launcher="self", torchrun=()):
    if launcher == "self":
        cmd = [PYTHON, LESSON, "--nproc", "2", *TRAIN, "--run-dir", run_dir, *args]
    else:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *torchrun,
               LESSON, *TRAIN, "--run-dir", run_dir, *args]
    return cmd


def weights(run_dir) -> dict:
    return torch.load(Path(run_dir) / "model.pt", map_location="cpu", weights_only=True)


def assert_bitwise_equal(a_dir, b_dir):
    a, b = weights(a_dir), weights(b_dir)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ in {differ}"
    assert metrics(a_dir)["loss_per_step"] == metrics(b_dir)["loss_per_step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """The uninterrupted run every other run must equal."""
    run_dir = tmp_path_factory.mktemp("reference")
    run(lesson12(run_dir=run_dir), env=DETERMINISTIC)
    m = metrics(run_dir)
    assert m["steps"] == STEPS and m["stops"] == [] and m["resumed_at"] == []
    return run_dir


# ----------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("sig, target", [pytest.param("SIGUSR1", "one rank", marks=pytest.mark.quick("12")),
                                         ("SIGTERM", "the launcher")])
def test_stopped_at_a_random_step_and_resumed_equals_the_uninterrupted_run(reference, tmp_path, sig, target):
    """One rank: only that rank gets the signal; the all_reduce of the stop flag must stop the other too.
    The launcher: `python lesson.py --nproc 2` passes it on to both ranks.  In the second case the newest
    checkpoint is then torn (cut in half), a garbage file with a newer step and a writer's leftover temporary
    file are added: the run must skip them and resume from the newest valid checkpoint, the periodic one.
    Damaged: the newest with 64 bytes flipped in place (same size: only its digest tells), a cut-short copy
    of it with its digest file under a newer name, garbage without one."""
    choice = random.Random()
    after, victim = choice.randint(8, 40), choice.randint(0, 1)
    note = f"{sig} to {target} after step {after} (rank {victim} if one rank)"
    first = Running(lesson12("--step-sleep", "0.1", run_dir=tmp_path))
    try:
        pids = rank_pids(first)
        first.wait_for(rf"^\[rank 0\] step {after} ")
        with open(tmp_path / "checkpoints" / ".lock") as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the running lesson: no second run here
        os.kill(pids[victim] if target == "one rank" else first.proc.pid, getattr(signal, sig))
        assert first.finish() == 0, f"{note}\n{first.output}"
    finally:
        first.kill()
    stop = step_of_stop(tmp_path, first.output)
    assert after <= stop < STEPS, f"{note}: stopped after step {stop}\n{first.output}"
    assert not (tmp_path / "metrics.json").exists()  # a stopped run writes no results, only its checkpoint

    ckpts = tmp_path / "checkpoints"
    ckpt = torch.load(ckpts / f"step-{stop:09d}.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] == stop and ckpt["epoch"] * 25 + ckpt["batches_done"] == stop
    assert ckpt["sampler_seed"] == 5 and len(ckpt["rng"]["cpu"]) == 2
    assert {"model", "optimizer"} <= ckpt.keys() and ckpt["optimizer"]["state"]  # momentum buffers included
    signalled = {victim: sig} if target == "one rank" else {0: sig, 1: sig}
    assert ckpt["stops"] == [{"step": stop, "signals": signalled}], note

    resume_from = stop
    if target == "the launcher":
        newest = ckpts / f"step-{stop:09d}.pt"
        (ckpts / "step-000000059.pt").write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn
        (ckpts / "step-000000059.pt.sha256").write_bytes((ckpts / f"step-{stop:09d}.pt.sha256").read_bytes())
        flip(newest)                                                            # a failing disk
        (ckpts / "step-000000060.pt").write_bytes(os.urandom(5000))             # garbage with a newer name
        (ckpts / ".step-000000061.pt.999.tmp").write_bytes(b"half a write")     # a writer killed mid-write
        resume_from = (stop - 1) // 7 * 7  # the periodic checkpoint before the stop (--keep 2 kept it)
    out = run(lesson12(run_dir=tmp_path), env=DETERMINISTIC).stdout
    if target == "the launcher":
        assert re.search(r"skipping checkpoint \S+step-000000060.pt \(torn or invalid: no readable "
                         r"step-000000060.pt.sha256", out), out
        assert re.search(r"skipping checkpoint \S+step-000000059.pt \(torn or invalid: its sha256 differs", out), out
        said = re.findall(rf"skipping checkpoint \S+step-{stop:09d}.pt \(torn or invalid: its sha256 differs from "
                          rf"the one in step-{stop:09d}.pt.sha256", out)
        assert len(said) == 1, out
    assert f"resuming from {ckpts / f'step-{resume_from:09d}.pt'}: step {resume_from}" in out, f"{note}\n{out}"
    m = metrics(tmp_path)
    assert m["resumed_at"] == [resume_from] and m["steps"] == STEPS, note
    assert m["stops"] == ([{"step": stop, "signals": {str(r): s for r, s in signalled.items()}}]
                          if resume_from == stop else [])  # the torn checkpoint took its record with it
    assert_bitwise_equal(tmp_path, reference)
    assert m["evaluations"] == metrics(reference)["evaluations"]


def flip(path, count=64):
    """`count` bytes in the middle of a file inverted in place: the same size, other bytes (a failing disk)."""
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(len(data) // 2)
        f.write(bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + count]))


def test_flipped_bytes_load_silently_but_the_digest_finds_them(reference, tmp_path, capsys):
    """The reference run's two checkpoints, copied: with 64 bytes flipped in the middle of the newest,
    torch.load still loads it (no checksum), newest_valid names it in one line and returns the older one;
    flipped in both, none is left: one line each, None (the lesson then starts at step 0, as with torn ones)."""
    from course.checkpoints.files import newest_valid

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", ckpts, ignore=shutil.ignore_patterns(".lock"))
    older, newest = sorted(ckpts.glob("step-*.pt"))
    flip(newest)
    assert torch.load(newest, map_location="cpu", weights_only=True)["step"] == STEPS  # loads without a word
    capsys.readouterr()
    assert newest_valid(ckpts) == older
    said = capsys.readouterr().out.splitlines()
    assert said == [f"[rank 0] skipping checkpoint {newest} (torn or invalid: its sha256 differs from the one in "
                    f"{newest.name}.sha256: the file changed after it was written)"], said
    digest = older.with_name(older.name + ".sha256").read_text()
    assert digest == f"{sha256(older)}  {older.name}\n"  # sha256sum's format: `sha256sum -c` checks it too
    flip(older)
    assert newest_valid(ckpts) is None
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and all(f"skipping checkpoint {p} (torn or invalid: its sha256" in line
                                  for p, line in zip((newest, older), said)), said


def sha256(path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def step_of_stop(run_dir, output) -> int:
    found = re.search(r"^\[rank 0\] stopped after step (\d+) of 50 \((.*)\); checkpoint (\S+);", output, re.M)
    assert found, output
    assert Path(found.group(3)) == run_dir / "checkpoints" / f"step-{int(found.group(1)):09d}.pt"
    return int(found.group(1))


def test_four_ranks_stopped_and_resumed_equal_the_uninterrupted_run(dataset, tmp_path):
    """With 2 ranks a sum of two gradients is the same in any order; with 4 the all_reduce's order of additions
    sets the rounding, and that order follows each number's place in DDP's buckets, which DDP rebuilds after
    the first backward of a new wrap.  The resumed run must train in the rebuilt buckets, as the uninterrupted
    one does.  The first run stops at --max-steps 10 (an exact stop: its final checkpoint); the same command
    without --max-steps resumes from it.  4 ranks: 13 steps per epoch, 26 in all."""
    args = [PYTHON, LESSON, "--nproc", "4", *TRAIN]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run([*args, "--run-dir", reference], env=DETERMINISTIC)
    run([*args, "--max-steps", "10", "--run-dir", resumed], env=DETERMINISTIC)
    out = run([*args, "--run-dir", resumed], env=DETERMINISTIC).stdout
    assert f"resuming from {resumed / 'checkpoints' / 'step-000000010.pt'}: step 10," in out, out
    m = metrics(resumed)
    assert m["world_size"] == 4 and m["resumed_at"] == [10] and m["steps"] == metrics(reference)["steps"] == 26
    assert_bitwise_equal(resumed, reference)


def test_torchrun_max_restarts_restarts_a_killed_rank_from_the_checkpoint(reference, tmp_path):
    """A crashed rank cannot checkpoint: torchrun --max-restarts=1 stops the other one, starts both again,
    and they resume from the newest periodic checkpoint, then end exactly as the uninterrupted run."""
    after = random.Random().randint(8, 40)
    job = Running(lesson12("--step-sleep", "0.1", run_dir=tmp_path, launcher="torchrun",
                           torchrun=["--max-restarts=1", "--monitor-interval=0.5"]), env=FRESH_STORE)
    try:
        pids = rank_pids(job)
        job.wait_for(rf"^\[rank 0\] step {after} ")
        os.kill(pids[1], signal.SIGKILL)
        assert job.finish() == 0, job.output
    finally:
        job.kill()
    assert re.search(r"\[rank 1\] pid \d+ on \S+ \(torchrun, restart 1\)", job.output), job.output
    m = metrics(tmp_path)
    assert m["restarts"] == 1 and m["stops"] == []
    assert len(m["resumed_at"]) == 1 and 7 <= m["resumed_at"][0] <= after and m["resumed_at"][0] % 7 == 0, m
    assert_bitwise_equal(tmp_path, reference)
    assert not job.left_behind()


def test_a_second_run_on_a_run_dir_in_use_stops_and_touches_nothing(dataset, tmp_path):
    """The run using a run dir holds a lock on its checkpoint dir (the random-step tests check that it does,
    while it trains); another run on the same dir stops with one line and leaves its files alone."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "step-000000007.pt").write_bytes(b"the first run's checkpoint")
    with open(ckpts / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running lesson 12 holds it
        lock.write("pid 4242 on node7\n")
        lock.flush()
        second = run([PYTHON, LESSON, "--nproc", "1", "--run-dir", tmp_path], check=False)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 1 and len(lines) == 1, second.stderr
    assert lines[0] == (f"[rank 0] error: {ckpts} is used by another run (pid 4242 on node7); wait for it to end, "
                        f"or give this run its own --run-dir")
    assert sorted(p.name for p in tmp_path.rglob("*")) == [".lock", "checkpoints", "step-000000007.pt"]
    assert (ckpts / "step-000000007.pt").read_bytes() == b"the first run's checkpoint"


# ----------------------------------------------------------------------------------------------- Slurm

def submit(cluster, *sbatch_options, args, env=""):
    (cluster.workdir / "logs").mkdir(exist_ok=True)  # the launcher's --output=logs/%x-%j.out
    done = cluster.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                        f"--export=ALL,COURSE_REPO={REPO},OMP_NUM_THREADS=1{env}", *sbatch_options,
                        str(LAUNCHER), *map(str, args)], timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


@pytest.mark.slurm
def test_slurm_signal_before_the_time_limit_checkpoints_requeues_and_resumes(slurm_cluster, reference):
    """sbatch --time=3 --signal=B:USR1@170: Slurm may signal the batch script from 10 s after the start on (it
    checks time limits about every 30 s; measured 27-29 s); the trap passes SIGUSR1 on through srun to both
    ranks (one per node), they checkpoint, the script requeues the job, and the second run resumes and
    finishes with the weights of the uninterrupted run.  2.4 s per step (120 s) makes the first run outlast
    the signal even when a busy slurmctld checks late: with 1.2 s per step (60 s) and --time=2 @110 one run
    of the whole suite finished after 69 s without a signal, and with 0.8 s (40 s) and --time=1 one after
    54 s.  The steps sleep: the wait costs no CPU."""
    run_dir = slurm_cluster.workdir / "lesson12-time-limit"
    job = submit(slurm_cluster, "--time=3", "--signal=B:USR1@170",
                 args=[*TRAIN, "--step-sleep", "2.4", "--run-dir", run_dir])
    info = follow_requeue(slurm_cluster, job, LOG)
    log = info["log"]
    print("\n".join(line for line in log.splitlines()
                    if re.search(r"==== |SIGUSR1|requeueing|^run \d|resuming|stopped after|steps, ", line)))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["Restarts"] == "1", log
    assert "run 1 of job" in log and "run 2 of job" in log and f"requeueing job {job}" in log, log
    assert "SIGUSR1: the time limit is near" in log
    m = metrics(run_dir)
    (stop,) = m["stops"]
    assert stop["signals"] == {"0": "SIGUSR1", "1": "SIGUSR1"}  # srun passed it on to both ranks
    assert m["resumed_at"] == [stop["step"]] and stop["step"] < STEPS
    assert_bitwise_equal(run_dir, reference)


@pytest.mark.slurm
def test_slurm_torchrun_passes_sigusr1_on_and_the_job_resumes(slurm_cluster, reference):
    """LAUNCHER=torchrun: one torchrun agent per node.  SIGUSR1 to the batch script (as --signal=B:USR1 sends
    it; here by scancel, at once) reaches the workers only because the launcher gives torchrun
    --signals-to-handle=...,SIGUSR1; they checkpoint, the job is requeued and the second run resumes."""
    run_dir = slurm_cluster.workdir / "lesson12-torchrun"
    job = submit(slurm_cluster, "--time=10", args=[*TRAIN, "--step-sleep", "0.2", "--run-dir", run_dir],
                 env=",LAUNCHER=torchrun")
    signalled = []

    def signal_after_step_5(log):
        if not signalled and re.search(r"^\[rank 0\] step 5 ", log, re.M):
            sent = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
            assert sent.returncode == 0, sent.stderr
            signalled.append(time.monotonic())

    info = follow_requeue(slurm_cluster, job, LOG, while_running=signal_after_step_5)
    log = info["log"]
    assert signalled and info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "--signals-to-handle=...,SIGUSR1" in log and f"requeueing job {job}" in log
    m = metrics(run_dir)
    (stop,) = m["stops"]
    # a worker got SIGUSR1 from its torchrun agent (without --signals-to-handle none would); the other agent
    # may pass it on after the ranks have agreed to stop, which is the point of agreeing (seen: 1 run in 6)
    assert stop["signals"] and set(stop["signals"]) <= {"0", "1"}, log
    assert set(stop["signals"].values()) == {"SIGUSR1"} and 5 <= stop["step"] < STEPS, log
    assert m["resumed_at"] == [stop["step"]] and m["launcher"] == "torchrun"
    assert_bitwise_equal(run_dir, reference)


@pytest.mark.slurm
def test_slurm_a_killed_rank_ends_the_job_and_names_it(slurm_cluster, dataset):
    """srun --kill-on-bad-exit=1: SIGKILL to rank 1 (on node2) mid-training ends the job, non-zero, within
    60 s, srun names the task (= the global rank), no rank is left running, and nothing is requeued."""
    run_dir = slurm_cluster.workdir / "lesson12-kill"
    job = submit(slurm_cluster, "--time=10", args=[*TRAIN, "--step-sleep", "0.3", "--run-dir", run_dir])
    pids, killed = {}, []

    def kill_rank1_after_step_3(log):
        if not killed and re.search(r"^\[rank 0\] step 3 ", log, re.M):
            for rank, pid in re.findall(r"^\[rank (\d)\] pid (\d+) on ", log, re.M):
                pids[int(rank)] = (int(pid), identity(int(pid)))  # one PID namespace for all the nodes here
            os.kill(pids[1][0], signal.SIGKILL)
            killed.append(time.monotonic())

    info = follow_requeue(slurm_cluster, job, LOG, while_running=kill_rank1_after_step_3)
    seconds = time.monotonic() - killed[0]
    print(f"srun: job ended {seconds:.1f} s after SIGKILL to rank 1 (measured with 0.3 s polling)")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0" and info["Restarts"] == "0", info["log"]
    assert seconds <= 60
    assert re.search(r"srun: error: node2: task 1: Killed", info["log"]), info["log"]
    assert "requeueing" not in info["log"] and not (run_dir / "metrics.json").exists()
    assert not [pid for pid, process in pids.values() if is_alive(process)]


def test_torchrun_does_not_pass_sigusr1_on_by_default(dataset, tmp_path):
    """Why the launcher gives torchrun --signals-to-handle=...,SIGUSR1 (the Slurm test shows it working):
    without it, SIGUSR1 kills the agent, and its workers, in sessions of their own, never hear of it."""
    job = Running(lesson12("--step-sleep", "0.2", run_dir=tmp_path, launcher="torchrun"))
    try:
        pids = rank_pids(job)
        job.wait_for(r"^\[rank 0\] step 2 ")
        job.record_tree()
        os.kill(job.proc.pid, signal.SIGUSR1)
        assert job.finish(timeout=60) == -signal.SIGUSR1  # the agent died of it
        assert all(is_alive(job.tree[pid]) for pid in pids.values()), job.output  # orphans, training
        assert "stopped after" not in job.output
    finally:
        job.kill()
