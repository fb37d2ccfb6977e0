"""A real Slurm for tests/slurm: the `slurm` marker, and a module-scoped `cluster` fixture that installs
Slurm and munge if needed (apt-get; the test is skipped only if that fails), starts munged, slurmctld and
two slurmd ("nodes" n1 and n2, both this machine) from a slurm.conf in a temporary folder, and stops every
daemon by the pid in its pid file afterwards."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slurm: brings up a real Slurm (slurmctld + 2 slurmd) on this machine and runs jobs/*.sbatch",
    )


JOBS = Path(__file__).resolve().parents[2] / "jobs"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = (
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "scancel",
    "sinfo",
    "squeue",
    "munged",
    "munge",
    "unmunge",
)
NODES = ("n1", "n2")
# States a job (or array task) ends in; PENDING, RUNNING, COMPLETING, REQUEUED... are on the way.
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
JOB_TIME_LIMIT_MIN = 4  # Slurm kills a job that runs longer (state TIMEOUT)
JOB_DEADLINE_S = 240.0  # the test cancels and fails a job still PENDING or RUNNING this long after sbatch
# Variables the scripts read: never inherited from the shell that runs pytest, only set by the test.
SCRIPT_VARS = (
    "PROMPTS",
    "OUT",
    "MODEL",
    "GPUS_PER_NODE",
    "OFFLOAD",
    "MAX_ACTIVE",
    "EXTRA_ARGS",
    "VENV",
    "PYTHON",
    "RDZV_PORT",
    "RDZV_HOST",
    "SHARD_COUNT",
)


# ---------------------------------------------------------------------------------------------- set-up


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def binary(name: str) -> str:
    path = _which(name)
    assert path is not None, f"{name} not found after installing {' '.join(PACKAGES)}"
    return path


def _install_slurm() -> None:
    if all(_which(name) for name in BINARIES):
        return
    # dpkg would start munged/slurmctld/slurmd with the packaged config; policy-rc.d exit 101 forbids it.
    policy = Path("/usr/sbin/policy-rc.d")
    saved = policy.read_bytes() if policy.exists() else None
    try:
        try:
            policy.write_text(
                "#!/bin/sh\n# cosmos3_batch tests: no daemon starts while packages install\nexit 101\n"
            )
            policy.chmod(0o755)
        except OSError:
            pass  # not root: apt-get below fails and says so
        proc = _apt("install", "-y", "--no-install-recommends", *PACKAGES)
        if proc.returncode != 0:  # stale or missing package lists
            _apt("update")
            proc = _apt("install", "-y", "--no-install-recommends", *PACKAGES)
        if proc.returncode != 0:
            pytest.skip(f"cannot install Slurm with apt-get (rc {proc.returncode}): {proc.stdout[-800:]}")
    finally:
        if saved is None:
            policy.unlink(missing_ok=True)
        else:
            policy.write_bytes(saved)
    missing = [name for name in BINARIES if not _which(name)]
    assert not missing, f"installed {PACKAGES} but {missing} are missing"


def _apt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        return subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=300", *args],  # another install (a test's) may hold it
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # the reason apt gives up is on stderr
            text=True,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(["apt-get", *args], 1, f"{type(exc).__name__}: {exc}", "")


def _munge_works() -> bool:
    cred = subprocess.run([binary("munge"), "-n"], capture_output=True, check=False)
    if cred.returncode != 0:
        return False
    check = subprocess.run([binary("unmunge")], input=cred.stdout, capture_output=True, check=False)
    return check.returncode == 0


def _start_munge(log: Path) -> Path | None:
    """The pid file of the munged this started, or None if one was already serving."""
    if _munge_works():
        return None
    # Without systemd nothing creates munged's socket folder; it must belong to the munge user.
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    with open(log, "ab") as sink:
        subprocess.run(
            ["runuser", "-u", "munge", "--", binary("munged")],
            stdout=sink,
            stderr=sink,
            check=True,
            timeout=30,
        )
    poll(_munge_works, 15.0, lambda: f"munged does not answer: {_tail(log)}")
    return run_dir / "munged.pid"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_conf(root: Path) -> Path:
    for node in NODES:
        (root / f"spool-{node}").mkdir()
    (root / "state").mkdir()
    ports = [free_port() for _ in range(1 + len(NODES))]
    nodes = "\n".join(
        f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=1000 "
        "State=UNKNOWN"
        for node, port in zip(NODES, ports[1:], strict=True)
    )
    conf = root / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=cosmos3test
SlurmctldHost=localhost
SlurmctldPort={ports[0]}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups in a container without systemd.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0
# Both "nodes" describe this one machine; do not compare them with its hardware.
SlurmdParameters=config_overrides
# Reject an impossible request at sbatch instead of leaving it PENDING forever.
EnforcePartLimits=ALL
ReturnToService=2
MailProg=/bin/true
# Finished jobs stay visible to scontrol for the whole test module.
MinJobAge=900
KillWait=5
InactiveLimit=0
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=10 State=UP
"""
    )
    return conf


