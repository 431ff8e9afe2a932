"""A real two-node Slurm cluster on this one machine, for tests.

    with SlurmCluster() as cluster:
        print(cluster.run(["srun", "-N2", "hostname"]).stdout)   # node1, node2

What it brings up (needs root, see skip_reason()):
- a private munged on its own socket (Slurm finds it through AuthInfo=socket=...), so we never
  touch, reuse or stop a munged that something else runs;
- a bridge in the root network namespace (the "login node", where slurmctld runs) and one network
  namespace per compute node, joined to the bridge by a veth pair: every node has its own IP, so
  cross-node traffic (gloo, NCCL bootstrap) really crosses an interface;
- slurmctld, and one slurmd per node inside the node's namespace with its own hostname and
  /etc/hosts; jobs and their steps inherit both;
- two fake GPUs per node (character devices), so launchers asking for `--gres=gpu:N` or
  `--gpus-per-node` can be scheduled and checked with `sbatch --test-only`.

Everything lives under one directory /tmp/slurmtest-<tag>/ and under names carrying the same random
tag, so two sessions can coexist. The Slurm configuration is reached only through SLURM_CONF
(`cluster.env`); nothing under /etc is changed. Teardown stops only the processes this instance
started, verified by their command line, and removes what it created, whatever happened.
Leftovers of a session that was killed before its teardown are removed by the next start.

Measured recipe and its pitfalls: /work/shared/notes/slurm-local-cluster.md.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

# Daemons live in /usr/sbin, which is not on every user's PATH.
_SYSTEM_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
_REQUIRED_BINARIES = [
    "slurmctld", "slurmd", "munged", "munge", "ip", "nsenter", "unshare", "mount",
    "sinfo", "srun", "sbatch", "salloc", "scontrol", "scancel", "squeue",
]
_NAME_PREFIX = "slurmtest"
_MUNGE_KEY = Path("/etc/munge/munge.key")
# Job states after which a job will not run again (squeue/scontrol names).
_FINAL_JOB_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
}


def _system_env() -> dict[str, str]:
    """os.environ with the system directories appended to PATH."""
    path = os.environ.get("PATH", "").split(os.pathsep)
    return {**os.environ, "PATH": os.pathsep.join(path + [p for p in _SYSTEM_PATH if p not in path])}


def _cluster_env(conf: Path) -> dict[str, str]:
    """Environment for Slurm clients of the cluster configured by `conf`."""
    # Drop SLURM_* inherited from a real allocation the tests may run in: they would point our
    # srun/sbatch at a job id that this cluster does not know.
    env = {key: value for key, value in _system_env().items() if not key.startswith("SLURM_")}
    return {**env, "SLURM_CONF": str(conf)}


# Names carry the instance's tag so that sessions can coexist; interface names have at most 15 characters.
def _netns_name(tag: str, node: str) -> str:
    return f"{_NAME_PREFIX}-{tag}-{node}"


def _veth_name(tag: str, index: int) -> str:
    return f"sltv{tag}{index}"


def _bridge_name(tag: str) -> str:
    return f"sltb{tag}"


def _which(name: str) -> str | None:
    return shutil.which(name, path=_system_env()["PATH"])


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs a system command (ip, mknod...), raising with its stderr when it fails and check is set."""
    proc = subprocess.run(args, capture_output=True, text=True, env=_system_env())
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _is_running(pid: int) -> bool:
    # A killed daemon can stay a zombie for a while on these VMs: a zombie has finished.
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError):  # no such process (any more), or a pid file's garbage (-1)
        return False


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, ValueError):  # gone, a zombie (no command line left), or a pid file's garbage
        return ""


def _job_fields(line: str) -> dict[str, str]:
    """One job of `scontrol show job --oneliner` as a dict.  Values may contain spaces (Command=, Reason=),
    but keys are single words followed by "="."""
    return dict(re.findall(r"(\S+?)=(.*?)(?=\s+\S+?=|\s*$)", line))


