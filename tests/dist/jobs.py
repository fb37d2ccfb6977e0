"""Several `cosmos3_batch run` jobs, one after another, in the ranks of one real `torchrun` launch.

A rank spends about 4 s of CPU importing torch, diffusers and transformers before its job starts
(docs/testing.md), and the tiny jobs of the grids take a few seconds each: on a 2-core machine the start-up,
not the job, was most of the suite. So the grids' jobs run one after another in the ranks of a launch.

Each job gets a process group of its own, as a fresh launch would: rank 0 picks a free port for it and
posts it in torchrun's store; every rank then initialises from `MASTER_PORT` = that port with rank 0
hosting the job's store (`TORCHELASTIC_USE_AGENT_STORE=False`), so no key of an earlier job is seen by a
later one. What users never do (two jobs in one process) is kept honest by the grids themselves: every job
asserts its own counts (passes, collectives, bytes), which would carry over if any state leaked.

    python -m torch.distributed.run --nproc-per-node N -m tests.dist.jobs JOBS.json CODES.json

JOBS.json holds a list of argument lists for `cosmos3_batch` (e.g. ["run", "p.jsonl", "--out", ...]);
rank 0 writes the exit code of each job, in order, to CODES.json. A list that starts with
CAPTURE_FRAMES, DIR also saves each written request's decoded frames (float, before they become bytes)
as DIR/<id>.npy, from the rank that writes it.

The grids of every module share their launches: `torchrun_jobs` keeps one launch per world size for the
pytest process (an xdist worker) and hands it each grid in turn, where a launch per grid paid the start-up
again for its 1-4 ranks and their agent (one run of the suite: 16 launches of 38 ranks in all before, 21 ranks
with both workers' shared launches):

    python -m torch.distributed.run --nproc-per-node N -m tests.dist.jobs --serve PORT

Its ranks wait on the pytest process's store (PORT) for order k, run its jobs as above with their standard
streams sent to the order's folder, and each says it is done; the order "end" ends them. Kill, stall and
launcher tests start launches of their own (a launch they break cannot be shared).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# The interpreter jobs run on: .venv's (scripts/env.sh exports it), the install users have, without the
# dev extras the test process holds (whose scipy alone costs each job process about 1 CPU-s of imports);
# the test process's own where it is not set (pytest started by hand in a single virtualenv).
JOB_PYTHON = os.environ.get("COSMOS3_BATCH_JOB_PYTHON") or sys.executable
CAPTURE_FRAMES = "--test-capture-frames"  # not a flag of ours: _run_one strips it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_one(args: list[str]) -> int:
    from cosmos3_batch.cli import app

    capture = None
    if args[:1] == [CAPTURE_FRAMES]:
        capture, args = Path(args[1]), args[2:]
    try:
        with _frames_saved(capture):
            app(args, prog_name="cosmos3_batch")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        # A first job that ended before its load (bad input) resumed nothing: the next jobs of this
        # long-lived rank collect as usual all the same (a no-op once resumed).
        from cosmos3_batch.startup import imports_done

        imports_done()
    return 0


@contextlib.contextmanager
def _frames_saved(folder: Path | None):
    """While a job runs: every result the writer is handed also goes to folder/<id>.npy (its float frames)."""
    if folder is None:
        yield
        return
    import numpy as np

    from cosmos3_batch.pipeline.finish.results import ResultWriter

    write = ResultWriter.__call__

    def saving(self, job, result, error):
        if result is not None:
            folder.mkdir(parents=True, exist_ok=True)
            np.save(folder / f"{job.request.id}.npy", result.frames)
        return write(self, job, result, error)

    ResultWriter.__call__ = saving
    try:
        yield
    finally:
        ResultWriter.__call__ = write


def _run_jobs(jobs: list[list[str]], rank: int, store, key: str) -> list[int]:
    """Each job on a process group of its own: rank 0 posts a free port for it in `store` under key/n."""
    codes = []
    for number, args in enumerate(jobs):
        if rank == 0:
            store.set(f"{key}/{number}", str(free_port()))
        os.environ["MASTER_PORT"] = store.get(f"{key}/{number}").decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        codes.append(_run_one([str(a) for a in args]))
    return codes


def main(jobs_path: Path, codes_path: Path) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    launcher = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    codes = _run_jobs(json.loads(jobs_path.read_text()), rank, launcher, "tests.dist.jobs")
    if rank == 0:
        codes_path.write_text(json.dumps(codes))
    _leave()


def _leave() -> None:
    # Leave as a real worker does (cli.main -> leave_now: os._exit, no interpreter finalization). A process
    # that ran several jobs can still hold a gloo process group of an earlier one when it finalizes; gloo's
    # threads then release tensors after the interpreter is gone: "terminate called without an active
    # exception", SIGABRT, after every job had passed (seen here in the world-2 and world-3 grids).
    from cosmos3_batch.parallel.exit_codes import leave_now

    leave_now(0)


# How long a shared launch's ranks wait for their next order: the pytest process may run unit tests for
# many minutes between two grids.
_IDLE = timedelta(hours=3)


def serve(port: int) -> None:
    """A shared launch's rank: run order 0, 1, ... from the pytest process's store until the order "end"."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    orders = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_IDLE)
    for k in itertools.count():
        text = orders.get(f"order/{k}").decode()
        if text == "end":
            break
        order = json.loads(text)
        with _streams(Path(order["folder"]), order["stdin"]):
            codes = _run_jobs(order["jobs"], rank, orders, f"order/{k}/port")
        if rank == 0:
            Path(order["codes"]).write_text(json.dumps(codes))
        orders.set(f"order/{k}/done/{rank}", "")
    _leave()


