"""slurm/: one launcher per lesson, the site profiles and slurm/submit.sh, checked on a real two-node Slurm.

- every lesson has a launcher and every launcher a lesson; every launcher has the shape the course promises
  (commented #SBATCH lines, strict bash, srun --kill-on-bad-exit=1, logs/%x-%j.out, no site values);
- every launcher passes `bash -n`, and `sbatch --test-only` with every site profile on a test Slurm dressed
  as those sites (GPU nodes with feature `gpu`, typed GPUs, partition `booster`);
- every launcher, with the CPU-only profile, is really submitted through submit.sh to the two-node test
  Slurm, exits 0, and its log shows the lesson's result; the day-2 ones span both nodes;
- a wrong site value fails with one clear line before anything is submitted.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from course.checkpoints import hf
from course.gpt import GPT
from slurm_cluster import SlurmCluster, skip_reason

SLURM = REPO / "slurm"
SUBMIT = SLURM / "submit.sh"
SITES_DIR = SLURM / "sites"
LAUNCHERS = sorted(p for p in SLURM.glob("*.sh") if p.name != "submit.sh")
SITES = sorted(p.stem for p in SITES_DIR.glob("*.env"))
# Accounts for the profiles that require one, shaped as each site wants it.
ACCOUNTS = {"perlmutter": "m1234_g", "jsc": "training2024"}


def lesson_files() -> dict[str, Path]:
    """Launcher name -> the script it runs: every numbered lesson, test-profile, and the HDF5 writer."""
    files = {p.stem: p for p in REPO.glob("day*/[0-9]*_*.py")}
    files.update({p.stem: p for p in REPO.glob("day*/test-profile.py")})
    files["create_mnist_h5"] = REPO / "data_tools" / "create_mnist_h5.py"
    return files


def is_day2(launcher: Path) -> bool:
    return (REPO / "day2" / f"{launcher.stem}.py").exists()


def two_nodes(launcher: Path) -> bool:
    """Day 2's launchers, lesson 20's and 22's (one row of the 2-D mesh per node), lesson 21's (its stages in
    order over both nodes) and lesson 23's (FSDP2 over both)."""
    return is_day2(launcher) or launcher.stem in ("20_device_mesh_2d", "21_pipeline_parallel", "22_gpt_pretraining",
                                                  "23_hf_finetuning")


def sbatch_lines(launcher: Path) -> list[str]:
    return [line for line in launcher.read_text().splitlines() if line.startswith("#SBATCH")]


def submit(*args, env=None, cwd=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUBMIT), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd or REPO, timeout=timeout)


# ------------------------------------------------------------------------------------------ the files

def test_every_lesson_has_a_launcher_and_every_launcher_a_lesson():
    lessons = lesson_files()
    launchers = {p.stem for p in LAUNCHERS}
    assert "test-profile" in lessons and {"0_torch_dist", "9_torch_dist_multi_node"} <= set(lessons)
    assert sorted(set(lessons) - launchers) == [], "lessons without a launcher in slurm/"
    assert sorted(launchers - set(lessons)) == [], "launchers without a lesson"


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.stem)
def test_launcher_shape(launcher):
    text = launcher.read_text()
    name = launcher.stem
    assert subprocess.run(["bash", "-n", str(launcher)], capture_output=True).returncode == 0
    assert text.startswith("#!/bin/bash\n")
    assert os.access(launcher, os.X_OK)
    lines = sbatch_lines(launcher)
    for line in lines:
        # every directive says what it asks for
        assert re.fullmatch(r"#SBATCH --[a-z-]+(=\S+)?\s+# \S.*", line), line
    options = dict((line.split()[1].lstrip("-") + "=").split("=")[:2] for line in lines)
    assert options["job-name"] == name
    assert options["output"] == "logs/%x-%j.out"
    assert "time" in options
    # site values come from the profile through submit.sh, never from the launcher
    assert not {"account", "partition", "qos", "constraint", "gres", "gpus", "gpus-per-node"} & set(options)
    assert "\nset -euo pipefail\n" in text
    assert 'job_start "$@"' in text  # start time and settings; lib/job.sh traps the end
    # the launcher runs its own lesson, and every srun stops all ranks when one fails
    script = lesson_files()[name]
    assert str(script.relative_to(REPO)) in text or f" {script.name} " in text
    sruns = re.findall(r"^\s*(?:step )?srun .*$", text, flags=re.M)
    assert all("--kill-on-bad-exit=1" in s for s in sruns), sruns
    if two_nodes(launcher):
        assert options["nodes"] == "2"
        # multinode_setup_and_run.sh finds rank 0, then runs srun --kill-on-bad-exit=1; lesson 12's launcher
        # runs srun itself (in the background, so that its trap can pass SIGUSR1 on)
        assert "day2/multinode_setup_and_run.sh" in text or sruns
    else:
        assert options["nodes"] == "1"
        assert sruns, "day-1 launchers start their ranks with srun"


def test_helpers_pass_bash_n():
    for path in [SUBMIT, *SLURM.glob("lib/*.sh")]:
        checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{path}: {checked.stderr}"


def test_profiles_shipped():
    assert {"perlmutter", "palmetto", "jsc", "generic-gpu", "cpu-only", "template"} <= set(SITES)
    template = (SITES_DIR / "template.env").read_text()
    for setting in ["SITE_ACCOUNT=", "SITE_PARTITION=", "SITE_QOS=", "SITE_CONSTRAINT=", "SITE_RESERVATION=",
                    "SITE_GPU_FLAG=",
                    "SITE_GPU_TYPE=", "SITE_GPUS_PER_NODE=", "SITE_CPUS_PER_TASK=", "site_setup()",
                    "NCCL_SOCKET_IFNAME", "module load"]:
        assert setting in template
    for site in SITES:
        # bash syntax, and every one is readable by the loader the job uses
        loaded = subprocess.run(
            ["bash", "-c", 'COURSE_REPO="$1"; source "$1/slurm/lib/site.sh"; course_load_site "$2"; '
                           'declare -F site_setup >/dev/null && echo "$SITE_GPU_FLAG"',
             "bash", str(REPO), str(SITES_DIR / f"{site}.env")], capture_output=True, text=True)
        assert loaded.returncode == 0 and loaded.stdout.strip(), (site, loaded.stderr)


# ------------------------------------------------------------------------------------------ submit.sh --dry-run

# What each profile must put on the sbatch command line, for lesson 6 (one node, 4 ranks) and lesson 10 (two
# nodes, 2 ranks each: docs/lessons.toml): one GPU per rank, at most the node's (palmetto's nodes have 2).
DRY_RUN = {
    "perlmutter": (["--account=m1234_g", "--qos=regular", "--constraint=gpu", "--ntasks-per-node=4",
                    "--cpus-per-task=32", "--gpus-per-node=4"], ["--ntasks-per-node=2", "--gpus-per-node=2"]),
    "palmetto": (["--ntasks-per-node=2", "--gpus=v100:2"], ["--gpus=v100:4"]),  # --gpus counts the whole job
    "jsc": (["--account=training2024", "--partition=booster", "--ntasks-per-node=4", "--gres=gpu:4"],
            ["--gres=gpu:2"]),
    "generic-gpu": (["--ntasks-per-node=4", "--gpus-per-node=4"], ["--gpus-per-node=2"]),
    "cpu-only": (["--ntasks-per-node=4", "--cpus-per-task=2"], ["--ntasks-per-node=2"]),
    "template": (["--gpus-per-node=4"], ["--gpus-per-node=2"]),
}