def _wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _terminate(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is still running after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        alive = [pid for pid in pids if _is_running(pid)]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if _wait_until(lambda: not any(_is_running(pid) for pid in alive), wait):
            return


def _free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _pick_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no interface on this machine uses yet (another session may run)."""
    used = _sh("ip", "-4", "-o", "addr", "show").stdout + _sh("ip", "-4", "route", "show").stdout
    candidates = list(range(1, 255))
    secrets.SystemRandom().shuffle(candidates)
    for third in candidates:
        if f"10.213.{third}." not in used:
            return ipaddress.IPv4Network(f"10.213.{third}.0/24")
    raise RuntimeError("no free /24 left in 10.213.0.0/16")


def skip_reason() -> str | None:
    """Why this machine cannot run a SlurmCluster, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, mounts, mknod)"
    missing = [name for name in _REQUIRED_BINARIES if _which(name) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install -y slurm-wlm munge iproute2 util-linux)"
    if not _MUNGE_KEY.exists():
        return f"no {_MUNGE_KEY} (installing the munge package creates it)"
    probe = f"{_NAME_PREFIX}-probe-{os.getpid()}"
    created = _sh("ip", "netns", "add", probe, check=False)
    if created.returncode != 0:
        return f"cannot create a network namespace: {created.stderr.strip()}"
    _sh("ip", "netns", "delete", probe, check=False)
    return None