@contextlib.contextmanager
def _streams(folder: Path, stdin: str | None):
    """For one order: this rank's stdout and stderr appended to the folder's stdout.txt and stderr.txt (every
    rank's, as one launch's were; file descriptors, so C++ and faulthandler lines go there too), its stdin
    the order's file (the launcher's standard input, empty without one)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        target = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    given, sys.stdin = sys.stdin, open(stdin or os.devnull)  # noqa: SIM115 (closed below)
    try:
        yield
    finally:
        sys.stdin.close()
        sys.stdin = given
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


class SharedLaunch:
    """One torchrun launch of `nproc` ranks (`serve`) that runs the grids this pytest process hands it."""

    def __init__(self, nproc: int) -> None:
        import torch.distributed as dist

        self.nproc = nproc
        self.orders = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_IDLE)
        self.count = 0
        self.folder = Path(tempfile.mkdtemp(prefix=f"cosmos3-launch-{nproc}-"))
        cmd = [JOB_PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["-m", "tests.dist.jobs", "--serve", str(self.orders.port)]
        with open(self.folder / "launch.log", "wb") as log:  # the agent's lines, and a rank's outside orders
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=ENV, start_new_session=True
            )

    def run(
        self, jobs: list[list[str]], folder: Path, timeout: float, stdin: Path | None
    ) -> list[int] | None:
        """The codes of `jobs`, or None where the launch ended (or ran past `timeout`) before every rank was
        done: it is then stopped, and its log is appended to the folder's stderr.txt."""
        k, self.count = self.count, self.count + 1
        codes = folder / "codes.json"
        order = {"jobs": jobs, "folder": str(folder), "codes": str(codes), "stdin": stdin and str(stdin)}
        self.orders.set(f"order/{k}", json.dumps(order))
        done = [f"order/{k}/done/{rank}" for rank in range(self.nproc)]
        deadline = time.monotonic() + timeout
        while not self.orders.check(done):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(folder / "stderr.txt", "ab") as log:
                    log.write(b"\n[the shared launch ended or ran past its timeout; its log follows]\n")
                    log.write((self.folder / "launch.log").read_bytes())
                return None
            time.sleep(0.05)
        return json.loads(codes.read_text())

    def end(self) -> None:
        self.orders.set(f"order/{self.count}", "end")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


_LAUNCHES: dict[int, SharedLaunch] = {}


@atexit.register
def end_shared_launches() -> None:
    """Called at the end of the pytest session (tests/conftest.py) and at exit: each launch's ranks leave."""
    while _LAUNCHES:
        _LAUNCHES.popitem()[1].end()


def run_here(args: list) -> int:
    """One `cosmos3_batch` job in this (pytest) process, at the one thread torchrun gives each rank (CPU
    GEMMs reduce in a thread-count-dependent order): the single-process reference without a start-up."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_one([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)


def torchrun_jobs(
    nproc: int, jobs: list[list], folder: Path, timeout: float = 600, stdin: bytes | None = None
) -> list[int]:
    """Run `jobs` in this pytest process's shared launch of `nproc` ranks (`stdin`: the launcher's standard
    input); their exit codes. Asserts the launch ran them all (whatever their codes), with its log if not:
    folder/stderr.txt holds every rank's standard error while they ran."""
    folder.mkdir(parents=True, exist_ok=True)
    given = None
    if stdin is not None:
        given = folder / "stdin"
        given.write_bytes(stdin)
    if nproc not in _LAUNCHES:
        _LAUNCHES[nproc] = SharedLaunch(nproc)
    codes = _LAUNCHES[nproc].run([[str(a) for a in args] for args in jobs], folder, timeout, given)
    if codes is None:
        del _LAUNCHES[nproc]  # the next grid of this size starts a new launch
    log = (folder / "stderr.txt").read_text(errors="replace") if (folder / "stderr.txt").exists() else ""
    # A rank killed by a signal ends its log with faulthandler's list of ~100 extension modules: drop that
    # line so the message keeps the signal, the thread stacks and the launcher's verdict.
    shown = "\n".join(line for line in log.splitlines() if not line.startswith("Extension modules:"))
    assert codes is not None, f"{shown[-6000:]}\n(whole log: {folder}/stderr.txt)"
    return codes


if __name__ == "__main__":
    # As `python -m cosmos3_batch` does: the collector paused until the first job's imports are done.
    from cosmos3_batch.startup import pause_collection

    pause_collection()
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))
