"""`cosmos3-torchrun`'s end: torchrun's failures become the workers' agreed code and one line; the root cause
of a failed job (a rank killed by the kernel, a crash) wins over what the agent did to the other ranks."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from cosmos3_batch.parallel.exit_codes import after_rank_0
from cosmos3_batch.parallel.launch import oom_kills, outcome
from cosmos3_batch.parallel.stop import JobFault, StopRequest
from cosmos3_batch.pipeline.job.ending import first_stop


def failure(tmp_path, rank: int, exitcode: int, crash: str | None = None) -> ProcessFailure:
    error_file = str(tmp_path / f"error-{rank}.json")
    if crash is not None:  # what torchelastic's `record` writes for an uncaught exception
        info = {"py_callstack": "...", "timestamp": str(int(time.time()))}
        body = {"message": {"message": crash, "extraInfo": info}}
        (tmp_path / f"error-{rank}.json").write_text(json.dumps(body))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=error_file)


@pytest.mark.parametrize(
    ("codes", "crash", "expected", "text"),
    [
        ({0: 2, 1: 2}, None, 2, "the job exited with 2 (ranks 0, 1): bad input"),
        ({0: 75, 1: -15}, None, 75, "the job exited with 75 (ranks 0): the output filesystem is full"),
        ({0: 1, 1: 1}, None, 1, "the job exited with 1 (ranks 0, 1): some requests failed"),
        ({0: 143, 1: 143}, None, 143, "stopped by SIGTERM; finished outputs"),
        ({0: 130, 1: -15}, None, 130, "stopped by SIGINT; finished outputs"),
        (
            {0: 1, 1: -9},
            "RuntimeError: Connection closed by peer",
            137,
            "rank 1 was killed by SIGKILL; rerun",  # no guess at the cause: the cgroup saw no OOM kill
        ),
        ({0: 69, 1: -9}, None, 137, "rank 1 was killed by SIGKILL; rerun"),  # it died first, rank 0 saw it
        (
            {0: 1, 1: -15},
            "ValueError: boom\nmore",
            1,
            "rank 0 crashed: ValueError: boom (its traceback is above)",
        ),
        ({0: -15, 1: -15}, None, 143, "rank 0 was stopped by SIGTERM"),
        ({1: -signal.SIGBUS}, None, 128 + signal.SIGBUS, "rank 1 was killed by SIGBUS;"),
    ],
)
def test_the_launcher_passes_the_workers_code_through_with_one_line(tmp_path, codes, crash, expected, text):
    failures = {
        rank: failure(tmp_path, rank, code, crash if code == 1 and crash and rank == 0 else None)
        for rank, code in codes.items()
    }
    code, line = outcome(failures)
    assert code == expected and text in line and "\n" not in line, line


def test_a_stall_is_69_and_names_the_rank_the_agent_had_to_sigkill_afterwards(tmp_path):
    """Rank 0 exited 69 (rank 1 stalled); the agent SIGTERMed rank 1, which could not answer, and SIGKILLed it
    30 s later: that SIGKILL is captured later than the 69 and is not the cause."""
    failures = {0: failure(tmp_path, 0, 69), 1: failure(tmp_path, 1, -signal.SIGKILL)}
    failures[1].timestamp = failures[0].timestamp + 30
    code, line = outcome(failures)
    assert code == 69, line
    assert line == (
        "the job exited with 69 (ranks 0): rank(s) 1 stalled (still running after SIGTERM, so the launcher "
        "SIGKILLed them): requeue the job, a rerun generates exactly the rest"
    )
    failures[2] = failure(tmp_path, 2, 69)  # another survivor; the stalled rank is on another node
    del failures[1]
    code, line = outcome(failures)
    assert code == 69 and line.startswith("the job exited with 69 (ranks 0, 2): a peer rank stalled or died")


def test_out_of_memory_is_said_only_when_the_cgroup_counted_an_oom_kill(tmp_path):
    failures = {0: failure(tmp_path, 0, -15), 1: failure(tmp_path, 1, -signal.SIGKILL)}
    assert "OOM" not in outcome(failures)[1]
    code, line = outcome(failures, oom_killed=True)
    assert code == 137 and "rank 1 was killed by SIGKILL (the kernel's OOM killer ran in this job" in line


def test_oom_kills_reads_the_count_of_this_process_cgroup(tmp_path):
    own = Path("/proc/self/cgroup").read_text().splitlines()
    for line in own:  # the same paths under a fake root, v1 and v2 alike, each saying 3
        _, controllers, path = line.split(":", 2)
        if controllers in ("memory", ""):
            folder = tmp_path / ("memory" if controllers else "") / path.lstrip("/")
            folder.mkdir(parents=True, exist_ok=True)
            name = "memory.oom_control" if controllers else "memory.events"
            (folder / name).write_text("oom_kill_disable 0\nunder_oom 0\noom 4\noom_kill 3\n")
    assert oom_kills(tmp_path) == 3
    assert oom_kills(tmp_path / "absent") is None


def test_ranks_report_the_worst_stop_any_of_them_saw():
    disk = JobFault(75, "disk", "ENOSPC writing x")
    changed = JobFault(1, "checkpoint", "checkpoint file y changed")
    stop = StopRequest(quiet=True)
    stop.fail(disk)
    stop.fail(JobFault(75, "disk", "a later disk error"))  # the first of a kind is kept
    assert stop.record()["message"] == "ENOSPC writing x"
    stop.fail(changed)  # a worse kind replaces it
    assert stop.record() == {"kind": "checkpoint", "code": 1, "message": "checkpoint file y changed"}
    signalled = {"kind": "signal", "code": 143, "message": "SIGTERM"}
    reports = [signalled, {"kind": "disk", "code": 75, "message": "m"}, None]
    assert first_stop([r for r in reports if r]) == {"kind": "disk", "code": 75, "message": "m"}
    assert first_stop([signalled]) == signalled and first_stop([]) is None


def test_a_configuration_error_is_said_by_rank_0_at_once_by_another_rank_only_after_the_grace(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert after_rank_0("--model x: no model_index.json", grace_s=60) == "--model x: no model_index.json"
    monkeypatch.setenv("RANK", "1")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        started = time.monotonic()
        assert after_rank_0("no CUDA device", grace_s=0.3) == "rank 1: no CUDA device"
        assert time.monotonic() - started >= 0.3
        assert signal.getsignal(signal.SIGTERM) is not handlers[signal.SIGTERM]  # SIGTERM now exits 2 quietly
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
