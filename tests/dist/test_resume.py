"""Preemption: SIGKILL a 2-rank torchrun job mid-run, rerun the same command, lose and repeat nothing."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import write_jsonl
from tests.dist.jobs import ENV, run_here

pytestmark = pytest.mark.dist
ROWS = [
    {
        "id": f"k{i}",
        "prompt": f"prompt {i}",
        "num_frames": 1,
        "size": "32x32",
        "num_inference_steps": 12,
        "seed": i,
    }
    for i in range(10)
]


def launch(prompts, tiny_ckpt, out) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(tiny_ckpt), "--out", str(out)]
    cmd += ["--save-latents", "--max-active", "1", "--no-progress"]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (torchrun puts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def preempt(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and all its workers at once, as a preempted Slurm node would."""
    for pid in [job.pid, *descendants(job.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait()


def ok_rows(out) -> Counter:
    counts: Counter = Counter()
    for part in (out / ".cosmos3_batch").glob("metrics.rank*.csv"):
        with open(part, newline="") as f:
            counts.update(row["id"] for row in csv.DictReader(f) if row["status"] == "ok")
    return counts


def test_sigkill_then_rerun_finishes_the_rest_exactly_once(tmp_path, tiny_ckpt):
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ref = tmp_path / "ref"
    code = run_here(["run", prompts, "--model", tiny_ckpt, "--out", ref, "--save-latents", "--no-progress"])
    assert code == 0

    out = tmp_path / "out"
    job = launch(prompts, tiny_ckpt, out)
    deadline = time.monotonic() + 180
    while len(list(out.glob("k*.json"))) < 3 and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    preempt(job)
    done_before = {p.stem for p in out.glob("k*.json")}
    assert 3 <= len(done_before) < len(ROWS), f"kill landed outside the run: {sorted(done_before)}"

    again = launch(prompts, tiny_ckpt, out)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr.decode()[-3000:]
    assert (
        f"{len(ROWS) - len(done_before)} generated, 0 failed, {len(done_before)} already complete"
        in stdout.decode()
    )
    for row in ROWS:
        rid = row["id"]
        assert torch.equal(
            load_file(out / f"{rid}.latents.safetensors")["latents"],
            load_file(ref / f"{rid}.latents.safetensors")["latents"],
        ), rid
        assert (out / f"{rid}.png").read_bytes() == (ref / f"{rid}.png").read_bytes(), rid
    counts = ok_rows(out)
    # Each request generated once over both runs (a kill between a sidecar and its metrics row could
    # drop a row, never add one).
    assert max(counts.values()) == 1 and sum(counts.values()) >= len(ROWS) - 1
    assert not list(out.glob(".*.tmp*")), "stale temporaries survived the rerun"
