"""Preemption: SIGKILL a 2-rank torchrun job writing WebDataset shards while a shard is open, rerun the same
command: no partial shard is readable, the open shard's samples are generated again, nothing else is, and
every sample equals the uninterrupted run's files bit for bit. (The files format's kills are in
test_stop.py's chain.)"""

from __future__ import annotations

import csv
import json
import subprocess
import tarfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

import pandas as pd
import pytest
import torch
import webdataset as wds
from safetensors.torch import load, load_file

from cosmos3_batch.io.shard_index import finish_renames, read_indexes
from tests.conftest import write_jsonl
from tests.dist.jobs import ENV, JOB_PYTHON, run_here
from tests.dist.preempt import kill_if, preempt

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
    cmd = [JOB_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(tiny_ckpt), "--out", str(out)]
    cmd += [
        "--save-latents",
        "--max-active",
        "1",
        "--no-progress",
        "--format",
        "webdataset",
        "--shard-size",
        "3",  # a rank's 5 samples: a shard of 3 finalized, then one open for 2 (the kill's window)
    ]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ok_rows(out) -> Counter:
    counts: Counter = Counter()
    for part in (out / ".cosmos3_batch").glob("metrics.rank*.csv"):
        with open(part, newline="") as f:
            counts.update(row["id"] for row in csv.DictReader(f) if row["status"] == "ok")
    return counts


def mid_shard(out: Path) -> bool:
    """A rank has finalized its first shard and written a sample into its second (unbuffered: on disk).

    Per rank: a first shard still under its temporary name beside another rank's final one is being
    finalized, not open (a kill there leaves an index the rerun completes the rename from)."""
    for final in out.glob("shards/*/rank*-000001.tar"):
        rank = final.name.split("-")[0]
        if any(p.stat().st_size > 0 for p in final.parent.glob(f".{rank}-000002.*.tar.tmp")):
            return True
    return False


def test_sigkill_mid_shard_then_rerun_finishes_the_rest_exactly_once(tmp_path, tiny_ckpt):
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ref = tmp_path / "ref"
    code = run_here(["run", prompts, "--model", tiny_ckpt, "--out", ref, "--save-latents", "--no-progress"])
    assert code == 0

    # The job is frozen (SIGSTOP) before the last look, so the kill lands on exactly what was seen. Up to
    # three jobs, each kill's folder set aside: a look may catch a finalize between its index and its rename
    # (the rerun completes it: no shard is left open), or a loaded machine may miss every window.
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        job = launch(prompts, tiny_ckpt, out)
        killed = False
        deadline = time.monotonic() + 180
        while not killed and job.poll() is None and time.monotonic() < deadline:
            killed = kill_if(job, partial(mid_shard, out))
            time.sleep(0.02)
        if not killed:
            preempt(job)
            continue
        # As the rerun does first: a shard whose index was written but whose rename was cut short counts.
        finish_renames(out, "")
        if list(out.glob("shards/*/.*.tar.tmp")):
            break
    else:
        pytest.fail("no kill of three landed with a shard open")
    kept = {s["id"] for index in read_indexes(out) for s in index["samples"]}
    assert 2 <= len(kept) < len(ROWS), f"kill landed outside the run: {sorted(kept)}"
    for shard in out.glob("shards/*/*.tar"):  # what a loader's glob finds: whole shards only
        with tarfile.open(shard) as tar:
            assert len(tar.getnames()) == 4 * sum(
                len(i["samples"]) for i in read_indexes(out) if out / i["shard"] == shard
            ), shard

    again = launch(prompts, tiny_ckpt, out)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr.decode()[-3000:]
    assert f"{len(ROWS) - len(kept)} generated, 0 failed, {len(kept)} already complete" in stdout.decode()
    samples = {}
    for sample in wds.WebDataset(sorted(map(str, out.glob("shards/*/*.tar"))), shardshuffle=False):
        rid = json.loads(sample["json"])["id"]
        assert rid not in samples, f"{rid} twice"
        samples[rid] = sample
    assert sorted(samples) == sorted(row["id"] for row in ROWS)
    for rid, sample in samples.items():
        expected = load_file(ref / f"{rid}.latents.safetensors")["latents"]
        assert torch.equal(load(sample["latents.safetensors"])["latents"], expected), rid
        assert sample["png"] == (ref / f"{rid}.png").read_bytes(), rid
    counts = ok_rows(out)
    # Each request's row once over both runs: a discarded shard's samples never had one (rows follow a
    # shard's finalization; a kill between the two loses a row, recovered from the index, never adds one).
    assert max(counts.values()) == 1 and sum(counts.values()) >= len(ROWS) - 2
    assert not list(out.glob("shards/*/.*")), "stale temporaries survived the rerun"
    manifest = pd.read_parquet(out / "manifest.parquet")  # both ranks' samples, where they are
    assert sorted(manifest["id"]) == sorted(samples) and set(manifest["status"]) == {"ok"}
    assert set(manifest["rank"]) == {0, 1} and all(m.startswith("k") for m in manifest["member"])
