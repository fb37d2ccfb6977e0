"""Our split forward + pass loop against `Cosmos3OmniPipeline.__call__`: bit-exact in float32 on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.reference import reference_kwargs

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA

SMALL = {"size": "48x32", "num_frames": 9, "num_inference_steps": 3}
CASES = [
    {
        "id": "t2i",
        "prompt": "a red cube",
        "num_frames": 1,
        "size": "32x32",
        "num_inference_steps": 3,
        "seed": 7,
    },
    {"id": "t2v-cfg", "prompt": "a cat walks", "negative_prompt": "blurry", **SMALL, "seed": 1},
    {"id": "t2v-nocfg", "prompt": "a dog runs", **SMALL, "guidance_scale": 1.0, "seed": 2},
    {"id": "i2v", "prompt": "the scene moves", **SMALL, "image": "IMAGE", "seed": 3},
    {"id": "shift2", "prompt": "waves", **SMALL, "flow_shift": 2.0, "seed": 4},
    {"id": "shift9", "prompt": "waves", **SMALL, "flow_shift": 9.0, "seed": 4},
    {"id": "steps5", "prompt": "clouds", **SMALL, "num_inference_steps": 5, "seed": 5, "fps": 16},
    {
        "id": "notemplates",
        "prompt": "rain",
        **SMALL,
        "num_inference_steps": 2,
        "extra_params": {"use_resolution_template": False, "use_duration_template": False},
    },
]


@pytest.fixture(scope="module")
def requests_(tiny_ckpt, cond_image, tmp_path_factory):
    rows = [{**c, "image": str(cond_image)} if c.get("image") else c for c in CASES]
    path = write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", rows)
    requests, errors = load_requests(str(path))
    assert errors == []
    return requests


@pytest.fixture(scope="module")
def reference(tiny_ckpt, requests_):
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
    pipe.set_progress_bar_config(disable=True)
    base = dict(pipe.scheduler.config)
    out = {}
    for r in requests_:
        overrides = {} if r.flow_shift is None else {"flow_shift": r.flow_shift}
        kwargs = reference_kwargs(r)
        results = []
        for output_type in ("latent", "np"):
            pipe.scheduler = UniPCMultistepScheduler.from_config(base, **overrides)
            generator = torch.Generator("cpu").manual_seed(r.seed)
            results.append(pipe(**kwargs, generator=generator, output_type=output_type).video)
        out[r.id] = tuple(results)
    return out


def run_ours(tiny_ckpt, requests, max_active):
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    results, errors = {}, {}

    def on_finished(job, result, error):
        (results if error is None else errors)[job.request.id] = result if error is None else error

    runner = PassRunner(ctx, ResidentWeights(ctx.layers), max_active, on_finished)
    runner.run(requests)
    assert errors == {}
    return results, runner


@pytest.mark.parametrize("max_active", [1, 3])
def test_bit_exact_with_reference_pipeline(tiny_ckpt, requests_, reference, max_active):
    ours, _ = run_ours(tiny_ckpt, requests_, max_active)
    assert sorted(ours) == sorted(reference)
    for rid, (ref_latents, ref_frames) in reference.items():
        assert ours[rid].latents.dtype == torch.float32
        assert torch.equal(ours[rid].latents, ref_latents), rid
        assert ours[rid].frames.shape == ref_frames.shape, rid
        assert np.array_equal(ours[rid].frames, ref_frames), rid


def test_und_half_runs_once_per_branch_and_layer(tiny_ckpt, requests_):
    _, runner = run_ours(tiny_ckpt, requests_, max_active=3)
    branches = sum(1 if r.guidance_scale == 1.0 else 2 for r in requests_)
    layers = 2
    assert runner.apply.und_runs == branches * layers
    # Passes: with 3 active at a time every pass steps each active request once; total steps bound it below.
    assert runner.passes >= max(r.num_inference_steps for r in requests_)
    assert runner.passes <= sum(r.num_inference_steps for r in requests_)


def test_cases_differ_from_each_other(reference):
    # Guards the test itself: different seeds / shifts / steps must give different latents.
    assert not torch.equal(reference["shift2"][0], reference["shift9"][0])
    assert not torch.equal(reference["t2v-cfg"][0], reference["t2v-nocfg"][0])


def test_und_cache_changes_nothing(tiny_ckpt, requests_, reference):
    """Recomputing the UND stream every step (as the reference does) gives the same bits, at the cost of
    one UND run per branch, layer and step instead of per branch and layer."""
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    results = {}
    runner = PassRunner(
        ctx,
        ResidentWeights(ctx.layers),
        3,
        lambda job, res, err: results.__setitem__(job.request.id, res),
        und_cache=False,
    )
    runner.run(requests_)
    for rid, (ref_latents, _) in reference.items():
        assert torch.equal(results[rid].latents, ref_latents), rid
    branch_steps = sum((1 if r.guidance_scale == 1.0 else 2) * r.num_inference_steps for r in requests_)
    assert runner.apply.und_runs == branch_steps * 2


def test_a_request_failing_mid_pass_spares_the_others(tiny_ckpt, requests_, reference, monkeypatch):
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    real = ctx.split.gen_layer
    t2i_tokens = 1  # the 32x32 image is the only request with a single GEN token (1 frame x 1 x 1 cells)

    def flaky(layer, branch, index):
        if branch.gen_hidden.shape[0] == t2i_tokens and index == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        real(layer, branch, index)

    monkeypatch.setattr(ctx.split, "gen_layer", flaky)
    results, errors = {}, {}

    def on_finished(job, result, error):
        (results if error is None else errors)[job.request.id] = result if error is None else error

    PassRunner(ctx, ResidentWeights(ctx.layers), 3, on_finished).run(requests_)
    assert errors == {"t2i": "RuntimeError: CUDA out of memory (simulated)"}
    for rid, (ref_latents, _) in reference.items():
        if rid != "t2i":
            assert torch.equal(results[rid].latents, ref_latents), rid
