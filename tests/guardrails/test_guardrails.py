"""Guardrails in a job against the reference's own: `Cosmos3OmniPipeline(..., enable_safety_checker=True)` on
the same tiny guardrails (tiny_guardrails.py): the same decisions, the same pixelated frames, bit for bit."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
from huggingface_hub import constants
from PIL import Image

from cosmos3_batch.config import make_config
from cosmos3_batch.io.outputs import to_uint8
from cosmos3_batch.io.status import dataset_status
from cosmos3_batch.io.status import describe as describe_status
from cosmos3_batch.model.tiny import MARKER
from cosmos3_batch.pipeline.finish import guardrail
from cosmos3_batch.pipeline.job.run import run_job
from cosmos3_batch.plan.schedule import assign
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.dist.jobs import JOB_PYTHON
from tests.guardrails.tiny_guardrails import BLOCKED_WORD, EXACT_WORD
from tests.reference import reference_kwargs

IMAGE = {"size": "32x32", "num_frames": 1, "num_inference_steps": 2}
VIDEO = {"size": "48x32", "num_frames": 5, "num_inference_steps": 2}


def run(prompts: Path, out: Path, model: Path, **flags):
    return run_job(make_config("allgather", None, prompts=str(prompts), out=out, model=model, progress=False,
                               **flags))  # fmt: skip


def reference(model: Path, r, **call):
    """The reference pipeline's frames for request `r` (output_type="np"), its safety checker on."""
    pipe = Cosmos3OmniPipeline.from_pretrained(model, enable_safety_checker=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = UniPCMultistepScheduler.from_config(dict(pipe.scheduler.config))
    generator = torch.Generator("cpu").manual_seed(r.seed)
    return pipe(**reference_kwargs(r), generator=generator, output_type="np", **call).video


def rows(path: Path) -> dict[str, dict]:
    with path.open(newline="") as f:
        return {row["id"]: row for row in csv.DictReader(f)}


def test_text_guardrail_blocks_before_generation_as_the_reference_does(tiny_ckpt, guard_cache, tmp_path):
    cases = [
        {"id": "fox", "prompt": "a red fox", "seed": 7},
        {"id": "fuzzy", "prompt": f"a {BLOCKED_WORD} fox"},
        {"id": "exact", "prompt": f"the {EXACT_WORD} runs"},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{**c, **IMAGE} for c in cases])
    out = tmp_path / "out"
    code, line, error = run(prompts, out, tiny_ckpt, guardrails=True)
    assert (code, error) == (0, None) and "2 blocked by the guardrails" in line
    requests = {r.id: r for r in load_requests(str(prompts))[0]}
    ours = np.asarray(Image.open(out / "fox.png"))
    assert np.array_equal(ours, to_uint8(reference(tiny_ckpt, requests["fox"])[0]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["guardrails"] is True and summary["generated_ok"] == 1
    assert json.loads((out / "fox.json").read_text())["guardrails"] is True
    metrics, manifest = rows(out / "metrics.csv"), pq.read_table(out / "manifest.parquet").to_pylist()
    manifest = {row["id"]: row for row in manifest}
    for rid, check in (("fuzzy", "censorship"), ("exact", "exact match")):
        with pytest.raises(ValueError, match="unsafe text in the prompt"):  # the reference refuses it too
            reference(tiny_ckpt, requests[rid])
        sidecar = json.loads((out / f"{rid}.json").read_text())
        reason = sidecar["blocked"]["reason"]
        assert (
            reason.startswith("BLOCKLIST: ") and check in reason and sidecar["blocked"]["stage"] == "prompt"
        )
        assert (sidecar["status"], sidecar["guardrails"]) == ("blocked", True)
        assert not (out / f"{rid}.png").exists()
        assert (metrics[rid]["status"], metrics[rid]["error"]) == ("blocked", reason)
        assert (manifest[rid]["status"], manifest[rid]["error"]) == ("blocked", reason)
    assert summary["blocked"] == [{"id": rid, "reason": manifest[rid]["error"]} for rid in ("exact", "fuzzy")]
    status = dataset_status(out)
    assert (status["done"], status["blocked"], status["all_done"], status["eta_hours"]) == (1, 2, True, 0.0)
    assert "1 done, 2 blocked, 0 failed" in describe_status(status)
    # Resume: the blocked requests are done, not retried.
    code, line, error = run(prompts, out, tiny_ckpt, guardrails=True)
    summary = json.loads((out / "summary.json").read_text())
    assert (code, summary["skipped_complete"], summary["generated_ok"], summary["blocked"]) == (0, 3, 0, [])


def test_video_frames_pixelated_as_the_reference_does(tiny_ckpt, guard_cache, tmp_path, monkeypatch):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "clip", "prompt": "a cat walks", "seed": 3, **VIDEO}])
    kept = {}
    monkeypatch.setattr(guardrail, "on_checked", lambda rid, frames: kept.setdefault(rid, frames.copy()))
    code, _, error = run(prompts, tmp_path / "out", tiny_ckpt, guardrails=True)
    assert (code, error) == (0, None) and (tmp_path / "out" / "clip.mp4").exists()
    (r,) = load_requests(str(prompts))[0]
    frames = kept["clip"]
    assert frames.dtype == np.uint8 and frames.shape == (5, 32, 48, 3)
    assert np.array_equal(frames, to_uint8(reference(tiny_ckpt, r)))
    unguarded = (reference(tiny_ckpt, r, enable_safety_check=False) * 255).astype(np.uint8)
    assert not np.array_equal(frames, unguarded)  # faces were found and pixelated


