"""`run --metrics-textfile` for real: 2 gloo ranks under `cosmos3-torchrun`, the file parsed back with
prometheus_client's own parser while the job runs and after it ended; its counts are those of summary.json
and of `status OUT --json`, its `runs` too (one request fails: a directory is in the way of its PNG)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import write_jsonl
from tests.dist.jobs import ENV, JOB_PYTHON

pytestmark = pytest.mark.dist
# Two short requests are written within a few passes of the start, while the others run 40 steps, and the
# file is written every 0.1 s: the 120 passes last about 1.5 s here, and at the 1 s interval a loaded CPU
# once let the whole running phase fall between two writes.
ROWS = [
    {"id": f"m{i}", "prompt": "a lighthouse", "num_frames": 1, "size": "32x32"}
    | {"num_inference_steps": 3 if i in (0, 1) else 40}
    for i in range(12)
]


def families(path: Path) -> dict[str, tuple[str, list]]:
    """name -> (type, samples) as prometheus_client parses the file."""
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(path.read_text())}


def value(found: dict, name: str, **labels: str) -> float:
    """The one sample called `name` (a counter's family drops its _total) with these labels."""
    samples = [
        s
        for _, family in found.values()
        for s in family
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(samples) == 1, (name, labels, found[name])
    return samples[0].value


def test_the_metrics_textfile_has_the_jobs_counts_while_it_runs_and_at_its_end(tmp_path, tiny_ckpt):
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out, textfile = tmp_path / "out", tmp_path / "metrics" / "cosmos3.prom"
    textfile.parent.mkdir()
    (out / "m3.png").mkdir(parents=True)  # its write fails: one failed request
    cmd = [JOB_PYTHON, "-m", "cosmos3_batch.parallel.launch", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(tiny_ckpt), "--out", str(out)]
    cmd += ["--no-progress", "--max-active", "2", "--metrics-textfile", str(textfile)]
    cmd += ["--metrics-interval-s", "0.1"]  # the passes of this tiny job take about 1.5 s in all
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mid, deadline = None, time.monotonic() + 240
    while proc.poll() is None and mid is None:
        assert time.monotonic() < deadline
        if textfile.exists():
            found = families(textfile)
            done = value(found, "cosmos3_batch_requests", state="done")
            if value(found, "cosmos3_batch_running") == 1 and 1 <= done < len(ROWS) - 2:
                mid = found
        time.sleep(0.2)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, output[-3000:]  # one request failed
    assert mid is not None, "no write while the job ran"
    states = {s.labels["state"]: s.value for s in mid["cosmos3_batch_requests"][1]}
    assert sum(states.values()) <= len(ROWS) and states["skipped"] == 0 and states["interrupted"] == 0, states
    assert mid["cosmos3_batch_passes"][0] == "counter" and value(mid, "cosmos3_batch_passes_total") > 0
    assert {s.labels["rank"] for s in mid["cosmos3_batch_rank_seconds_since_progress"][1]} == {"0", "1"}
    assert value(mid, "cosmos3_batch_job_start_time_seconds") <= time.time()

    end = families(textfile)
    summary = json.loads((out / "summary.json").read_text())
    ranks = summary["ranks"]
    expected = {"done": len(ROWS) - 1, "failed": 1, "interrupted": 0, "pending": 0, "skipped": 0}
    assert {s.labels["state"]: s.value for s in end["cosmos3_batch_requests"][1]} == expected
    assert value(end, "cosmos3_batch_running") == 0
    assert value(end, "cosmos3_batch_passes_total") == ranks[0]["passes"]
    assert value(end, "cosmos3_batch_und_passes_total") == ranks[0]["und_passes"]
    # Carried pass by pass in the per-pass exchange: every pass's bytes of every rank, exactly once.
    moved = sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks)
    assert value(end, "cosmos3_batch_weight_bytes_total") == moved > 0
    assert value(end, "cosmos3_batch_stall_seconds_total") == pytest.approx(
        sum(r["stall_s"] for r in ranks), abs=1e-3
    )
    labels = end["cosmos3_batch_running"][1][0].labels
    assert labels["job"] and labels["array_task"] == "", labels  # torchrun's run id (no Slurm here)
    status = subprocess.run(
        [JOB_PYTHON, "-m", "cosmos3_batch", "status", str(out), "--input", str(prompts), "--json"],
        env=ENV, capture_output=True, text=True,
    )  # fmt: skip
    report = json.loads(status.stdout)
    assert {k: report[k] for k in ("done", "failed", "interrupted", "pending")} == {
        k: expected[k] for k in ("done", "failed", "interrupted", "pending")
    }
    run = report["runs"]["summary.json"]  # the job's counters, from its summary: what the file ended with
    assert (run["passes"], run["und_passes"], run["skipped"]) == (
        value(end, "cosmos3_batch_passes_total"),
        value(end, "cosmos3_batch_und_passes_total"),
        value(end, "cosmos3_batch_requests", state="skipped"),
    )
    assert run["weight_bytes"] == value(end, "cosmos3_batch_weight_bytes_total")
    assert run["stall_seconds"] == pytest.approx(value(end, "cosmos3_batch_stall_seconds_total"), abs=1e-3)
    print(textfile.read_text())