@pytest.mark.parametrize("site", SITES)
def test_dry_run_prints_the_sbatch_command_of_the_profile(site):
    env = {"SITE_ACCOUNT": ACCOUNTS[site]} if site in ACCOUNTS else {}
    day1_flags, day2_flags = DRY_RUN.get(site, ([], []))
    for lesson, expected in [("6", day1_flags), ("10_mnist_ddp_pt_multinode", day2_flags)]:
        shown = submit(lesson, "--site", site, "--dry-run", "--", "--quick", "--run-dir", "my runs", env=env)
        assert shown.returncode == 0, shown.stderr
        words = shlex.split(shown.stdout)
        assert words[0] == "sbatch"
        assert words[-3:] == ["--quick", "--run-dir", "my runs"]  # lesson args after the launcher, quoted
        assert Path(words[-4]).name.startswith(lesson.split("_")[0] + "_")
        assert set(expected) <= set(words), (expected, words)
        assert ("--nodes=1" if lesson == "6" else "--nodes=2") in words  # day 1: one node, day 2: two
        assert f"COURSE_SITE_ENV={SITES_DIR / (site + '.env')}" in shown.stdout
        if site == "cpu-only":
            assert not any("gpu" in w or "gres" in w for w in words[:-4])


def test_single_process_lessons_ask_for_one_task_and_one_gpu():
    shown = submit("2", "--site", "generic-gpu", "--dry-run")
    words = shlex.split(shown.stdout)
    assert "--gpus-per-node=1" in words and not any(w.startswith("--ntasks-per-node") for w in words)


def test_environment_wins_over_the_profile():
    shown = submit("9", "--site", "jsc", "--dry-run", "--nodes", "3",
                   env={"SITE_ACCOUNT": "proj", "SITE_PARTITION": "develbooster", "SITE_GPUS_PER_NODE": "2",
                        "SITE_RESERVATION": "course"})
    words = shlex.split(shown.stdout)
    assert {"--account=proj", "--partition=develbooster", "--gres=gpu:2", "--ntasks-per-node=2",
            "--nodes=3", "--reservation=course"} <= set(words), words


# ------------------------------------------------------------------------------------------ wrong site values

@pytest.fixture
def fake_sbatch(tmp_path):
    """An `sbatch` first on PATH that records any call: proves that nothing reached Slurm."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {calls}\necho "Submitted batch job 1"\n')
    (bin_dir / "sbatch").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, calls


WRONG = [
    # (site, environment, lesson, extra args, words the one-line error must contain)
    ("perlmutter", {}, "6", [], ["needs an account", "SITE_ACCOUNT"]),
    ("jsc", {"SITE_ACCOUNT": ""}, "10", [], ["needs an account", "SITE_ACCOUNT"]),
    ("perlmutter", {"SITE_ACCOUNT": "m1234"}, "6", [], ["'m1234'", "ending in '_g'"]),
    ("generic-gpu", {"SITE_GPU_FLAG": "gpu-per-node"}, "6", [], ["SITE_GPU_FLAG", "'gpu-per-node'", "gres"]),
    ("palmetto", {"SITE_GPU_TYPE": "v100:2"}, "6", [], ["SITE_GPU_TYPE", "'v100:2'"]),
    ("generic-gpu", {"SITE_GPUS_PER_NODE": "four"}, "6", [], ["SITE_GPUS_PER_NODE", "whole number"]),
    ("generic-gpu", {"SITE_GPUS_PER_NODE": "0"}, "6", [], ["SITE_GPUS_PER_NODE is not set"]),
    ("cpu-only", {}, "6", ["--gpus-per-node", "2"], ["has no GPUs"]),
    ("generic-gpu", {}, "6", ["--ntasks-per-node", "8"], ["more than the 4 GPUs"]),
    ("cpu-only", {"SITE_PARTITION": "two words"}, "6", [], ["SITE_PARTITION", "one word"]),
    ("cpu-only", {}, "6", ["--nodes", "2"], ["one-node lesson"]),
    ("cpu-only", {}, "2", ["--ntasks-per-node", "2"], ["single process"]),
    ("nosuchsite", {}, "6", [], ["no site profile 'nosuchsite'", "perlmutter"]),
    ("cpu-only", {}, "99", [], ["no launcher for '99'", "6_mnist_ddp_pt"]),
]


@pytest.mark.parametrize("site,env,lesson,extra,words", WRONG,
                         ids=[f"{w[0]}-{'-'.join(w[1]) or ' '.join(w[3]) or w[2]}" for w in WRONG])
def test_wrong_site_value_is_one_clear_line_and_nothing_is_submitted(fake_sbatch, site, env, lesson, extra,
                                                                       words, tmp_path):
    path_env, calls = fake_sbatch
    for mode in ([], ["--dry-run"]):
        done = submit(lesson, "--site", site, *extra, *mode, env={**path_env, **env}, cwd=tmp_path)
        assert done.returncode == 1, done.stdout + done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("submit.sh: error: "), done.stderr
        for word in words:
            assert word in lines[0], (word, lines[0])
        assert done.stdout == ""
    assert not calls.exists(), "sbatch was called"
    assert not (tmp_path / "logs").exists()


BAD_PROFILES = {
    # name: (--site value or None for COURSE_SITE, the profile's text or None, words the one line must contain)
    "missing name": ("nosuchsite", None, ["--site nosuchsite: no site profile 'nosuchsite'", "cpu-only"]),
    "missing path": ("{tmp}/gone.env", None, ["--site {tmp}/gone.env: no such file"]),
    "missing COURSE_SITE": (None, None, ["COURSE_SITE=nosuchsite: no site profile 'nosuchsite'"]),
    "site_setup fails": ("{tmp}/broken.env", "site_setup() {\n    export A=1\n    false\n    echo unreachable\n}\n",
                         ["site_setup of {tmp}/broken.env failed: `false` exited with 1", "No rank was started"]),
}


@pytest.mark.parametrize("case", BAD_PROFILES)
def test_multinode_script_stops_on_a_bad_profile_before_any_rank(case, tmp_path):
    """day2/multinode_setup_and_run.sh inside an allocation (faked: SLURM_JOB_ID, and an srun/scontrol that
    record their calls) with a profile that is missing or whose site_setup fails: one line, exit 1, no srun."""
    site, text, words = BAD_PROFILES[case]
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).write_text(f'#!/bin/bash\necho "{tool} $*" >> {calls}\necho node1\n')
        (bin_dir / tool).chmod(0o755)
    if text:
        (tmp_path / "broken.env").write_text(text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node1", "COURSE_SITE": "nosuchsite"}
    site_args = ["--site", site.format(tmp=tmp_path)] if site else []
    done = subprocess.run(["bash", str(REPO / "day2/multinode_setup_and_run.sh"), *site_args,
                           "9_torch_dist_multi_node.py"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for word in words:
        assert word.format(tmp=tmp_path) in lines[0], (word, lines[0])
    assert "unreachable" not in done.stdout and "multinode: job" not in done.stdout
    assert not calls.exists(), calls.read_text()


def fake_slurm(tmp_path) -> tuple:
    """(environment, the file of calls): an allocation of node1 and node2, 2 tasks each (job 7), whose srun,
    scontrol and squeue are fakes first on PATH.  srun records its arguments and the MASTER_ADDR it was given,
    and runs nothing; the port check (an srun with --nodelist) answers port 10007."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    fakes = {"scontrol": 'printf "node1\\nnode2\\n"', "squeue": "true",
             "srun": '[[ " $* " != *" --nodelist="* ]] || echo 10007'}
    for tool, answer in fakes.items():
        (bin_dir / tool).write_text(f'#!/bin/bash\necho "{tool} $* (MASTER_ADDR=${{MASTER_ADDR:-}})" >> {calls}\n'
                                    f"{answer}\n")
        (bin_dir / tool).chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "SITE_", "COURSE_SITE")) and key not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update({"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]",
                "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
                "PYTHON": sys.executable, "COURSE_REPO": str(REPO)})
    return env, calls


