"""The reasoner stages chained to generation (issue 45, DESIGN.md §22) under real `torchrun` jobs (world 2,
gloo, CPU), bit-exact against the references computed here at the one thread torchrun gives each rank.

1. One job mixing an upsampled T2I request, a captioned and scored one, a plain one and a Transfer request:
   the upsampled prompt's token ids equal transformers' `generate` on the filled instruction (sampled from
   the request's seed), its latents equal diffusers' pipeline given that text; the caption's and the score's
   token ids equal `generate` on the written (lossless) PNG; the plain and the Transfer request equal
   diffusers (`Cosmos3OmniPipeline`, `Cosmos3OmniModularPipeline`); both ranks issue the same collectives
   (a chain's reasoner decodes ride passes both ranks take); the manifest holds the chain's columns for the
   right rows only.
2. A job SIGKILLed (torchrun and every worker at once) after a prompt was upsampled and recorded but before
   its generation was written: the rerun generates from the recorded prompt (`reused`, the same token ids,
   the record untouched) and its latents equal diffusers' given that prompt.
"""

from __future__ import annotations

import json
import subprocess
import time
from functools import partial
from pathlib import Path

import imageio
import pyarrow.parquet as pq
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from safetensors.torch import load_file

from cosmos3_batch.requests.chain import DEFAULT_CAPTION, DEFAULT_TEMPLATE, UpsampleSpec, fill
from cosmos3_batch.requests.parse import Request
from cosmos3_batch.requests.reason import ReasonSpec
from tests.conftest import moving_square, write_jsonl
from tests.dist.jobs import ENV, JOB_PYTHON, torchrun_jobs
from tests.dist.preempt import kill_if
from tests.dist.test_checkpoints import one_thread, requests_for
from tests.dist.test_runs import assert_lockstep
from tests.reasoner_reference import reference_ids
from tests.reference import reference_kwargs, transfer_outputs, transfer_reference
from tests.unit.test_chain import CAP, FLAGS, PLAIN, UP