def test_guardrails_on_by_default_for_real_checkpoints_missing_models_exit_2(tiny_ckpt, guard_cache, tmp_path,
                                                                              monkeypatch):  # fmt: skip
    real = tmp_path / "real"
    shutil.copytree(tiny_ckpt, real)
    (real / MARKER).unlink()  # not a make-tiny folder: a real checkpoint's defaults
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "a red fox", **IMAGE}])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    code, _, error = run(prompts, tmp_path / "out", real)
    assert code == 2 and not (tmp_path / "out").exists()  # nothing loaded, nothing written
    missing = "nvidia/Cosmos-1.0-Guardrail, Qwen/Qwen3Guard-Gen-0.6B are not in the local Hugging Face cache"
    for fragment in (missing, "hf download nvidia/Cosmos-1.0-Guardrail", "--no-guardrails"):
        assert fragment in error
    code, _, error = run(prompts, tmp_path / "off", real, guardrails=False)
    assert (code, error) == (0, None)
    summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert summary["config"]["guardrails"] is False
    assert json.loads((tmp_path / "off" / "a.json").read_text())["guardrails"] is False


def test_two_ranks_one_all_blocked_keep_lockstep(tiny_ckpt, guard_cache, tmp_path):
    rows_ = [{"id": f"r{i}", "prompt": f"a red fox number {i}", "seed": i, **IMAGE} for i in range(4)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows_)
    rank1 = {r.id for r in assign(load_requests(str(prompts))[0], 2).queues[1]}
    assert rank1 and len(rank1) < 4
    for row in rows_:
        if row["id"] in rank1:
            row["prompt"] = f"a {BLOCKED_WORD} number {row['seed']}"
    write_jsonl(prompts, rows_)
    out = tmp_path / "out"
    cmd = [JOB_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "cosmos3_batch", "run", str(prompts), "--model", str(tiny_ckpt), "--out", str(out), "--guardrails",
           "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {b["id"] for b in summary["blocked"]} == rank1 and summary["generated_ok"] == 4 - len(rank1)
    ranks = summary["ranks"]
    assert len({r["world_trace"] for r in ranks}) == 1 and len({r["passes"] for r in ranks}) == 1
    assert ranks[1]["ok"] == 0 and set(ranks[1]["blocked"]) == rank1
