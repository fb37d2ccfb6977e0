"""`--cache sea` against `Cosmos3OmniPipeline` with `transformer.enable_cache(SeaCacheConfig(same fields))`:
latents bit-exact in float32 on CPU and every branch's per-step decision (computed or reused) equal, for T2I,
T2V (with and without CFG), I2V and V2V at --max-active 1 and 4, under two settings chosen so that some steps
reuse and some compute (the test checks both happen)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.plan.cache import SeaSettings
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.reference import record_sea_decisions, reference_kwargs

pytestmark = pytest.mark.exact

CLIP = Path(__file__).resolve().parents[2] / "examples" / "clip.mp4"
SMALL = {"size": "48x32", "num_frames": 9}
IMAGE = {"num_frames": 1, "size": "32x32"}
CASES = [
    {"id": "t2i", "prompt": "a red cube", **IMAGE, "num_inference_steps": 8, "seed": 7},
    {"id": "t2v", "prompt": "a cat walks", "negative_prompt": "blurry", **SMALL, "num_inference_steps": 8},
    {"id": "t2v-nocfg", "prompt": "a dog runs", **SMALL, "num_inference_steps": 6, "guidance_scale": 1.0},
    {"id": "i2v", "prompt": "the scene moves", **SMALL, "num_inference_steps": 7, "image": "I", "seed": 3},
    {"id": "v2v", "prompt": "the clip goes on", **SMALL, "num_inference_steps": 8, "video": str(CLIP)},
]
SETTINGS = {
    "default-fields-0.5": SeaSettings(threshold=0.5),
    "order0-nocap": SeaSettings(
        threshold=0.3, residual_order=0, retention_steps=2, cache_end_steps=2, max_consecutive_cached=0
    ),
}


@pytest.fixture(scope="module")
def requests_(tiny_ckpt, cond_image, tmp_path_factory):
    rows = [{**c, "image": str(cond_image)} if c.get("image") else c for c in CASES]
    requests, errors = load_requests(str(write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", rows)))
    assert errors == []
    return requests


def letters(decisions: list[bool]) -> str:
    return "".join("C" if computed else "R" for computed in decisions)


@pytest.fixture(scope="module")
def reference(tiny_ckpt, requests_):
    """Per setting, per request: (latents, {branch: decisions}) from the cached reference pipeline."""
    out = {}
    for name, settings in SETTINGS.items():
        pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.enable_cache(settings.diffusers_config())
        decisions = record_sea_decisions(pipe)
        base = dict(pipe.scheduler.config)
        for r in requests_:
            decisions.clear()
            pipe.scheduler = UniPCMultistepScheduler.from_config(base)
            generator = torch.Generator("cpu").manual_seed(r.seed)
            latents = pipe(**reference_kwargs(r), generator=generator, output_type="latent").video
            out[name, r.id] = (latents, {k: letters(v) for k, v in decisions.items()})
    return out


def run_cached(tiny_ckpt, requests, max_active: int, settings: SeaSettings):
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    results, errors = {}, {}

    def on_finished(job, result, error):
        if error is not None:
            errors[job.request.id] = error
            return
        decisions = dict(zip(job.cache.names, job.cache.decisions, strict=True))
        results[job.request.id] = (result.latents, decisions)

    runner = PassRunner(ctx, ResidentWeights(ctx.layers), max_active, on_finished, cache=settings)
    runner.run(requests)
    assert errors == {}
    return results, runner


@pytest.mark.parametrize("max_active", [1, 2, 4])  # 2: admissions mid-run, beside reusing branches
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_bit_exact_and_same_decisions(tiny_ckpt, requests_, reference, setting, max_active):
    ours, runner = run_cached(tiny_ckpt, requests_, max_active, SETTINGS[setting])
    letters_all = ""
    for r in requests_:
        ref_latents, ref_decisions = reference[setting, r.id]
        latents, decisions = ours[r.id]
        assert decisions == ref_decisions, r.id
        assert torch.equal(latents, ref_latents), r.id
        letters_all += "".join(decisions.values())
    # The settings are chosen so that the test compares both paths: some forwards reuse, some compute.
    assert "R" in letters_all and "C" in letters_all
    # A reused forward runs no layer: the GEN half ran once per computed forward and layer.
    assert runner.apply.gen_runs == letters_all.count("C") * 2


def test_cache_changes_the_output(tiny_ckpt, requests_, reference):
    """Guards the test: a reusing run differs from the uncached reference somewhere."""
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
    pipe.set_progress_bar_config(disable=True)
    r = next(r for r in requests_ if r.id == "t2i")
    generator = torch.Generator("cpu").manual_seed(r.seed)
    plain = pipe(**reference_kwargs(r), generator=generator, output_type="latent")
    cached, decisions = reference["default-fields-0.5", "t2i"]
    assert "R" in decisions["cond"]
    assert not torch.equal(plain.video, cached)
