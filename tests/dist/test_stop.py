"""SIGINT / SIGTERM mid-run: every rank stops at the same pass, finished work is written with metrics and
summary, the exit code is the shell's (130 / 143), and the rerun generates exactly the rest, bit-exact.

One chain: the same job is stopped seven ways in turn (one process or two ranks, SIGINT to the process or
to its group, SIGTERM, an --sp group), each run resuming where the last stopped, then rerun to the end;
every stop is checked as it happens and the end against an uninterrupted run. Seven stops with a rerun
each would start seven more jobs for the same assertions."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import assert_same_outputs, write_jsonl
from tests.dist.jobs import ENV, run_here

pytestmark = pytest.mark.dist
# Enough work that each of the seven stops lands two outputs into a run with more to do: 36 requests x 30
# steps (a stop finishes what is decoding: two to four outputs per run).
ROWS = [
    {"id": f"s{i}", "prompt": "a lighthouse", "num_frames": 1 if i % 3 else 5, "size": "32x32"}
    | {"num_inference_steps": 30, "guidance_scale": 1.0 if i % 2 else 4.0}
    for i in range(36)
]
IDS = [row["id"] for row in ROWS]


def command(nproc: int, prompts: Path, model: Path, out: Path, sp: int = 1) -> list[str]:
    run = ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
    run += ["--save-latents", "--no-progress", "--max-active", "2", "--sp", str(sp)]
    if nproc == 1:
        return [sys.executable, *run]
    launcher = [
        sys.executable,
        "-m",
        "cosmos3_batch.parallel.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    return launcher + run


def outputs_done(out: Path) -> int:
    return sum(1 for rid in IDS if (out / f"{rid}.json").exists())


def stop_midway(cmd: list[str], out: Path, sig: int, whole_group: bool) -> tuple[int, float, str]:
    """Start the job in its own session, signal it once two more outputs exist; (exit code, seconds,
    output)."""
    before = outputs_done(out)
    proc = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while outputs_done(out) < before + 2:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no output within 240 s"
        time.sleep(0.05)
    sent = time.monotonic()
    if whole_group:  # as a terminal's Ctrl-C does: every process of the foreground group
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    err, _ = proc.communicate(timeout=120)
    return proc.returncode, time.monotonic() - sent, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_ckpt) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("stop")
    prompts = write_jsonl(folder / "p.jsonl", ROWS)
    ref = folder / "ref"
    assert run_here(command(1, prompts, tiny_ckpt, ref)[3:]) == 0  # `run ...` in this process
    return prompts, ref


def ok_rows(out: Path) -> Counter:
    counts: Counter = Counter()
    for part in (out / ".cosmos3_batch").glob("metrics.*rank*.csv"):
        with open(part, newline="") as f:
            counts.update(row["id"] for row in csv.DictReader(f) if row["status"] == "ok")
    return counts


# (ranks, signal, to the whole process group, --sp), in the chain's order.
STOPS = [
    pytest.param(1, signal.SIGINT, False, 1, id="single-sigint-process"),
    pytest.param(2, signal.SIGINT, False, 1, id="torchrun2-sigint-launcher"),
    pytest.param(1, signal.SIGINT, True, 1, id="single-sigint-group"),
    pytest.param(2, signal.SIGINT, True, 1, id="torchrun2-sigint-group"),
    pytest.param(1, signal.SIGTERM, False, 1, id="single-sigterm"),
    pytest.param(2, signal.SIGTERM, False, 1, id="torchrun2-sigterm"),
    pytest.param(2, signal.SIGINT, True, 2, id="torchrun2-sp2-sigint-group"),  # one --sp group
]


def check_stopped(out: Path, nproc: int, sig: int, code: int, seconds: float, err: str, before: int) -> dict:
    """One stop as it happened; the run's summary."""
    assert code == 128 + sig, err[-3000:]
    assert seconds < 15, seconds
    assert "Traceback" not in err, err[-3000:]
    name = signal.Signals(sig).name
    assert f"stopped by {name}" in err
    summary = json.loads((out / "summary.json").read_text())
    done = summary["generated_ok"]
    assert summary["skipped_complete"] == before
    assert 2 <= done < len(IDS) - before, summary
    stopped = summary["interrupted"]
    assert stopped["signal"] == name
    assert summary["failed"] == [], summary["failed"]
    assert done + len(stopped["abandoned"]) + stopped["not_started"] == len(IDS) - before, summary
    if nproc > 1:  # every rank left the loop at the same pass
        assert len({(r["passes"], r["all_reduces"]) for r in summary["ranks"]}) == 1, summary["ranks"]
    return summary


def test_signals_stop_cleanly_and_each_rerun_does_the_rest(reference, tiny_ckpt, tmp_path):
    prompts, ref = reference
    out = tmp_path / "out"
    abandoned: set[str] = set()
    for stop in STOPS:
        nproc, sig, whole_group, sp = stop.values
        before = outputs_done(out)
        code, seconds, err = stop_midway(command(nproc, prompts, tiny_ckpt, out, sp), out, sig, whole_group)
        summary = check_stopped(out, nproc, sig, code, seconds, err, before)
        assert outputs_done(out) == before + summary["generated_ok"], stop.id
        # metrics.csv holds each request's latest row: ok for every output so far, interrupted for those
        # abandoned in this run or an earlier one and not generated since.
        abandoned |= set(summary["interrupted"]["abandoned"])
        with open(out / "metrics.csv", newline="") as f:
            rows = {row["id"]: row["status"] for row in csv.DictReader(f)}
        complete = {rid for rid in IDS if (out / f"{rid}.json").exists()}
        assert {rid for rid, status in rows.items() if status == "ok"} == complete, stop.id
        interrupted = {rid for rid, status in rows.items() if status == "interrupted"}
        assert interrupted == abandoned - complete, stop.id

    before = outputs_done(out)
    rerun = subprocess.run(command(2, prompts, tiny_ckpt, out, 2), env=ENV, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == len(IDS) - before
    assert summary["skipped_complete"] == before
    assert_same_outputs(ref, out, IDS)
    assert ok_rows(out) == Counter(IDS)  # nothing generated twice over eight runs