MASTER_ADDRS = {
    # case: (exported MASTER_ADDR, the profile's SITE_MASTER_ADDR, rank 0's address, what the script says of it)
    "the first node": (None, None, "node1", ""),
    "exported": ("node1-fast", None, "node1-fast", " (exported)"),
    "the profile's template": (None, "{host}i", "node1i", " (SITE_MASTER_ADDR={host}i)"),
    "exported, beside a template": ("10.0.0.1", "{host}i", "10.0.0.1", " (exported)"),
}


@pytest.mark.parametrize("case", MASTER_ADDRS)
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_multinode_script_keeps_an_exported_master_addr_or_makes_it_with_the_profile(case, launcher, tmp_path):
    """day2/multinode_setup_and_run.sh with a faked Slurm: the ranks' srun, or torchrun's rendezvous, gets an
    exported MASTER_ADDR as it is, else the profile's SITE_MASTER_ADDR made from the first node's name (JSC's
    {host}i: the node on InfiniBand), else that name; the port is checked on the first node by its Slurm name
    (before: MASTER_ADDR was always overwritten with the first node's name)."""
    exported, template, addr, said = MASTER_ADDRS[case]
    env, calls = fake_slurm(tmp_path)
    if exported:
        env["MASTER_ADDR"] = exported
    profile = tmp_path / "site.env"
    profile.write_text(f"SITE_MASTER_ADDR='{template}'\n" if template else "SITE_DESCRIPTION=plain\n")
    done = subprocess.run(["bash", str(REPO / "day2/multinode_setup_and_run.sh"), "--site", str(profile),
                           "--launcher", launcher, "9_torch_dist_multi_node.py"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"launcher {launcher}, rank 0 at {addr}:10007{said}\n" in done.stdout, done.stdout
    sruns = [line for line in calls.read_text().splitlines() if line.startswith("srun ")]
    assert len(sruns) == 2 and " --nodelist=node1 " in sruns[0], sruns  # the port check, on the node by name
    assert sruns[1].endswith(f"(MASTER_ADDR={addr})"), sruns[1]
    assert launcher == "srun" or f" --rdzv_endpoint={addr}:10007 " in sruns[1], sruns[1]


@pytest.mark.parametrize("template, said", [
    ("node1i", "it has no {host} (the name of the job's first node), so every job would meet at one address"),
    ("{host} i", "only letters, digits, '.', '-' and '_' may stand beside {host}"),
])
def test_a_bad_site_master_addr_is_one_line_before_any_srun(template, said, tmp_path):
    env, calls = fake_slurm(tmp_path)
    profile = tmp_path / "site.env"
    profile.write_text(f"SITE_MASTER_ADDR='{template}'\n")
    done = subprocess.run(["bash", str(REPO / "day2/multinode_setup_and_run.sh"), "--site", str(profile),
                           "9_torch_dist_multi_node.py"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: SITE_MASTER_ADDR='{template}' ({profile}): {said}; write e.g. "
                                  "'{host}i'"), done.stderr
    assert "srun " not in calls.read_text()
    shown = submit("10", "--site", profile, "--dry-run", env={"SITE_GPU_FLAG": "none"})  # submit.sh: the same
    assert shown.returncode == 1 and f"SITE_MASTER_ADDR in {profile} is '{template}': {said}" in shown.stderr


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_lesson12s_launcher_uses_the_profiles_master_addr(launcher, tmp_path):
    """slurm/12_ddp_fault_tolerance.sh (faked Slurm) with a profile of SITE_MASTER_ADDR='{host}i': job_start
    exports node1i for the ranks' srun, and torchrun's rendezvous meets there (before: the first node's name,
    and the lessons under srun took it themselves)."""
    env, calls = fake_slurm(tmp_path)
    profile = tmp_path / "site.env"
    profile.write_text("SITE_MASTER_ADDR='{host}i'\n")
    env.update({"COURSE_SITE": str(profile), "LAUNCHER": launcher})
    done = subprocess.run(["bash", str(SLURM / "12_ddp_fault_tolerance.sh"), "--quick"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^  MASTER_ADDR +node1i$", done.stdout, flags=re.M), done.stdout  # the job's settings
    sruns = [line for line in calls.read_text().splitlines() if line.startswith("srun ")]
    assert len(sruns) == 1 and sruns[0].endswith("(MASTER_ADDR=node1i)"), sruns
    assert launcher == "srun" or " --rdzv_endpoint=node1i:10007 " in sruns[0], sruns


def job_start(env, cwd) -> subprocess.CompletedProcess:
    """A launcher's first lines (slurm/lib/job.sh job_start), outside Slurm; "+ srun reached" if they pass."""
    return subprocess.run(["bash", "-c", 'set -euo pipefail; source "$COURSE_REPO/slurm/lib/job.sh"; job_start; '
                                         'echo "+ srun reached"'],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def test_a_launcher_with_a_failing_site_setup_stops_before_its_lesson(tmp_path):
    """The launchers' job_start (slurm/lib/job.sh) runs site_setup through the same function: the job's log
    names the failing command, and the job ends with exit code 1 before any srun."""
    profile = tmp_path / "broken.env"
    profile.write_text("site_setup() {\n    false\n}\n")
    env = {**os.environ, "SLURM_JOB_ID": "7", "COURSE_REPO": str(REPO), "COURSE_SITE": str(profile)}
    done = job_start(env, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == (f"error: site_setup of {profile} failed: `false` exited with 1; fix site_setup "
                                   "there (run its lines in a shell to see the cause). No rank was started.")
    assert "srun reached" not in done.stdout and "exit code 1" in done.stdout.splitlines()[-1]


def test_a_python_without_torch_stops_the_job_before_its_lesson(tmp_path):
    """PYTHON names the interpreter of the ranks; one without torch (here a bare venv, as a trainer's
    `export PYTHON=...` for scripts/setup_env.sh would leave behind in the shell that submits) is one line."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "bare"], check=True, timeout=60)
    bare = tmp_path / "bare" / "bin" / "python"
    env = {**os.environ, "SLURM_JOB_ID": "7", "COURSE_REPO": str(REPO), "PYTHON": str(bare)}
    env.pop("COURSE_SITE", None)
    done = job_start(env, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bare} (PYTHON, set before the site setup or by it) "
                                                   "cannot import torch; unset PYTHON"), done.stderr
    assert lines[0].endswith("No rank was started.") and "srun reached" not in done.stdout
    env["PYTHON"] = sys.executable  # the course's venv: the same job starts
    done = job_start(env, tmp_path)
    assert done.returncode == 0 and "srun reached" in done.stdout, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------ sbatch --test-only

@pytest.fixture(scope="module")
def site_cluster():
    """A second test Slurm dressed as the sites' GPU nodes: 128 CPUs and 4 typed GPUs (v100) per node,
    node feature `gpu`, and the partition `booster` next to `debug`; accounts and qos are free (no
    accounting). Separate from the session cluster, whose nodes other tests expect unchanged."""
    reason = skip_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Slurm test cluster unavailable in CI: {reason}", pytrace=False)
        pytest.skip(f"Slurm test cluster unavailable: {reason}")
    with SlurmCluster(cpus=128, gpus=4) as cluster:
        for command in (["scontrol", "update", "NodeName=node[1-2]", "AvailableFeatures=gpu", "ActiveFeatures=gpu",
                         "Gres=gpu:v100:4"],
                        ["scontrol", "create", "PartitionName=booster", "Nodes=node[1-2]", "State=UP"]):
            done = cluster.run(command)
            assert done.returncode == 0, done.stderr
        yield cluster


@pytest.mark.slurm
@pytest.mark.parametrize("site", SITES)
def test_every_launcher_passes_sbatch_test_only_with_every_profile(site_cluster, site, tmp_path):
    env = {**site_cluster.env, **({"SITE_ACCOUNT": ACCOUNTS[site]} if site in ACCOUNTS else {})}
    refused = []
    for launcher in LAUNCHERS:
        checked = submit(launcher.stem, "--site", site, "--test-only", env=env, cwd=tmp_path)
        if checked.returncode != 0 or "to start at" not in checked.stdout:
            refused.append(f"{launcher.stem}: {checked.stdout}{checked.stderr}")
    assert not refused, "\n".join(refused)
    assert not (tmp_path / "logs").exists()  # --test-only submits nothing


@pytest.mark.slurm
@pytest.mark.parametrize("env,words", [
    ({"SITE_PARTITION": "nosuch"}, ["invalid partition", "SITE_PARTITION (from the environment) ('nosuch')",
                                     "sinfo -s"]),
    ({"SITE_CONSTRAINT": "a100"}, ["feature", "SITE_CONSTRAINT"]),
    ({"SITE_RESERVATION": "course"}, ["reservation", "SITE_RESERVATION (from the environment) ('course')",
                                       "scontrol show reservation"]),
    ({"SITE_GPU_FLAG": "gres", "SITE_GPUS_PER_NODE": "8"}, ["node configuration", "GPU request"]),
], ids=["partition", "constraint", "reservation", "too-many-gpus"])
def test_a_value_slurm_refuses_fails_before_submission(slurm_cluster, env, words, tmp_path):
    done = submit("0", "--site", "cpu-only", env={**slurm_cluster.env, **env}, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("submit.sh: error: Slurm refuses 0_torch_dist"), done.stderr
    assert lines[0].endswith("Nothing was submitted.")
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Submitted" not in done.stdout
    queued = slurm_cluster.run(["squeue", "--noheader", "--name=0_torch_dist"])
    assert queued.returncode == 0 and queued.stdout.strip() == ""
    assert not (tmp_path / "logs").exists()


# ------------------------------------------------------------------------------------------ real jobs

# Small runs (2 ranks per node, one core each): the lesson arguments of each, and what its log must show.
# Submitted longest first, so that the short ones fill the gaps; the day-2 jobs and lesson 20's need both nodes
# at once.
SMALL = ["--quick", "--train-samples", "3200"]  # 1 epoch, 50 steps for 1 rank; the whole test set
RUNS = {
    # 2 nodes x 2 ranks: TP inside each node, FSDP2 across the two (--inner: the tasks per node)
    "20_device_mesh_2d": SMALL + ["--max-steps", "6"],
    # 2 nodes x 2 ranks: 4 stages of one block each, 1F1B over 8 micro-batches of 8
    "21_pipeline_parallel": SMALL + ["--max-steps", "6"],
    # 2 nodes x 2 ranks: TP with sequence parallelism inside each node, FSDP2 across; a smaller GPT, 6 steps
    "22_gpt_pretraining": ["--max-steps", "6", "--width", "32", "--hidden", "64", "--sample-tokens", "20"],
    # 2 nodes x 2 ranks: FSDP2 over both, fine-tuning a model written as lesson 22 writes it (hf-model, below)
    "23_hf_finetuning": ["--max-steps", "4", "--seq-len", "96", "--answer-tokens", "10", "--model-dir",
                         "{work}/hf-model"],
    "12_ddp_fault_tolerance": SMALL,
    "11_mnist_ddp_pt_multinode_streaming": SMALL,
    "10_mnist_ddp_pt_multinode": SMALL,
    "9_torch_dist_multi_node": [],
    # the curves are compared after --compare-after samples, smoothed over --smooth-samples: both small here
    "8_mnist_ddp_pt_lr": ["--train-samples", "6400", "--epochs", "1", "--compare-after", "1280",
                          "--smooth-samples", "1280"],
    "7_mnist_ddp_pt_timing": SMALL,
    "5_mnist_manual_ddp_profile": SMALL,
    "3_mnist_distributed": SMALL,
    "4_mnist_manual_ddp": SMALL,
    "6_mnist_ddp_pt": SMALL,
    "test-profile": [],
    "2_mnist_training": SMALL,
    "1_torch_dist_gpu": [],
    "0_torch_dist": [],
    # fp16 for 6 steps with an inf injected into rank 1's loss at step 3: both ranks skip it
    "13_mixed_precision": SMALL + ["--precision", "fp16", "--max-steps", "6", "--overflow-at", "3"],
    # 2 micro-batches of 64 per step, each block checkpointed: one all_reduce round per step
    "14_accumulation_checkpointing": SMALL + ["--max-steps", "6", "--accumulate", "2", "--checkpoint-activations"],
    # the default model (width 128) over 2 ranks: over the default 4 MB budget under DDP, within it sharded
    "15_fsdp2": SMALL + ["--max-steps", "6"],
    # 6 steps over 2 ranks with checkpoints at 3 and 6 (--resume if-any: none yet), then the export (1 task)
    "16_distributed_checkpoint": SMALL + ["--max-steps", "6", "--checkpoint-every", "3"],
    # the healthy run, then the --bug skip repro the launcher runs after it (a 5 s collective timeout)
    "17_debugging_hangs": SMALL + ["--max-steps", "6", "--save-every", "3", "--timeout", "5"],
    # the collectives at one size, then 6 DDP steps, the first one's FLOPs counted
    "18_hardware_limits": SMALL + ["--max-steps", "6", "--sizes-mib", "0.25"],
    # 6 steps with every block cut over the 2 ranks, both on the whole batch
    "19_tensor_parallel": SMALL + ["--max-steps", "6"],
    "create_mnist_h5": ["--chunk-samples", "500", "--output", "{work}/made-by-job.h5"],
}
JOB_TIMEOUT = 900  # all jobs took 4 min alone on 2 cores, over 7 in one run of the whole suite


def accuracy(log: str, pattern: str) -> float:
    found = re.findall(pattern, log)
    assert found, f"no match for {pattern!r} in the log"
    return float(found[-1])


def check_0_torch_dist(log, work):
    assert sorted(re.findall(r"\[rank (\d)\] all_reduce\(SUM\) = 3, mean = 1.5", log)) == ["0", "1"]


def check_1_torch_dist_gpu(log, work):
    assert "No CUDA GPU is visible" in log  # the CPU-only path, said out loud
    assert sorted(re.findall(r"\[rank (\d)\] all_reduce\(SUM\) = 3, mean = 1.5", log)) == ["0", "1"]


def check_2_mnist_training(log, work):
    assert accuracy(log, r"test accuracy (0\.\d+) over the 10000 test images") > 0.5
    assert (work / "runs/2_mnist_training/metrics.json").exists()


def check_3_mnist_distributed(log, work):
    assert "identical weights on all 2 ranks: True; identical data order: True." in log


def check_4_mnist_manual_ddp(log, work):
    assert accuracy(log, r"2 ranks x batch 64 = global batch 128; test accuracy (0\.\d+)") > 0.5
    assert json.loads((work / "runs/4_mnist_manual_ddp/metrics.json").read_text())


def check_5_mnist_manual_ddp_profile(log, work):
    assert "gradient sync in the profiled steps" in log
    traces = sorted(p.name.split(".")[0] for p in (work / "log_ddp").glob("rank*.pt.trace.json"))
    assert traces == ["rank0", "rank1"], traces


def check_6_mnist_ddp_pt(log, work):
    assert accuracy(log, r"2 ranks x batch 64 = global batch 128; test accuracy (0\.\d+)") > 0.5


def check_7_mnist_ddp_pt_timing(log, work):
    # one job step per world size: the table holds 1 and 2 ranks
    assert re.search(r"\| 1 x 1 \|", log) and re.search(r"\| 2 x 1 \|", log)
    assert log.count("+ srun --kill-on-bad-exit=1 --ntasks=") == 2
    assert (work / "runs/7_mnist_ddp_pt_timing/scaling.csv").exists()


def check_8_mnist_ddp_pt_lr(log, work):
    # first a one-task step makes the reference, then the job's 2 ranks compare with it (the bound itself
    # is lesson 8's claim, tested in test_lesson8_lr.py)
    assert log.index("1 process: this run is the reference") < log.index("lr 0.02 (base lr 0.01 x 2 ranks)")
    assert re.search(r"against 1 process at equal samples seen .* max \|gap\| [\d.]+ at \d+ samples", log)
    deviation = json.loads((work / "runs/8_mnist_ddp_pt_lr/metrics.json").read_text())["deviation"]
    assert deviation["max_abs"] >= 0 and deviation["after_samples"] == 1280


def check_test_profile(log, work):
    traces = sorted(p.name.split(".")[0] for p in (work / "log").glob("rank*.pt.trace.json"))
    assert traces == ["rank0", "rank1"], traces


def day2_spans_both_nodes(log):
    assert re.search(r"\(node1\)", log) and re.search(r"\(node2\)", log), "the ranks did not span both nodes"
    assert "4 ranks on 2 node(s)" in log


def check_9_torch_dist_multi_node(log, work):
    day2_spans_both_nodes(log)
    assert sorted(re.findall(r"\[rank (\d)\] all_reduce\(SUM\) = 10, mean = 2.5", log)) == ["0", "1", "2", "3"]
    assert "node 0 (node1): ranks 0(local 0) 1(local 1)" in log
    assert "node 1 (node2): ranks 2(local 0) 3(local 1)" in log


def check_10_mnist_ddp_pt_multinode(log, work):
    day2_spans_both_nodes(log)
    assert accuracy(log, r"global batch 256; test accuracy (0\.\d+)") > 0.5


def check_11_mnist_ddp_pt_multinode_streaming(log, work):
    day2_spans_both_nodes(log)
    # the launcher wrote the HDF5 file once, in the batch script, into the job's data dir
    assert f"wrote {work / 'data' / 'fashion-mnist-chunk1000.h5'}" in log
    assert re.search(r"\b3200 training samples in \d+ chunks, each seen exactly once", log)
    assert "replicas identical: True" in log


def check_12_ddp_fault_tolerance(log, work):
    assert re.search(r"on node1 \(srun, restart 0\)", log) and re.search(r"on node2 \(srun, restart 0\)", log), \
        "the ranks did not span both nodes"
    assert "run 1 of job" in log and "requeueing" not in log  # not signalled: one run, no requeue
    assert accuracy(log, r"resumed at steps none; test accuracy (0\.\d+)") > 0.5


def check_13_mixed_precision(log, work):
    assert sorted(re.findall(r"\[rank (\d)\] step 3 skipped \(inf/NaN gradients", log)) == ["0", "1"]
    assert "global batch 128, fp16: test accuracy" in log and "weights identical on all ranks: True" in log


def check_14_accumulation_checkpointing(log, work):
    assert "all_reduce per optimizer step: 1 round(s) of 1 bucket(s)" in log
    assert "(activation checkpointing on)" in log
    assert "2 ranks x 2 micro-batches x batch 64 = global batch 256, bf16: test accuracy" in log


def check_15_fsdp2(log, work):
    assert "DDP's full replica needs 6.18 MB (does not fit); FSDP2 over 2 ranks needs 3.10 MB (fits)" in log
    ratio = float(re.search(r"MB: (0\.\d+) of DDP's \(1/2 = 0.500\)", log).group(1))
    assert ratio <= 0.55 and "global batch 128, fp32: test accuracy" in log


def check_16_distributed_checkpoint(log, work):
    run = work / "runs/16_distributed_checkpoint"
    for step in (3, 6):
        assert f"[rank 0] checkpoint runs/16_distributed_checkpoint/checkpoints/step-{step:09d} (step {step})" in log
    assert "steps 1 to 6 (6 steps) in" in log and "checkpoints: 2 with dcp.save" in log
    assert ("exported the model of step-000000006 (saved by 2 ranks) to runs/16_distributed_checkpoint/"
            "model-export.pt") in log
    assert (run / "model-export.pt").stat().st_size > 0 and (run / "checkpoints/step-000000006/complete.json").exists()


def check_17_debugging_hangs(log, work):
    assert "global batch 128; test accuracy" in log  # the healthy run
    assert re.search(r"\[rank 0\] error: rank 0 waited [\d.]+ s in barrier #\d+ .*; rank 1 last entered "
                     r"all_reduce #\d+ \(shape \[101770\]", log), log
    assert "the --bug skip repro failed on its own, as it should" in log


def check_18_hardware_limits(log, work):
    assert re.search(r"^all_reduce +0\.25 ", log, re.M) and re.search(r"^reduce_scatter +0\.25 ", log, re.M), log
    ratio = float(re.search(r"step 1's FLOPs on this rank, counted by torch: .*\(counted / formula: ([\d.]+)\)",
                            log).group(1))
    assert 0.9 <= ratio <= 1.1, ratio  # the formula is a rule of thumb: within 10% (test_day4.py)
    assert re.search(r"HFU vs measured peak \d+\.\d{3}", log) and "DDP all_reduces 0.556 MB of gradients per step" in log
    assert "2 ranks x batch 64 = global batch 128, fp32: test accuracy" in log
    assert "weights identical on all ranks: True" in log


def check_19_tensor_parallel(log, work):
    assert ("collectives in step 1, forward: 8 all_reduce (2 per block); backward: 8 all_reduce (2 per block)"
            in log)
    assert "each rank holds 0.5000 of the cut parameters (1/2 = 0.5000)" in log
    assert "2 tensor-parallel ranks, batch 64 on every rank, fp32: test accuracy" in log
    assert "replicated weights identical on all ranks: True" in log
    assert (work / "runs/19_tensor_parallel/model.pt").stat().st_size > 0


def check_20_device_mesh_2d(log, work):
    # the mesh's layout, from each rank's node: a row (a tensor-parallel group) per node
    assert "mesh 2 x 2 (dp, tp): rows (the 'tp' groups) [0, 1] on node1; [2, 3] on node2: each row inside one node" \
        in log, log
    assert "+ srun --kill-on-bad-exit=1" in log and "20_device_mesh_2d.py --inner 2 --quick" in log
    assert ("collectives in step 1, forward: 5 all_gather (FSDP2) (1.25 per block), 8 all_reduce (2 per block); "
            in log)
    # each dimension's collectives priced on its own groups: TP's rows inside a node, FSDP2's columns across
    assert re.search(r"^tp +\[0, 1\] +inside a node +all_reduce ", log, re.M), log
    assert re.search(r"^dp +\[0, 2\] +across nodes +all_gather ", log, re.M), log
    assert "'dp' (2 ranks, across nodes): 14 calls" in log and "'tp' (2 ranks, inside one node): 16 calls" in log
    dims = json.loads((work / "runs/20_device_mesh_2d/metrics.json").read_text())["collectives_per_dimension"]
    assert dims["dp"]["inter_node"] is True and dims["tp"]["inter_node"] is False
    assert "fsdp-tp on a 2 x 2 mesh, global batch 128, fp32: test accuracy" in log
    assert (work / "runs/20_device_mesh_2d/model.pt").stat().st_size > 0


def check_21_pipeline_parallel(log, work):
    assert "+ srun --kill-on-bad-exit=1" in log and "21_pipeline_parallel.py --depth 4 --schedule 1f1b --microbatches 8" in log
    # the stages in order over the nodes: ranks 0-1 on the first, 2-3 on the second
    assert re.search(r"\[rank 1\] on node1, stage 1 of 4 \(blocks.1\)", log), log
    assert re.search(r"\[rank 3\] on node2, stage 3 of 4 \(blocks.3, norm, head\)", log), log
    assert "4 pipeline ranks, 4 stages, batch 64 in 8 micro-batches, 1f1b, fp32: test accuracy" in log
    assert (work / "runs/21_pipeline_parallel/model.pt").stat().st_size > 0


def check_22_gpt_pretraining(log, work):
    assert "+ srun --kill-on-bad-exit=1" in log and "run 1 of job" in log, log
    assert ("22_gpt_pretraining.py --layout fsdp-tp --inner 2 --checkpoint-every 50 --resume if-any --max-steps 6"
            in log), log
    assert re.search(r"^\[rank 0\] checkpoint \S+/step-000000006 \(step 6\)", log, re.M), log  # at the end
    assert "mesh 2 x 2 (dp, tp): rows (the 'tp' groups) [0, 1] on node1; [2, 3] on node2: each row inside one node" \
        in log, log
    m = json.loads((work / "runs/22_gpt_pretraining/metrics.json").read_text())
    assert (m["world_size"], m["inner"], m["replicas"], m["steps"]) == (4, 2, 2, 6)
    assert m["mesh"]["spans_nodes"] == {"dp": True, "tp": False}
    assert re.search(r"held-out loss \d\.\d+ nats per byte after 6 steps", log) and "sample: 'The " in log
    assert (work / "runs/22_gpt_pretraining/model.pt").stat().st_size > 0


def check_23_hf_finetuning(log, work):
    assert "+ srun --kill-on-bad-exit=1" in log and "23_hf_finetuning.py --max-steps 4" in log
    m = json.loads((work / "runs/23_hf_finetuning/metrics.json").read_text())
    assert (m["world_size"], m["replicas"], m["steps"], m["global_batch_rows"]) == (4, 4, 4, 32)
    assert re.search(r"held-out loss \d\.\d+ as loaded, \d\.\d+ after 4 steps", log), log
    assert hf.verify_digests(work / "runs/23_hf_finetuning/hf")  # written whole, its digests hold


def check_create_mnist_h5(log, work):
    assert f"wrote {work / 'made-by-job.h5'}" in log and (work / "made-by-job.h5").exists()


@pytest.fixture(scope="module")
def jobs(slurm_cluster, dataset, site_probe, tmp_path_factory):
    """Every launcher submitted through submit.sh with the CPU-only profile, all at once; waits for all.

    The jobs run in their own working directory (logs/, runs/, log_ddp/ land there) with a data dir
    that links to the prepared dataset, so that lesson 11's HDF5 file is written there too.
    """
    from data_tools.datasets import default_data_dir, spec

    work = tmp_path_factory.mktemp("slurm-launchers")
    (work / "data").mkdir()
    folder = spec(dataset).folder
    (work / "data" / folder).symlink_to(default_data_dir() / folder)
    env = {**slurm_cluster.env, "SITE_TASKS_PER_NODE": "2", "SITE_CPUS_PER_TASK": "1",
           "COURSE_DATA_DIR": str(work / "data")}
    submitted, results = {}, {}
    hf.save_whole(work / "hf-model", GPT(width=32, hidden=64).state_dict(), GPT(width=32, hidden=64).sizes, 64)
    # Lesson 9 once more, with a site profile given by path whose site_setup exports a token
    # (tests/slurm_fixture.py): the job script sets the site up, multinode_setup_and_run.sh keeps it.  First,
    # as it needs both nodes at once: submitted last it waited for every other job to end.
    done = submit("9", "--site", site_probe.path, env=env, cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = int(re.search(r"^Submitted batch job (\d+)$", done.stdout, flags=re.M).group(1))
    submitted["site probe"] = (job_id, "", "")
    order = list(RUNS)
    for launcher in sorted(LAUNCHERS, key=lambda p: order.index(p.stem) if p.stem in order else -1):
        args = [a.format(work=work) for a in RUNS.get(launcher.stem, [])]
        shown = submit(launcher.stem, "--site", "cpu-only", "--dry-run", "--", *args, env=env, cwd=work)
        done = submit(launcher.stem, "--site", "cpu-only", "--", *args, env=env, cwd=work)
        assert done.returncode == 0, done.stdout + done.stderr
        job_id = int(re.search(r"^Submitted batch job (\d+)$", done.stdout, flags=re.M).group(1))
        submitted[launcher.stem] = (job_id, shown.stdout.strip(), done.stdout)
    # The same launcher with a plain sbatch, as its header shows: without a profile (COURSE_REPO given
    # instead of submitting from the repository root), and from a directory that is no course.
    elsewhere = work / "elsewhere"
    (elsewhere / "logs").mkdir(parents=True)
    plain = ["sbatch", "--parsable", "--ntasks-per-node=2", "--cpus-per-task=1", str(SLURM / "0_torch_dist.sh")]
    for name, cwd, extra_env in [("plain sbatch", work, {"COURSE_REPO": str(REPO)}), ("no course", elsewhere, {})]:
        done = subprocess.run(plain, capture_output=True, text=True, cwd=cwd, timeout=60,
                              env={**slurm_cluster.env, **extra_env})
        assert done.returncode == 0, done.stderr
        submitted[name] = (int(done.stdout.split(";")[0]), "", "")
    deadline = time.monotonic() + JOB_TIMEOUT
    while len(results) < len(submitted):  # one scontrol for all jobs per second: the polls cost the jobs CPU
        known = slurm_cluster.jobs_info()
        for name, (job_id, _, _) in submitted.items():
            info = known.get(job_id, {})
            if name not in results and info.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                 "NODE_FAIL", "OUT_OF_MEMORY"}:
                results[name] = info
        if time.monotonic() > deadline:
            left = {name: known.get(job_id, {}) for name, (job_id, _, _) in submitted.items() if name not in results}
            for job_id, _, _ in submitted.values():
                slurm_cluster.run(["scancel", str(job_id)])
            pytest.fail(f"jobs not ended after {JOB_TIMEOUT} s: " + "; ".join(
                f"{name} ({info.get('JobState')}, reason {info.get('Reason')}, ran {info.get('RunTime')})"
                for name, info in sorted(left.items())))
        time.sleep(1.0)
    return work, submitted, results


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.stem)
def test_launcher_runs_on_the_two_node_slurm(jobs, launcher):
    work, submitted, results = jobs
    name = launcher.stem
    job_id, dry_run, submit_output = submitted[name]
    # submit.sh ran exactly the command that --dry-run printed
    assert f"submit.sh: {dry_run}\n" in submit_output
    log_file = work / "logs" / f"{name}-{job_id}.out"
    assert f"submit.sh: log: logs/{name}-{job_id}.out" in submit_output
    log = log_file.read_text()
    info = results[name]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    # the launcher's frame: start, resolved settings, the exact commands, end with the exit code
    assert re.match(rf"==== {re.escape(name)} {job_id}: started \S+ \S+ \S+ on node[12]\n", log), log[:200]
    assert f"site profile       {SITES_DIR / 'cpu-only.env'}" in log
    assert re.search(rf"==== {re.escape(name)} {job_id}: ended .* exit code 0\n$", log), log[-300:]
    assert "\n+ " in log
    if two_nodes(launcher):
        assert "nodes              2 (node[1-2])" in log
        assert "tasks (ranks)      4, 2 per node" in log
    else:
        assert "nodes              1 (node" in log
    check = globals().get(f"check_{name.replace('-', '_')}")
    assert check is not None, f"no expected result for {name}: add check_{name.replace('-', '_')} and RUNS"
    check(log, work)


@pytest.mark.slurm
@pytest.mark.slow
def test_plain_sbatch_runs_a_launcher_without_a_profile(jobs):
    work, submitted, results = jobs
    job_id = submitted["plain sbatch"][0]
    log = (work / "logs" / f"0_torch_dist-{job_id}.out").read_text()
    assert results["plain sbatch"]["ExitCode"] == "0:0", log
    assert "site profile       none (plain sbatch" in log
    if (REPO / ".venv" / "bin" / "activate").exists():  # no profile: the course's own venv
        assert f"python             {REPO}/.venv/bin/python" in log
    assert sorted(re.findall(r"\[rank (\d)\] all_reduce\(SUM\) = 3, mean = 1.5", log)) == ["0", "1"]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_site_profile_given_to_submit_reaches_every_rank_once(jobs, site_probe):
    work, submitted, results = jobs
    job_id = submitted["site probe"][0]
    log = (work / "logs" / f"9_torch_dist_multi_node-{job_id}.out").read_text()
    assert results["site probe"]["ExitCode"] == "0:0", log
    check_9_torch_dist_multi_node(log, work)
    assert f"site profile       {site_probe.path}" in log
    # site_setup ran once, in the job script; every rank on both nodes saw its export
    site_probe.check(log)
    assert f"multinode: site profile {site_probe.path}: set up by the job script" in log


@pytest.mark.slurm
@pytest.mark.slow
def test_a_launcher_submitted_outside_the_course_says_where_it_looked(jobs):
    work, submitted, results = jobs
    job_id = submitted["no course"][0]
    log = (work / "elsewhere" / "logs" / f"0_torch_dist-{job_id}.out").read_text()
    assert results["no course"]["ExitCode"] == "1:0", log
    assert f"error: no course in {work / 'elsewhere'}: submit from the repository root or export COURSE_REPO" in log
    assert "srun" not in log


def test_port_check_ignores_time_wait_but_not_a_listener():
    """Lessons 7 and 8 run several job steps in one job: the same job id, so the same derived port, which
    the previous step's rank 0 left in TIME_WAIT. That port is free to listen on (the TCPStore sets
    SO_REUSEADDR); a port someone listens on is not."""
    import socket

    from course.launching.cli import CourseError
    from course.launching.ports import check_port_is_free

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore listens
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(CourseError, match=f"port {port} on node1 is already in use"):
            check_port_is_free("node1", port)
        client = socket.create_connection(("127.0.0.1", port))
        server_side, _ = listener.accept()
        server_side.close()  # the side that closes first keeps the port in TIME_WAIT
        client.close()
    time_wait = subprocess.run(["ss", "-tanH", "state", "time-wait", f"( sport = :{port} )"],
                               capture_output=True, text=True)
    if time_wait.returncode == 0:
        assert time_wait.stdout.strip(), "expected the port in TIME_WAIT"
    check_port_is_free("node1", port)  # no exception


def test_the_profiles_that_the_site_guide_says_activate_the_course_venv_do(tmp_path):
    """docs/trainers/site-profiles.md names the shipped profiles whose site_setup activates $COURSE_REPO/.venv;
    each is run (with `module` a no-op) on a repository copy that has a .venv, and only those activate it."""
    guide = (REPO / "docs" / "trainers" / "site-profiles.md").read_text()
    said = re.search(r"Of the shipped profiles, (.+?) activate\s+`\$COURSE_REPO/\.venv`", " ".join(guide.split()))
    assert said, "the site guide no longer says which profiles activate the course's venv"
    claimed = set(re.split(r", | and ", said.group(1)))
    repo = tmp_path / "repo"
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "activate").write_text('export VIRTUAL_ENV="$COURSE_REPO/.venv"\n')
    activating = set()
    for site in SITES:
        done = subprocess.run(
            ["bash", "-c", 'module() { :; }; COURSE_REPO="$2"; source "$1/slurm/lib/site.sh"; '
                           'course_load_site "$3"; site_setup; echo "venv=${VIRTUAL_ENV:-}"',
             "bash", str(REPO), str(repo), str(SITES_DIR / f"{site}.env")],
            capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
        assert done.returncode == 0, (site, done.stderr)
        if f"venv={repo}/.venv" in done.stdout:
            activating.add(site)
    assert activating == claimed


@pytest.mark.slurm
def test_interactive_runs_on_a_compute_node_with_the_profile(slurm_cluster):
    """`submit.sh --interactive` (a shell, or the command after --, on a compute node): one task with the cores
    of the node's ranks, the profile's site_setup done, in the directory it was started from; there, an
    explicit --nproc starts that many ranks."""
    env = {**slurm_cluster.env, "SITE_TASKS_PER_NODE": "2", "SITE_CPUS_PER_TASK": "1"}
    shown = submit("--interactive", "--site", "cpu-only", "--dry-run", env=env)
    assert shown.stdout.startswith("srun --nodes=1 --export=ALL,") and " --pty --ntasks=1 --cpus-per-task=2 " in \
        shown.stdout, shown.stdout
    done = submit("--interactive", "--site", "cpu-only", "--", "bash", "-c",
                  'echo "cpus $SLURM_CPUS_PER_TASK"; "$PYTHON" day1/0_torch_dist.py --nproc 2', env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(rf"^interactive: node[12], site profile {re.escape(str(SITES_DIR / 'cpu-only.env'))}, python ",
                     done.stdout, flags=re.M), done.stdout
    assert "cpus 2" in done.stdout and done.stdout.count("mean = 1.5") == 2, done.stdout
    assert submit("--interactive", "99", "--site", "cpu-only", env=env).returncode == 1  # no such lesson


def test_interactive_with_two_nodes_and_without_the_reservation_dry_run():
    """`submit.sh --interactive --nodes 2` (its --help documents it; it used to stop: "a one-node lesson"):
    salloc with day 2's allocation and the profile's options; --no-reservation leaves SITE_RESERVATION out,
    here and in a batch job (the week before the workshop, the reservation has not begun)."""
    env = {"SITE_RESERVATION": "course"}
    for args in (["--interactive", "--nodes", "2"], ["--interactive", "9"]):
        shown = submit(*args, "--site", "generic-gpu", "--dry-run", env=env)
        assert shown.returncode == 0, shown.stderr
        assert shlex.split(shown.stdout) == ["salloc", "--reservation=course", "--nodes=2", "--ntasks-per-node=2",
                                             "--cpus-per-task=8", "--gpus-per-node=2"], shown.stdout
    shown = submit("--interactive", "--nodes", "2", "--site", "generic-gpu", "--no-reservation", "--dry-run", env=env)
    assert shown.returncode == 0 and "--reservation" not in shown.stdout, shown.stdout + shown.stderr
    for lesson in ("0", "10", str(REPO / "scripts" / "readiness_job.sh")):
        kept = submit(lesson, "--site", "cpu-only", "--dry-run", env=env).stdout
        dropped = submit(lesson, "--site", "cpu-only", "--dry-run", "--no-reservation", env=env).stdout
        assert "--reservation=course" in kept and "--reservation" not in dropped and dropped, (kept, dropped)
    # the readiness check passes its options on to submit.sh: the trainer's command of the week before
    ready = subprocess.run(["bash", str(REPO / "scripts" / "readiness_check.sh"), "--site", "generic-gpu",
                            "--no-reservation", "--dry-run"], capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, **env}, timeout=60)
    assert ready.returncode == 0 and ready.stdout.startswith("sbatch ") and "--reservation" not in ready.stdout, \
        ready.stdout + ready.stderr


@pytest.mark.slurm
def test_interactive_with_two_nodes_holds_both_nodes_on_the_test_slurm(slurm_cluster, tmp_path):
    """The documented `slurm/submit.sh --interactive --nodes 2 --site NAME`, with a command after -- instead of
    a shell: salloc with day 2's allocation, whose command sees both nodes and 2 tasks on each."""
    env = {**slurm_cluster.env, "SITE_CPUS_PER_TASK": "1"}
    done = submit("--interactive", "--nodes", "2", "--site", "cpu-only", "--", "bash", "-c",
                  'echo "nodes $SLURM_JOB_NUM_NODES tasks $SLURM_NTASKS"; srun hostname | sort | uniq -c',
                  env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nodes 2 tasks 4" in done.stdout, done.stdout
    assert re.search(r"^\s*2 node1$", done.stdout, flags=re.M) and re.search(r"^\s*2 node2$", done.stdout,
                                                                             flags=re.M), done.stdout


@pytest.mark.slurm
def test_no_reservation_lets_slurm_accept_a_job_whose_reservation_does_not_exist(slurm_cluster, tmp_path):
    """A profile whose SITE_RESERVATION names a reservation the cluster does not have (yet): Slurm refuses
    the job (test_a_value_slurm_refuses_fails_before_submission); with --no-reservation it would run it."""
    env = {**slurm_cluster.env, "SITE_RESERVATION": "course", "SITE_TASKS_PER_NODE": "2"}
    refused = submit("0", "--site", "cpu-only", "--test-only", env=env, cwd=tmp_path)
    assert refused.returncode == 1 and "reservation" in refused.stderr, refused.stdout + refused.stderr
    for lesson in ("0", "10"):
        checked = submit(lesson, "--site", "cpu-only", "--test-only", "--no-reservation", env=env, cwd=tmp_path)
        assert checked.returncode == 0 and "to start at" in checked.stdout, checked.stdout + checked.stderr