pytestmark = pytest.mark.dist
# One control of 5 frames at 48x32, 2 steps: the smallest Transfer chain (one chunk) beside the T2I rows.
XFER = {"id": "xfer", "prompt": "a red car", "control": {"edge": "edge.mp4"}, "size": "48x32",
        "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 3.0, "seed": 1}  # fmt: skip
# Slow enough generations that the kill lands between a prompt's record and its output: at one slot per
# rank, a rank upsamples (9 tokens), records, then takes 36 steps (with CFG: 72 forwards) before writing.
SLOW = [
    {"id": f"slow{i}", "prompt": prompt, "size": "32x32", "num_frames": 1, "num_inference_steps": 36,
     "seed": 20 + i, "upsample": True}
    for i, prompt in enumerate(["a red ball rolls", "a kite over a beach"])
]  # fmt: skip


def _sidecar(out: Path, rid: str) -> dict:
    return json.loads((out / f"{rid}.json").read_text())


def _latents(out: Path, rid: str) -> torch.Tensor:
    return load_file(out / f"{rid}.latents.safetensors")["latents"]


def _diffusers(ckpt: Path, requests: list[tuple[Request, str]]) -> dict[str, torch.Tensor]:
    """diffusers' pipeline on each (request, prompt), given that prompt: its latents, by id. One pipeline for
    all of them (loading it is most of a 2-step request's cost)."""
    pipe = Cosmos3OmniPipeline.from_pretrained(ckpt)
    pipe.set_progress_bar_config(disable=True)
    latents = {}
    for r, prompt in requests:
        generator = torch.Generator("cpu").manual_seed(r.seed)
        kwargs = {**reference_kwargs(r), "prompt": prompt}
        latents[r.id] = pipe(**kwargs, generator=generator, output_type="latent").video
    return latents


def test_a_mixed_chained_job_at_world_2_equals_generate_and_diffusers(tiny_reasoner_ckpt, tmp_path):
    imageio.mimwrite(tmp_path / "edge.mp4", moving_square(5), fps=8)
    prompts = write_jsonl(tmp_path / "p.jsonl", [UP, CAP, PLAIN, XFER])
    out = tmp_path / "out"
    job = ["run", prompts, "--model", tiny_reasoner_ckpt, "--out", out, "--save-latents", "--no-progress"]
    (code,) = torchrun_jobs(2, [[*job, *FLAGS]], tmp_path / "launch")
    assert code == 0, (tmp_path / "launch" / "stderr.txt").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == 4 and summary["failed"] == []
    assert_lockstep(summary, 2)
    up, cap = _sidecar(out, "up")["upsample"], _sidecar(out, "cap")["captions"]
    image = str(out / "cap.png")  # lossless: the very uint8 frames the reasoner was handed on its rank
    requests = {r.id: r for r in requests_for(tiny_reasoner_ckpt, prompts)}

    def references():
        upsample = UpsampleSpec(DEFAULT_TEMPLATE, "text", max_new_tokens=9).reason_spec()
        caption = ReasonSpec(max_new_tokens=5)
        instruction = fill(DEFAULT_TEMPLATE, UP["prompt"], 32, 32, 1, 24.0)
        describe = fill(DEFAULT_CAPTION, CAP["prompt"], 32, 32, 1, 24.0)
        score = f"Rate it 1-5: {CAP['prompt']}"
        ids = {
            "up": reference_ids(tiny_reasoner_ckpt, instruction, upsample, UP["seed"]),
            "caption": reference_ids(tiny_reasoner_ckpt, describe, caption, CAP["seed"], image),
            "score": reference_ids(tiny_reasoner_ckpt, score, caption, CAP["seed"], image),
        }
        given = [(requests["up"], up["prompt_upsampled"]), (requests["cap"], CAP["prompt"])]
        latents = _diffusers(tiny_reasoner_ckpt, [*given, (requests["plain"], PLAIN["prompt"])])
        modular = transfer_outputs(transfer_reference(tiny_reasoner_ckpt), [requests["xfer"]])
        return ids, {**latents, "xfer": modular["xfer"][0]}

    ids, latents = one_thread(references)
    assert up["status"] == "upsampled" and up["prompt_original"] == UP["prompt"]
    assert up["token_ids"] == ids["up"]
    assert cap["caption"]["token_ids"] == ids["caption"] and cap["score"]["token_ids"] == ids["score"]
    for rid, expected in latents.items():
        assert torch.equal(_latents(out, rid), expected.float()), rid
    rows = {row["id"]: row for row in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert rows["up"]["prompt_original"] == UP["prompt"]
    assert rows["up"]["prompt_upsampled"] == up["prompt_upsampled"]
    assert rows["cap"]["caption"] == cap["caption"]["text"]
    assert rows["cap"]["score_text"] == cap["score"]["text"]
    for rid in ("cap", "plain", "xfer"):  # only the upsampled request has prompts of its chain
        assert rows[rid]["prompt_original"] is None and rows[rid]["prompt_upsampled"] is None, rid
    for rid in ("up", "plain", "xfer"):  # only the captioned one has texts about its frames
        assert rows[rid]["caption"] is None and rows[rid]["score_text"] is None, rid


def launch(prompts: Path, model: Path, out: Path, log: Path) -> subprocess.Popen:
    """The slow job under a real 2-rank torchrun; its output to `log` (a pipe nobody reads until the kill
    could fill and stall the job)."""
    cmd = [JOB_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
    cmd += ["--save-latents", "--no-progress", "--max-active", "1", *FLAGS]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def recorded_not_written(out: Path) -> list[str]:
    """Requests whose upsampled prompt is recorded but whose output is not written yet (the kill's window)."""
    return [r["id"] for r in SLOW if (out / "upsampled" / f"{r['id']}.json").exists()
            and not (out / f"{r['id']}.json").exists()]  # fmt: skip


def test_a_kill_between_the_upsampling_and_the_generation_reuses_the_recorded_prompt(
    tiny_reasoner_ckpt, tmp_path
):
    prompts = write_jsonl(tmp_path / "p.jsonl", SLOW)
    # The job is frozen before the last look (`kill_if`), so the kill lands on what was seen; up to three jobs
    # (each folder set aside) in case a loaded machine lets the generation through every look.
    for attempt in range(3):
        out, log = tmp_path / f"out{attempt}", tmp_path / f"log{attempt}.txt"
        job = launch(prompts, tiny_reasoner_ckpt, out, log)
        deadline = time.monotonic() + 300  # start-up is ~12 s of CPU a rank: generous under load
        killed = False
        while not killed and job.poll() is None:
            assert time.monotonic() < deadline, f"no prompt recorded in 300 s:\n{log.read_text()[-3000:]}"
            killed = kill_if(job, partial(recorded_not_written, out))
            time.sleep(0.02)  # polling, not synchronization: the condition is what is waited for
        assert killed or job.returncode == 0, f"the job failed before the kill:\n{log.read_text()[-3000:]}"
        if pending := recorded_not_written(out):
            break
    else:
        pytest.fail("no kill of three landed between a prompt's record and its output")
    records = {rid: (out / "upsampled" / f"{rid}.json").read_text() for rid in pending}
    written = [r["id"] for r in SLOW if (out / f"{r['id']}.json").exists()]

    again = launch(prompts, tiny_reasoner_ckpt, out, tmp_path / "rerun.txt")
    assert again.wait(timeout=300) == 0, (tmp_path / "rerun.txt").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == [] and summary["skipped_complete"] == len(written)
    assert summary["generated_ok"] == len(SLOW) - len(written)
    requests = {r.id: r for r in requests_for(tiny_reasoner_ckpt, prompts)}
    for rid, text in records.items():
        record = json.loads(text)
        upsample = _sidecar(out, rid)["upsample"]
        # Generated from the record, never sampled again: the same ids, the file as the kill left it.
        assert upsample["reused"] is True and upsample["token_ids"] == record["token_ids"], rid
        assert upsample["prompt_upsampled"] == record["prompt"], rid
        assert (out / "upsampled" / f"{rid}.json").read_text() == text, rid
    # diffusers given the recorded prompts, rather than an uninterrupted world-1 run: that would upsample
    # and generate every request again; this generates only the reused ones, and from the very text read.
    expected = one_thread(
        lambda: _diffusers(
            tiny_reasoner_ckpt, [(requests[rid], json.loads(records[rid])["prompt"]) for rid in records]
        )
    )
    for rid, latents in expected.items():
        assert torch.equal(_latents(out, rid), latents), rid
    for rid in set(requests) - set(records) - set(written):  # upsampled afresh by the rerun
        assert "reused" not in _sidecar(out, rid)["upsample"], rid