class SlurmCluster:
    """Two compute nodes (node1, node2) in partition `debug`, each with `cpus` CPUs and `gpus` fake GPUs."""

    partition = "debug"
    nodes = ["node1", "node2"]

    def __init__(self, cpus: int = 4, gpus: int = 2, start_timeout: float = 60.0):
        self.cpus = cpus
        self.gpus = gpus
        self.start_timeout = start_timeout
        self.tag = secrets.token_hex(3)
        self.root = Path(f"/tmp/{_NAME_PREFIX}-{self.tag}")
        self.workdir = self.root / "work"  # for jobs' files; default cwd of run() and sbatch_wait()
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.env = _cluster_env(self.conf)  # pass as env= to run Slurm commands against this cluster
        self.bridge = _bridge_name(self.tag)
        self.netns = {node: _netns_name(self.tag, node) for node in self.nodes}
        self.veth = {node: _veth_name(self.tag, index) for index, node in enumerate(self.nodes, 1)}
        self.subnet: ipaddress.IPv4Network | None = None
        self.node_ip: dict[str, str] = {}
        self.node_fast_ip: dict[str, str] = {}  # a second address of each node, named <node>i (see _write_config)
        self._children: list[subprocess.Popen] = []  # to reap them, so they do not stay zombies
        self._owns_root = False  # never tear down a directory that another session created

    # ----------------------------------------------------------------- public API

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        _cleanup_stale_sessions()
        try:
            self._make_dirs()
            self._start_munged()
            self._setup_network()
            self._write_config()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
            self.wait_for_idle_nodes(self.start_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Removes everything start() made; safe to call on a half-started cluster, and twice."""
        try:
            if self._owns_root:
                self._owns_root = False
                _teardown(self.root, self.tag)
        finally:
            for child in self._children:
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            self._children.clear()

    def run(
        self, cmd: list[str] | str, timeout: float = 120, cwd: str | os.PathLike | None = None, **kwargs,
    ) -> subprocess.CompletedProcess:
        """Runs a client command (srun, salloc, sinfo...) against this cluster; output captured as text.

        A string runs through bash, so `$(...)` and pipes work. cwd, which is also the working directory
        of the job's tasks, defaults to `workdir`, so that Slurm's output files (slurm-<id>.out) do not
        land in the repository. Extra kwargs go to subprocess.run. Does not raise on a non-zero exit
        code: assert on `returncode`.
        """
        return subprocess.run(
            cmd, shell=isinstance(cmd, str), executable="/bin/bash" if isinstance(cmd, str) else None,
            env=self.env, cwd=cwd or self.workdir, capture_output=True, text=True, timeout=timeout, **kwargs,
        )

    def sbatch_wait(
        self, script_path: str | os.PathLike, *sbatch_options: str, script_args: tuple[str, ...] = (),
        cwd: str | os.PathLike | None = None, timeout: float = 300,
    ) -> tuple[int, int, str]:
        """`sbatch [sbatch_options] script [script_args]`, waits for the end: (job_id, exit code, output).

        cwd (the job's working directory) defaults to `workdir`, as for run(). The exit code is the
        batch script's, or 128+signal when a signal ended it. The output is the job's StdOut file,
        followed by its StdErr file when that is a different one.
        """
        submitted = self.run(
            ["sbatch", "--parsable", *sbatch_options, str(Path(script_path).resolve()), *script_args],
            cwd=cwd, timeout=60,
        )
        if submitted.returncode != 0:
            raise RuntimeError(f"sbatch failed ({submitted.returncode}): {submitted.stderr.strip()}")
        job_id = int(submitted.stdout.strip().split(";")[0])  # "<id>[;<cluster>]"

        deadline = time.monotonic() + timeout
        while (job := self.job_info(job_id)).get("JobState") not in _FINAL_JOB_STATES:
            if time.monotonic() > deadline:
                self.run(["scancel", str(job_id)])
                raise TimeoutError(
                    f"job {job_id} still {job.get('JobState')} after {timeout} s; "
                    f"output so far:\n{self._job_output(job)}"
                )
            time.sleep(0.2)

        status, _, sig = job.get("ExitCode", "0:0").partition(":")
        exit_code = int(status) or (128 + int(sig) if sig and int(sig) else 0)
        return job_id, exit_code, self._job_output(job)

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict of its Key=Value fields (empty when Slurm forgot the job)."""
        shown = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)], timeout=30)
        if shown.returncode != 0:
            return {}
        return _job_fields(shown.stdout.strip())

    def jobs_info(self) -> dict[int, dict[str, str]]:
        """Every job Slurm still knows (MinJobAge after it ended), by id: one `scontrol show job` for all."""
        shown = self.run(["scontrol", "show", "job", "--oneliner"], timeout=30)
        jobs = {}
        for line in shown.stdout.splitlines() if shown.returncode == 0 else []:
            fields = _job_fields(line.strip())
            if fields.get("JobId", "").isdigit():
                jobs[int(fields["JobId"])] = fields
        return jobs

    def wait_for_idle_nodes(self, timeout: float = 30.0) -> None:
        """Returns once sinfo shows every node idle (e.g. after a previous test's job); raises with logs if not."""
        def states() -> dict[str, str]:
            shown = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=30)
            return dict(line.split() for line in shown.stdout.splitlines() if line.strip())

        if not _wait_until(lambda: all(states().get(n) == "idle" for n in self.nodes), timeout, 0.3):
            raise RuntimeError(
                f"nodes not idle after {timeout} s: {states()}\n"
                + "\n".join(self._log_tail(name) for name in
                            ["slurmctld.log"] + [f"slurmd.{n}.log" for n in self.nodes])
            )

    # ----------------------------------------------------------------- bring-up steps

    def _make_dirs(self) -> None:
        self.root.mkdir(mode=0o755)
        self._owns_root = True
        # The owner's pid lets a later session recognise this directory as stale if we get killed.
        (self.root / "owner.pid").write_text(f"{os.getpid()}\n")
        for sub in ("etc", "state", "spool", "log", "run", "gpu", "work", "munge"):
            (self.root / sub).mkdir()
        # munged refuses to run unless its directory belongs to it and its parents are not writable
        # by others (hence 0755 on root).
        shutil.chown(self.root / "munge", "munge", "munge")

    def _start_munged(self) -> None:
        munge_dir = self.munge_socket.parent
        self._spawn(
            [_which("munged"), "--foreground", "--force",
             f"--socket={self.munge_socket}", f"--pid-file={munge_dir}/munged.pid",
             f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed"],
            log=self.root / "log" / "munged.out", user="munge", group="munge",
        )
        def credential_round_trip() -> bool:
            cred = _sh("munge", f"--socket={self.munge_socket}", "--no-input", check=False)
            return cred.returncode == 0
        if not _wait_until(credential_round_trip, timeout=10):
            raise RuntimeError(f"munged did not come up:\n{self._log_tail('munged.out')}")

    def _setup_network(self) -> None:
        self.subnet = _pick_subnet()
        base = self.subnet.network_address
        self.controller_ip = str(base + 1)  # on the bridge
        self.node_ip = {node: str(base + 10 + i) for i, node in enumerate(self.nodes, 1)}  # .11, .12
        self.node_fast_ip = {node: str(base + 20 + i) for i, node in enumerate(self.nodes, 1)}  # .21, .22
        prefix = self.subnet.prefixlen

        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.controller_ip}/{prefix}", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            ns, veth = self.netns[node], self.veth[node]
            _sh("ip", "netns", "add", ns)
            # The node's end is created directly inside its namespace as eth0, the name users expect
            # (e.g. for GLOO_SOCKET_IFNAME=eth0).
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.node_ip[node]}/{prefix}", "dev", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.node_fast_ip[node]}/{prefix}", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _write_config(self) -> None:
        root, hostname = self.root, socket.gethostname().split(".")[0]
        gpu_files = [root / "gpu" / f"nvidia{i}" for i in range(self.gpus)]
        for device in gpu_files:
            # Slurm refuses regular files as GPU devices and marks a node INVAL for a Count-only
            # gres.conf; a character device (here the same numbers as /dev/null) is accepted.
            _sh("mknod", str(device), "c", "1", "3")
        gres = f"Gres=gpu:{self.gpus}" if self.gpus else ""
        node_lines = "\n".join(
            f"NodeName={node} NodeAddr={ip} CPUs={self.cpus} RealMemory=4000 {gres} State=UNKNOWN"
            for node, ip in self.node_ip.items()
        )
        self.conf.write_text(f"""\
# Written by tests/slurm_cluster.py for one test session; removed at its end.
ClusterName={_NAME_PREFIX}{self.tag}
# The name must be this machine's short hostname: slurmctld checks that it runs where configured.
SlurmctldHost={hostname}({self.controller_ip})
SlurmctldPort={_free_tcp_port()}
SlurmdPort=6818
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
# No cgroups, no accounting, no PMIx: the smallest setup that runs real multi-node jobs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Advertise the CPUs of the node lines, not the few real cores of this machine.
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Short timers: tests wait on these. Batch jobs would otherwise start up to 3 s after submission.
SchedulerParameters=batch_sched_delay=0
KillWait=2
MinJobAge=300
SlurmdTimeout=30
InactiveLimit=0
{node_lines}
PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        (root / "etc" / "gres.conf").write_text(
            "AutoDetect=off\n"
            + (f"NodeName={','.join(self.nodes)} Name=gpu File={root}/gpu/nvidia[0-{self.gpus - 1}]\n"
               if self.gpus else "")
        )
        for node in self.nodes:
            # Bind-mounted over /etc/hosts inside the node only; the machine's /etc/hosts is untouched.
            # Each node name must resolve to its bridge address, not 127.0.0.1, or gloo connects to
            # the wrong place.  Each node's second address has the node's name with an `i`, as JSC's
            # nodes have on their InfiniBand network (a site profile's SITE_MASTER_ADDR='{host}i'): a name
            # the node's own host name does not resolve to.
            (root / "etc" / f"hosts.{node}").write_text(
                "127.0.0.1 localhost\n::1 localhost\n"
                f"{self.controller_ip} {hostname}\n"
                + "".join(f"{ip} {name}\n{self.node_fast_ip[name]} {name}i\n" for name, ip in self.node_ip.items())
            )

    def _start_slurmctld(self) -> None:
        self._spawn([_which("slurmctld"), "-D", "-f", str(self.conf)], log=self.root / "log" / "slurmctld.out")

    def _start_slurmd(self, node: str) -> None:
        # Enter only the node's network namespace (not `ip netns exec`, which remounts /sys and so
        # hides /sys/fs/cgroup that slurmd 22.05 needs even without cgroup plugins), then a private
        # mount + UTS namespace for the node's hostname and /etc/hosts. Every exec keeps the PID, so
        # the PID we get is slurmd's.
        self._spawn(
            [_which("nsenter"), f"--net=/run/netns/{self.netns[node]}",
             _which("unshare"), "--mount", "--propagation", "slave", "--uts",
             "/bin/sh", "-c", 'mount --bind "$1" /etc/hosts && hostname "$2" && exec "$3" -D -N "$2" -f "$4"',
             "sh", str(self.root / "etc" / f"hosts.{node}"), node, _which("slurmd"), str(self.conf)],
            log=self.root / "log" / f"slurmd.{node}.out",
        )

    def _spawn(self, argv: list[str], log: Path, **popen_kwargs) -> None:
        with open(log, "ab") as out:
            self._children.append(subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,  # a Ctrl-C in the test terminal must not hit the daemons first
                **popen_kwargs,
            ))

    def _log_tail(self, name: str, lines: int = 20) -> str:
        path = self.root / "log" / name
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"--- {path}: missing"
        return f"--- {path}:\n" + "\n".join(text)

    def _job_output(self, job: dict[str, str]) -> str:
        paths = [job.get("StdOut")] + ([job.get("StdErr")] if job.get("StdErr") != job.get("StdOut") else [])
        texts = []
        for path in filter(None, paths):
            try:
                texts.append(Path(path).read_text(errors="replace"))
            except OSError:
                pass
        return "".join(texts)


# --------------------------------------------------------------------- teardown

def _teardown(root: Path, tag: str) -> None:
    """Stops and removes one cluster from what is on disk and the names derived from its tag.

    Used both by SlurmCluster.stop() and for a killed session's leftovers, so it relies on no
    in-memory state. Every step runs even if an earlier one failed.
    """
    conf = root / "etc" / "slurm.conf"
    netns = [_netns_name(tag, node) for node in SlurmCluster.nodes]
    errors = []

    def cancel_jobs():
        # Lets slurmd end the job steps in order; whatever remains is killed with the namespaces.
        if not (conf.exists() and _daemon_pids(root, "run/slurmctld.pid")):
            return
        env = _cluster_env(conf)
        subprocess.run(["scancel", "--full", f"--partition={SlurmCluster.partition}"],
                       env=env, capture_output=True, timeout=30)

        def queue_empty() -> bool:
            shown = subprocess.run(["squeue", "--noheader"], env=env, capture_output=True, text=True, timeout=30)
            return shown.returncode != 0 or not shown.stdout.strip()
        _wait_until(queue_empty, timeout=10, interval=0.3)

    def stop_node_processes():
        # slurmd, slurmstepd and every job process live in the node namespaces.
        pids = _daemon_pids(root, *(f"run/slurmd.{node}.pid" for node in SlurmCluster.nodes))
        for ns in netns:
            listed = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            pids += [int(pid) for pid in listed if pid.isdigit()]
        _terminate(pids)

    def remove_network():
        existing = _sh("ip", "netns", "list", check=False).stdout.split()
        for ns in netns:
            if ns in existing:
                _sh("ip", "netns", "delete", ns)
        # Deleting a namespace deletes the veth pair with it, unless a process still holds the
        # namespace: delete the host ends explicitly too.
        for index, _ in enumerate(SlurmCluster.nodes, 1):
            _sh("ip", "link", "delete", _veth_name(tag, index), check=False)
        _sh("ip", "link", "delete", _bridge_name(tag), check=False)

    steps = [
        ("cancel jobs", cancel_jobs),
        ("stop node processes", stop_node_processes),
        ("stop slurmctld", lambda: _terminate(_daemon_pids(root, "run/slurmctld.pid"))),
        ("stop munged", lambda: _terminate(_daemon_pids(root, "munge/munged.pid"))),
        ("remove network", remove_network),
        ("remove files", lambda: shutil.rmtree(root, ignore_errors=True)),
    ]
    for label, action in steps:
        try:
            action()
        except Exception as error:  # teardown goes on; what failed is reported at the end
            errors.append(f"{label}: {error}")
    if errors:
        raise RuntimeError(f"teardown of {root} incomplete: " + "; ".join(errors))


def _daemon_pids(root: Path, *pid_files: str) -> list[int]:
    """PIDs read from pid files under root, only of running processes whose command line names root.

    The command-line check keeps a stale pid file from making us kill an unrelated process that
    got the same PID later.
    """
    pids = []
    for name in pid_files:
        try:
            pid = int((root / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if _is_running(pid) and str(root) in _cmdline(pid):
            pids.append(pid)
    return pids


def _cleanup_stale_sessions() -> None:
    """Tears down clusters whose owning process is gone (a test run killed before its teardown)."""
    for root in Path("/tmp").glob(f"{_NAME_PREFIX}-*"):
        try:
            owner = int((root / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not _is_running(owner):
            _teardown(root, root.name.removeprefix(f"{_NAME_PREFIX}-"))


def follow_requeue(cluster, job: int, log: str, timeout: float = 400, while_running=None) -> dict:
    """Wait for the job to end; when it waits in the queue after a requeue, let it start again at once.
    log: the job's log under the cluster's work dir, "{job}" for its id.  while_running(text of the log so
    far) is called while the job runs (to signal it).

    A requeued job is held for a while (measured: ~150 s, its BeginTime) before it may start again, as it
    would wait for a free node on a busy cluster; the test moves its start to now, and gives the second run
    a longer time limit so that only the first run is signalled."""
    deadline, log = time.monotonic() + timeout, cluster.workdir / log.format(job=job)
    released = set()
    while time.monotonic() < deadline:
        info = cluster.job_info(job)
        state, restarts = info.get("JobState"), info.get("Restarts", "0")
        if state == "PENDING" and restarts != "0" and restarts not in released:
            cluster.wait_for_idle_nodes(60)
            time.sleep(1)  # idle in sinfo; give the nodes' last clean-up a moment before the job starts again
            update = cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10"])
            assert update.returncode == 0, update.stderr
            released.add(restarts)
        if state == "RUNNING" and while_running:
            while_running(log.read_text() if log.exists() else "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            text = log.read_text() if log.exists() else ""
            if state != "COMPLETED":  # what Slurm said about it, for the assertion message
                text += f"\n--- scontrol: {info}\n" + "\n".join(
                    cluster._log_tail(name, 15) for name in ("slurmctld.log", "slurmd.node1.log", "slurmd.node2.log"))
            return {**info, "log": text}
        time.sleep(0.3)
    cluster.run(["scancel", str(job)])
    raise AssertionError(f"job {job} did not end within {timeout} s:\n{log.read_text() if log.exists() else ''}")
