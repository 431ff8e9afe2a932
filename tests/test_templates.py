"""templates/: the files a learner copies into their own project (docs/learners/your-own-code.md).

Each template is run as a copy alone in an empty folder, from another working directory, without the course
on the path: what a learner who copied it gets.  Every configuration runs once per module (the `parity`
fixture runs parity_check.py on each template: 1 process, 2 and 4 ranks, the same global batch of 64,
16 SGD steps on the placeholder dataset and model), and several tests read its runs.

Measured here (2-vCPU VM, torch 2.14.1, gloo, one thread per rank), 1 process against 2 and 4 ranks after 16
SGD steps: train_ddp.py losses within 2.1e-7 (relative), weights within 1.7e-7 of each tensor's largest value;
train_fsdp.py losses within 1.9e-7, weights within 3.9e-7; stopped on 4 ranks and resumed on 2 from the DCP
checkpoint, train_fsdp.py ended within 3.8e-7 of the 4-rank run and 3.5e-7 of one process.  The tolerance,
1e-5 (parity_check.py's default), leaves a factor of 25 over the largest of these; the four bugs
parity_check.py names moved the weights by 1.9e-2 to 4.5e-1 and the losses by 2.6e-3 to 1.7e-2 (DDP, 2 ranks,
8 steps), 1000x over it.  A resumed DDP run at 4 ranks equals the uninterrupted one bit for bit; without the
backward thrown away before loading (DDP's rebuilt buckets) it ended 1.5e-8 off.
CPU: the whole file took 136 to 250 CPU-seconds here, by the load on the machine (every process of the tree,
sampled; conftest's count, 86 s, misses the ranks that --nproc forks from a server process), 4 minutes of wall
time with the test Slurm; most of it is Python starting and importing torch.
"""
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import PYTHON, REPO, environ, run

pytestmark = pytest.mark.slow

TEMPLATES = REPO / "templates"
PAGE = REPO / "docs" / "learners" / "your-own-code.md"
STEPS, TOLERANCE = 16, 1e-5
ALONE = {"PYTHONPATH": None, "OMP_NUM_THREADS": "1"}  # nothing of the course on the path
# parity_check.py's runs on N ranks: `--nproc N --batch-size 64/N --max-steps 16 --seed 0 --run-dir D --fresh
# --log-every 16 --checkpoint-every 8`
def same_as_parity(nproc):
    return ["--batch-size", str(64 // nproc), "--max-steps", str(STEPS), "--seed", "0", "--checkpoint-every", "8"]


def copy_alone(folder, *names, changes=None):
    """The templates `names` copied into `folder` (made empty); `changes`: {old: new} applied to the first."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        text = (TEMPLATES / name).read_text()
        for old, new in (changes or {}).items() if k == 0 else ():
            assert text.count(old) == 1, f"{name}: {old!r} is not there exactly once"
            text = text.replace(old, new)
        (folder / name).write_text(text)
    return folder


def parity_check(folder, script, *args, cwd):
    return run([PYTHON, folder / "parity_check.py", "--script", folder / script, *map(str, args)],
               cwd=cwd, env=ALONE, check=False, timeout=900)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """parity(template) -> (its parity check's CompletedProcess, work dir with nproc1/, nproc2/, nproc4/)."""
    done = {}

    def get(template):
        if template not in done:
            root = tmp_path_factory.mktemp(template.removesuffix(".py"))
            folder = copy_alone(root / "alone", template, "parity_check.py")
            (root / "elsewhere").mkdir()
            proc = parity_check(folder, template, "--nproc", 2, 4, "--steps", STEPS, "--work-dir", root / "work",
                                "--", "--checkpoint-every", 8, cwd=root / "elsewhere")
            done[template] = proc, root / "work", folder
        return done[template]
    return get


def weights(run_dir):
    return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)


def losses(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())["loss_per_step"]


def largest_difference(a, b):
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()).item() for k in a)


class Running:
    """A command in the background, its output read line by line as it comes."""

    def __init__(self, cmd, cwd):
        self.proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=environ(ALONE), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, pattern, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, "".join(self.lines), re.M)
            if found:
                return found
            if self.proc.poll() is not None:
                time.sleep(0.2)
                found = re.search(pattern, "".join(self.lines), re.M)
                assert found, f"exited {self.proc.returncode} before /{pattern}/:\n{''.join(self.lines)}"
                return found
            time.sleep(0.02)
        os.killpg(self.proc.pid, signal.SIGKILL)
        raise AssertionError(f"no /{pattern}/ within {timeout} s:\n{''.join(self.lines)}")

    def finish(self, timeout=300):
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self.reader.join(5)
        return code, "".join(self.lines)