def poll(ready: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    end = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > end:
            pytest.fail(why())
        time.sleep(0.2)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return f"\n--- {path} ---\n" + path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"\n--- {path}: {exc} ---"


def _stop(pid_files: list[Path], timeout_s: float = 15.0) -> None:
    """Stops the daemons whose pids are in pid_files, together: SIGTERM, then SIGKILL if one lingers."""
    pids = []
    for pid_file in pid_files:
        try:
            pids.append(int(pid_file.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue  # never started
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for pid in pids if _signal(pid, sig)]
        end = time.monotonic() + timeout_s
        while pids and time.monotonic() < end:
            time.sleep(0.1)
            pids = [pid for pid in pids if _signal(pid, 0)]
        if not pids:
            return


def _signal(pid: int, sig: int) -> bool:
    """False once the process is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- cluster


@dataclass
class Job:
    id: str
    out: Path
    workdir: Path
    tasks: int
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    jobs: list[str] = field(default_factory=list)

    def run(
        self, *cmd: str, env: dict[str, str] | None = None, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        env = self.env if env is None else env
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)

    def daemon_logs(self) -> str:
        return "".join(
            _tail(self.root / name, 2000) for name in ("slurmctld.log", "slurmd-n1.log", "slurmd-n2.log")
        )

    def start(self, *cmd: str) -> None:
        # Daemons keep inherited pipes open: send their start-up output to a file, never to a pipe.
        with open(self.root / "start.log", "ab") as sink:
            proc = subprocess.run(cmd, env=self.env, stdout=sink, stderr=sink, timeout=60, check=False)
        if proc.returncode != 0:
            logs = _tail(self.root / "start.log") + self.daemon_logs()
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}{logs}")

    def nodes_idle(self) -> bool:
        proc = self.run(binary("sinfo"), "-h", "-N", "-o", "%N %T")
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    def sbatch(self, script: str, *args: str, env: dict[str, str], out: Path, tasks: int = 1) -> Job:
        workdir = out.parent / f"{out.name}-wd"  # sbatch runs the script and writes its log here
        workdir.mkdir()
        proc = self.run(
            binary("sbatch"),
            "--parsable",
            f"--chdir={workdir}",
            f"--time={JOB_TIME_LIMIT_MIN}",
            *args,
            str(JOBS / script),
            env=env,  # sbatch hands its environment to the job: the scripts' variables travel this way
        )
        assert proc.returncode == 0, f"sbatch {script}: {proc.stderr}"
        job_id = proc.stdout.strip().split(";")[0]
        self.jobs.append(job_id)
        return Job(job_id, out, workdir, tasks)

    def records(self, job_id: str) -> list[dict[str, str]]:
        """One dict per job (per task, for an array) from `scontrol show job -o`."""
        proc = self.run(binary("scontrol"), "show", "job", "-o", job_id)
        assert proc.returncode == 0, f"scontrol show job {job_id}: {proc.stderr}"
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in proc.stdout.splitlines() if line.strip()]

    def wait(self, job: Job) -> list[dict[str, str]]:
        """Polls until every task of the job is in a final state; cancels and fails past JOB_DEADLINE_S."""
        while True:
            records = self.records(job.id)
            # A pending array shows as one record for its not yet started tasks ("1-2", "1,2", "1-2%1").
            tasks = [r for r in records if not re.search(r"[-,%]", r.get("ArrayTaskId", ""))]
            if len(tasks) == job.tasks and all(r["JobState"] in FINAL_STATES for r in tasks):
                return tasks
            if time.monotonic() - job.submitted_at > JOB_DEADLINE_S:
                self.run(binary("scancel"), job.id)
                states = [(r.get("ArrayTaskId"), r.get("JobState"), r.get("Reason")) for r in records]
                pytest.fail(f"job {job.id} not done after {JOB_DEADLINE_S:.0f} s: {states}{job_logs(job)}")
            time.sleep(0.5)

    def cancel_all(self) -> None:
        if not self.jobs:
            return
        self.run(binary("scancel"), *self.jobs)
        end = time.monotonic() + 30
        while time.monotonic() < end and self.run(binary("squeue"), "-h").stdout.strip():
            time.sleep(0.5)


def job_logs(job: Job) -> str:
    return (
        "".join(_tail(path, 6000) for path in sorted(job.workdir.glob("*.out")))
        or f"\n(no log in {job.workdir})"
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    _install_slurm()
    # Short path: slurmd puts one unix socket per job step in its spool folder (108-byte limit).
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in SCRIPT_VARS}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    cluster = Cluster(root, env)
    slurm_pids = [root / f"slurmd-{node}.pid" for node in NODES] + [root / "slurmctld.pid"]
    munge_pid = None
    failed = True
    try:
        munge_pid = _start_munge(root / "munged-start.log")
        conf = _write_conf(root)
        cluster.start(binary("slurmctld"), "-f", str(conf))
        for node in NODES:
            cluster.start(binary("slurmd"), "-f", str(conf), "-N", node)
        poll(
            cluster.nodes_idle,
            30.0,
            lambda: f"nodes not idle: {cluster.run('sinfo').stdout}{cluster.daemon_logs()}",
        )
        yield cluster
        failed = False
    finally:
        cluster.cancel_all()
        _stop(slurm_pids)
        if munge_pid is not None:  # last: the Slurm daemons authenticate with it until they exit
            _stop([munge_pid])
        if failed:
            print(cluster.daemon_logs())
        shutil.rmtree(root, ignore_errors=True)
