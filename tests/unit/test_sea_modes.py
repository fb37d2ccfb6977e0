"""`--cache sea` in the modes beyond vision alone (DESIGN.md §19, issue 37 "every mode"): joint sound
(T2V+sound), policy (video and actions together) and forward dynamics, on the sound+action tiny model,
against `Cosmos3OmniPipeline` with `transformer.enable_cache(SeaCacheConfig(...))`: latents bit-exact on CPU
and every branch's per-step decisions equal, at --max-active 1 and 3. (Inverse dynamics is refused: every
frame is given, diffusers has nothing to gate on; tests/unit/test_sea_cache.py.)"""

from __future__ import annotations

import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

from cosmos3_batch.plan.cache import SeaSettings
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.reference import record_sea_decisions, reference_kwargs
from tests.unit.test_fidelity_modes import FD_ROWS
from tests.unit.test_sea_fidelity import letters, run_cached

pytestmark = pytest.mark.exact

STEPS = {"num_inference_steps": 8}
CASES = [
    {"id": "t2v-sound", "prompt": "rain on a tin roof", "size": "48x32", "num_frames": 9, "sound": True,
     **STEPS, "seed": 21},
    {"id": "policy", "prompt": "pick up the cup", "image": "IMAGE", **STEPS, "seed": 34,
     "action": {"mode": "policy", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256}},
    {"id": "fd", "prompt": "the arm pushes the cube", "image": "IMAGE", "guidance_scale": 1.0, **STEPS,
     "seed": 31, "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "fractal",
                            "resolution_tier": 256, "actions": FD_ROWS}},
]  # fmt: skip
SETTINGS = SeaSettings(threshold=0.5)


@pytest.fixture(scope="module")
def requests_(tiny_av_ckpt, cond_image, tmp_path_factory):
    rows = [{**c, "image": str(cond_image)} if c.get("image") else c for c in CASES]
    requests, errors = load_requests(str(write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", rows)))
    assert errors == []
    return requests


@pytest.fixture(scope="module")
def reference(tiny_av_ckpt, requests_):
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_av_ckpt)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(SETTINGS.diffusers_config())
    decisions = record_sea_decisions(pipe)
    base = dict(pipe.scheduler.config)
    out = {}
    for r in requests_:
        decisions.clear()
        pipe.scheduler = UniPCMultistepScheduler.from_config(base)
        generator = torch.Generator("cpu").manual_seed(r.seed)
        latents = pipe(**reference_kwargs(r), generator=generator, output_type="latent").video
        out[r.id] = (latents, {k: letters(v) for k, v in decisions.items()})
    return out


@pytest.mark.parametrize("max_active", [1, 3])
def test_sound_and_action_modes_cache_as_diffusers_does(tiny_av_ckpt, requests_, reference, max_active):
    ours, _ = run_cached(tiny_av_ckpt, requests_, max_active, SETTINGS)
    seen = ""
    for r in requests_:
        ref_latents, ref_decisions = reference[r.id]
        latents, decisions = ours[r.id]
        assert decisions == ref_decisions, r.id
        assert torch.equal(latents, ref_latents), r.id
        seen += "".join(decisions.values())
    assert "R" in seen and "C" in seen  # both paths compared