# ------------------------------------------------------------------------------------------- the files

@pytest.mark.parametrize("template", ["train_ddp.py", "train_fsdp.py", "parity_check.py"])
def test_each_template_imports_only_torch_and_the_standard_library(template):
    tree = ast.parse((TEMPLATES / template).read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert modules - set(sys.stdlib_module_names) == {"torch"}, modules
    assert len((TEMPLATES / template).read_text().splitlines()) <= 380
    if template != "parity_check.py":
        text = (TEMPLATES / template).read_text()
        assert all(f"CHANGE {n}" in text.split('"""')[1] and f"# CHANGE {n}:" in text for n in (1, 2, 3))
        assert (TEMPLATES / template.replace(".py", ".sh")).is_file()


@pytest.mark.parametrize("template", ["train_ddp.py", "train_fsdp.py"])
def test_every_distributed_call_is_tagged(template):
    """A call of torch.distributed (dist., dcp., fully_shard, DDP, DistributedSampler, init_device_mesh) starts
    on a line tagged `# DDP:` or `# DIST:`, or right below a comment line with the tag."""
    lines = (TEMPLATES / template).read_text().splitlines()
    call = re.compile(r"\b(dist\.\w+|dcp\.\w+|fully_shard|DDP|DistributedSampler|init_device_mesh|"
                      r"set_requires_gradient_sync|get_state_dict|set_state_dict|get_model_state_dict)\(")
    untagged = [f"{k + 1}: {line.strip()}" for k, line in enumerate(lines)
                if call.search(line.split("#")[0]) and not line.lstrip().startswith(("def ", "from ", "import "))
                and not re.search(r"# (DDP|DIST):", line) and not re.search(r"^\s*# (DDP|DIST):", lines[k - 1])]
    assert not untagged, "\n".join(untagged)


# ------------------------------------------------------------------------------------------- parity

@pytest.mark.quick("templates")
@pytest.mark.parametrize("template", ["train_ddp.py", "train_fsdp.py"])
def test_each_template_equals_one_process_at_2_and_4_ranks(parity, template):
    """Run alone in an empty folder (cwd elsewhere, no course on the path): parity_check.py says EQUAL at 2 and
    4 ranks, and the weights it compared are within the tolerance by this test's own reading too."""
    proc, work, _ = parity(template)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for n in (2, 4):
        assert f"EQUAL within float32 rounding on {n} ranks" in proc.stdout, proc.stdout
        assert largest_difference(weights(work / f"nproc{n}"), weights(work / "nproc1")) <= TOLERANCE
        assert max(abs(a - b) / abs(b) for a, b in zip(losses(work / f"nproc{n}"), losses(work / "nproc1"))) \
            <= TOLERANCE
        assert json.loads((work / f"nproc{n}" / "metrics.json").read_text())["global_batch"] == 64
    assert len(losses(work / "nproc1")) == STEPS


BUGS = {  # name: (the change to train_ddp.py, the step from which parity_check.py must find a difference)
    "sampler not per rank": ({"DistributedSampler(dataset, num_replicas=world_size, rank=rank,":
                              "DistributedSampler(dataset, num_replicas=1, rank=0,"}, "from step 1 on"),
    "loss averaged twice": ({"(loss / args.accum).backward()": "(loss / args.accum / world_size).backward()"},
                            "The first step's loss agrees"),
    "missing all_reduce": ({"with contextlib.nullcontext() if last else model.no_sync():": "with model.no_sync():"},
                           "The first step's loss agrees"),
    "dropout per rank": ({"nn.Linear(args.hidden, args.hidden), nn.GELU(),":
                          "nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Dropout(0.1),"}, "from step 1 on"),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_the_parity_check_finds_each_bug_it_names(tmp_path, bug):
    """A copy of train_ddp.py with the bug put in, alone in an empty folder: parity_check.py exits 1, says
    DIFFERENT and gives the list of causes that fits where the difference starts (the correct copy passes:
    the test above)."""
    changes, says = BUGS[bug]
    folder = copy_alone(tmp_path / "alone", "train_ddp.py", "parity_check.py", changes=changes)
    proc = parity_check(folder, "train_ddp.py", "--nproc", 2, "--work-dir", tmp_path / "work", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIFFERENT on 2 ranks" in proc.stdout and says in proc.stdout, proc.stdout
    assert {"from step 1 on": "sampler is not per rank", "The first step's loss agrees": "missing all_reduce"}[says] \
        in proc.stdout


# ------------------------------------------------------------------------------------------- resume

def test_ddp_stopped_by_sigusr1_resumes_bit_for_bit(parity, tmp_path):
    """4 ranks: SIGUSR1 to rank 1 alone as soon as it has started; every rank stops after the same step,
    rank 0 writes a checkpoint, exit 0.  A newer checkpoint that does not match its sha256 is put beside it:
    the same command skips it, resumes, and ends with the weights and losses of parity's uninterrupted
    4-rank run, bit for bit (without the backward thrown away before loading it ended 1.5e-8 off)."""
    _, work, folder = parity("train_ddp.py")
    cmd = [PYTHON, folder / "train_ddp.py", "--nproc", 4, *same_as_parity(4), "--log-every", 1,
           "--run-dir", tmp_path / "run"]
    first = Running(cmd, tmp_path)
    os.kill(int(first.wait_for(r"\[rank 1\] pid (\d+) ").group(1)), signal.SIGUSR1)
    code, out = first.finish()
    assert code == 0, out
    stop = int(re.search(r"stopped after step (\d+) \(signal\)", out).group(1))
    assert 1 <= stop < STEPS and not (tmp_path / "run" / "metrics.json").exists()
    ckpts = tmp_path / "run" / "checkpoints"
    saved = torch.load(ckpts / f"ckpt-{stop:09d}.pt", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scheduler", "rng", "state"} <= saved.keys() and len(saved["rng"]) == 4
    assert saved["state"]["step"] == stop and saved["state"]["batches_done"] == stop  # 64 steps an epoch
    assert saved["optimizer"]["state"] and saved["scheduler"]["last_epoch"] == stop
    (ckpts / "ckpt-000000099.pt").write_bytes((ckpts / f"ckpt-{stop:09d}.pt").read_bytes()[:-100] + b"x" * 100)
    shutil.copy(ckpts / f"ckpt-{stop:09d}.pt.sha256", ckpts / "ckpt-000000099.pt.sha256")
    out = run(cmd, cwd=tmp_path, env=ALONE).stdout
    assert "skipping" in out and "ckpt-000000099.pt: it does not match" in out, out
    assert f"resuming from {ckpts / f'ckpt-{stop:09d}.pt'}: step {stop}" in out, out
    a, b = weights(tmp_path / "run"), weights(work / "nproc4")
    assert all(torch.equal(a[k], b[k]) for k in a), f"stopped after step {stop}: {largest_difference(a, b):.2e}"
    assert losses(tmp_path / "run") == losses(work / "nproc4")


def test_a_model_with_dropout_resumes_bit_for_bit_its_random_streams_restored(tmp_path):
    """A copy of train_ddp.py whose model has dropout (each rank's masks drawn from its own random stream):
    stopped by SIGUSR1 after a few steps and resumed, it ends with the weights of the same copy run
    uninterrupted, bit for bit: the checkpoint restores every rank's random streams.  Without that restore
    the resumed masks differ and so do the weights."""
    folder = copy_alone(tmp_path / "copy", "train_ddp.py", changes={
        "nn.Linear(args.hidden, args.hidden), nn.GELU(),": "nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Dropout(0.5),"})
    common = ["--nproc", 2, *same_as_parity(2), "--log-every", 1]
    whole = run([PYTHON, folder / "train_ddp.py", *common, "--run-dir", tmp_path / "whole"], cwd=tmp_path, env=ALONE)
    assert whole.returncode == 0, whole.stdout
    first = Running([PYTHON, folder / "train_ddp.py", *common, "--run-dir", tmp_path / "run"], tmp_path)
    os.kill(int(first.wait_for(r"\[rank 1\] pid (\d+) ").group(1)), signal.SIGUSR1)  # rank 1 alone
    code, out = first.finish()
    assert code == 0, out
    stop = int(re.search(r"stopped after step (\d+) \(signal\)", out).group(1))
    assert 1 <= stop < STEPS, out
    out = run([PYTHON, folder / "train_ddp.py", *common, "--run-dir", tmp_path / "run"], cwd=tmp_path, env=ALONE).stdout
    assert "resuming from" in out, out
    a, b = weights(tmp_path / "run"), weights(tmp_path / "whole")
    assert all(torch.equal(a[k], b[k]) for k in a), largest_difference(a, b)


def test_fsdp_stopped_by_sigusr1_resumes_at_another_world_size(parity, tmp_path):
    """train_fsdp.py on 4 ranks, SIGUSR1 to the launcher (`--nproc` passes it on); resumed by 2 ranks with the
    same global batch from the DCP checkpoint the 4 wrote: the weights of the uninterrupted 4-rank run and
    of one process, within float32 rounding.  With another global batch it stops with one line."""
    _, work, folder = parity("train_fsdp.py")
    run_dir = tmp_path / "run"
    first = Running([PYTHON, folder / "train_fsdp.py", "--nproc", 4, *same_as_parity(4), "--log-every", 1,
                     "--run-dir", run_dir], tmp_path)
    first.wait_for(r"\[rank 3\] pid \d+ ")
    first.proc.send_signal(signal.SIGUSR1)
    code, out = first.finish()
    assert code == 0, out
    stop = int(re.search(r"stopped after step (\d+) \(signal\)", out).group(1))
    assert 1 <= stop < STEPS and (run_dir / "checkpoints" / f"step-{stop:09d}" / "complete.json").is_file(), out
    out = run([PYTHON, folder / "train_fsdp.py", "--nproc", 2, *same_as_parity(2), "--run-dir", run_dir],
              cwd=tmp_path, env=ALONE).stdout
    assert f"step {stop} (saved by 4 ranks)" in out, out
    for reference in ("nproc4", "nproc1"):
        assert largest_difference(weights(run_dir), weights(work / reference)) <= TOLERANCE, reference
    wrong = run([PYTHON, folder / "train_fsdp.py", "--nproc", 2, "--batch-size", "16", "--max-steps", "20",
                 "--run-dir", run_dir], cwd=tmp_path, env=ALONE, check=False)
    assert wrong.returncode != 0 and "use --batch-size 32 on 2 ranks" in wrong.stderr, wrong.stderr


# ------------------------------------------------------------------------------------------- launchers

def test_torchrun_gives_the_weights_of_the_own_launcher(parity, tmp_path):
    """train_ddp.py under torchrun (2 ranks): bit for bit the run of `--nproc 2`."""
    _, work, folder = parity("train_ddp.py")
    run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", folder / "train_ddp.py",
         *same_as_parity(2), "--run-dir", tmp_path / "run"], cwd=tmp_path, env=ALONE)
    a, b = weights(tmp_path / "run"), weights(work / "nproc2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["launcher"] == "torchrun"


def test_a_failed_rank_ends_the_run_and_bad_input_is_one_line(tmp_path):
    """A rank that dies after init while the other waits in a collective: the run ends (exit 1) and names it,
    no hang.  A run directory that is a file, and a WORLD_SIZE that is not a number: one line, exit 2."""
    folder = copy_alone(tmp_path / "alone", "train_ddp.py", changes={
        "    torch.manual_seed(args.seed)  # the same": "    if rank == 1:\n        os._exit(3)\n"
                                                      "    torch.manual_seed(args.seed)  # the same"})
    started = time.monotonic()
    died = run([PYTHON, folder / "train_ddp.py", "--nproc", 2, "--run-dir", tmp_path / "run"], cwd=tmp_path,
               env=ALONE, check=False, timeout=120)
    assert died.returncode == 1 and "error: rank 1 failed" in died.stderr, died.stderr
    assert time.monotonic() - started < 60
    (tmp_path / "file").write_text("")
    for args, env, says in [(["--run-dir", tmp_path / "file"], {}, "Not a directory"),
                            (["--run-dir", tmp_path / "r"], {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "two"},
                             "WORLD_SIZE='two': expected a whole number")]:
        bad = run([PYTHON, TEMPLATES / "train_ddp.py", *args], cwd=tmp_path, env={**ALONE, **env}, check=False)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], \
            bad.stderr


@pytest.mark.slurm
@pytest.mark.parametrize("template", ["train_ddp.py", "train_fsdp.py"])
def test_srun_on_two_nodes_gives_the_weights_of_the_own_launcher(slurm_cluster, parity, template):
    """`srun --nodes=2 --ntasks-per-node=1 python TEMPLATE` on the test Slurm (one rank per node, the rank 0
    address from the node list): bit for bit the run of `--nproc 2`."""
    _, work, folder = parity(template)
    run_dir = slurm_cluster.workdir / f"templates-{template}"
    done = slurm_cluster.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                              f"--export=ALL,OMP_NUM_THREADS=1", PYTHON, str(folder / template),
                              *same_as_parity(2), "--run-dir", str(run_dir)], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\[rank 1\] pid \d+ on node2", done.stdout), done.stdout
    a, b = weights(run_dir), weights(work / "nproc2")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------- the page

def page_commands():
    """(template, arguments) of every `python templates/X.py ...` or `torchrun ... templates/X.py ...` line in the
    page's shell blocks."""
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", PAGE.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.split("#")[0].split()
            script = next((k for k, w in enumerate(words) if w.startswith("templates/")), None)
            if script is not None and words[0] in ("python", "torchrun"):
                found.append((words[script], words[script + 1:]))
    return found


def test_every_template_command_of_the_page_parses(tmp_path, monkeypatch):
    """The page's commands, parsed by the template's own parser (parse_args, in this process): no option the
    template lacks.  (The page's runs themselves are the tests above: --nproc 2 and 4, parity_check.py.)"""
    import runpy

    commands = page_commands()
    assert len(commands) >= 4
    monkeypatch.chdir(tmp_path)
    previous = signal.getsignal(signal.SIGUSR1)  # the templates set their own handler when they are loaded
    request_cleanup = lambda: signal.signal(signal.SIGUSR1, previous)
    for script, args in commands:
        module = runpy.run_path(str(REPO / script), run_name="template")
        monkeypatch.setattr(sys, "argv", [script, *args])
        if script.endswith("parity_check.py"):
            assert (REPO / args[args.index("--script") + 1]).is_file(), args
            continue
        try:
            module["parse_args"]()
        finally:
            request_cleanup()


@pytest.mark.slurm
def test_the_batch_script_checkpoints_on_sigusr1_requeues_and_resumes(slurm_cluster):
    """train_ddp.sh as a learner submits it (2 nodes, one rank each): SIGUSR1 to the batch shell, as
    `--signal=B:USR1@120` sends it before the time limit (here by scancel, once both ranks run); its trap
    passes it on through srun, the ranks checkpoint and exit 0, the script requeues the job, and the second
    run resumes from that checkpoint and finishes all 1280 steps (64 a epoch, 20 epochs)."""
    folder = copy_alone(slurm_cluster.workdir / "templates-requeue", "train_ddp.py", "train_ddp.sh")
    (folder / "logs").mkdir()
    submitted = slurm_cluster.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                                   "--time=10", f"--export=ALL,PYTHON={PYTHON},OMP_NUM_THREADS=1",
                                   str(folder / "train_ddp.sh"), "--epochs", "20", "--log-every", "100",
                                   "--run-dir", str(folder / "run")], cwd=folder, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = int(submitted.stdout.strip().split(";")[0])
    log, signalled, released = folder / "logs" / f"train_ddp-{job}.out", False, False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        info = slurm_cluster.job_info(job)
        text = log.read_text() if log.exists() else ""
        if not signalled and re.search(r"\[rank 1\] pid \d+ on node2", text):
            sent = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
            assert sent.returncode == 0, sent.stderr
            signalled = True
        if info.get("JobState") == "PENDING" and info.get("Restarts", "0") != "0" and not released:
            slurm_cluster.wait_for_idle_nodes(60)  # a requeued job waits before it may start again: start it now
            time.sleep(1)
            slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            released = True
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(0.3)
    else:
        slurm_cluster.run(["scancel", str(job)])
        raise AssertionError(f"job {job} did not end within 300 s:\n{log.read_text() if log.exists() else ''}")
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    assert "SIGUSR1: the time limit is near" in text and f"requeueing job {job}" in text, text
    stop = int(re.search(r"stopped after step (\d+) \(signal\)", text).group(1))
    assert int(re.search(r"resuming from \S+: step (\d+)", text).group(1)) == stop < 1280, text
    assert json.loads((folder / "run" / "metrics.json").read_text())["steps"] == 1280
