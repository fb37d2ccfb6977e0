"""Several `cosmos3_batch run` jobs, one after another, in the ranks of one real `torchrun` launch.

A rank spends ~12 s of CPU importing torch, diffusers and transformers before its job starts, and the tiny
jobs of the grids take a few seconds each: on a 2-core machine the start-up, not the job, was most of the
suite. So a grid launches torchrun once per world size and runs every configuration of that world in it.

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
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
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


def main(jobs_path: Path, codes_path: Path) -> None:
    import torch.distributed as dist

    jobs = json.loads(jobs_path.read_text())
    rank = int(os.environ["RANK"])
    launcher = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    codes = []
    for number, args in enumerate(jobs):
        if rank == 0:
            launcher.set(f"tests.dist.jobs/{number}", str(free_port()))
        os.environ["MASTER_PORT"] = launcher.get(f"tests.dist.jobs/{number}").decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        codes.append(_run_one([str(a) for a in args]))
    if rank == 0:
        codes_path.write_text(json.dumps(codes))
    # Leave as a real worker does (cli.main -> leave_now: os._exit, no interpreter finalization). A process
    # that ran several jobs can still hold a gloo process group of an earlier one when it finalizes; gloo's
    # threads then release tensors after the interpreter is gone: "terminate called without an active
    # exception", SIGABRT, after every job had passed (seen here in the world-2 and world-3 grids).
    from cosmos3_batch.parallel.exit_codes import leave_now

    leave_now(0)


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
    """Run `jobs` in one launch of `nproc` ranks (`stdin`: the launcher's standard input); their exit codes.
    Asserts the launch itself succeeded (every job returned, whatever its code), with its stderr if not."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs_path, codes_path = folder / "jobs.json", folder / "codes.json"
    jobs_path.write_text(json.dumps([[str(a) for a in args] for args in jobs]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "tests.dist.jobs", str(jobs_path), str(codes_path)]
    proc = subprocess.run(cmd, capture_output=True, timeout=timeout, env=ENV, input=stdin or b"")
    proc.stderr = proc.stderr.decode(errors="replace")
    (folder / "stderr.txt").write_text(proc.stderr)  # each job's log, for a failing assertion to point at
    # A rank killed by a signal ends its log with faulthandler's list of ~100 extension modules: drop that
    # line so the message keeps the signal, the thread stacks and the launcher's verdict.
    shown = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("Extension modules:"))
    assert proc.returncode == 0 and codes_path.exists(), f"{shown[-6000:]}\n(whole log: {folder}/stderr.txt)"
    return json.loads(codes_path.read_text())


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
