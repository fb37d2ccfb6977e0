"""`--cache sea` on a 4-step distilled checkpoint against `Cosmos3DistilledModularPipeline` with
`transformer.enable_cache(SeaCacheConfig(same fields))`: latents bit-exact in float32 on CPU and every
request's per-step decisions equal, T2I, T2V, I2V and V2V at --max-active 1 and 4.

The modular pipeline enters its cache context with the scheduler's `num_inference_steps` and
`float(scheduler.sigmas[i])` (the distilled sigmas), and its stochastic sampler re-noises the latents the
next step's gate reads: both are what this test holds."""

from __future__ import annotations

import pytest
import torch

from cosmos3_batch.plan.cache import SeaSettings
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.reference import distilled_kwargs, distilled_reference, record_sea_decisions
from tests.unit.test_distilled import CASES
from tests.unit.test_sea_fidelity import letters, run_cached

pytestmark = pytest.mark.exact

# Four steps: with one forced first and last step only steps 1 and 2 can reuse; the second setting forces
# none, so its gate decides every step from the indicator (the last too). The distilled sigmas jump far
# (the indicator moves by more than 1 per step here): the thresholds are chosen so that each setting
# reuses on some requests' steps and not on others'.
SETTINGS = {
    "default-fields-2.0": SeaSettings(threshold=2.0),
    "order0-unforced": SeaSettings(
        threshold=1.0, residual_order=0, retention_steps=0, cache_end_steps=0, max_consecutive_cached=0
    ),
}


@pytest.fixture(scope="module")
def requests_(tiny_distilled_ckpt, cond_image, tmp_path_factory):
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.model.limits import limits_for

    rows = [{**c, "image": str(cond_image)} if c.get("image") else c for c in CASES]
    path = write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", rows)
    requests, errors = load_requests(str(path), limits_for(Checkpoint.open(tiny_distilled_ckpt), 65536))
    assert errors == []
    return requests


@pytest.fixture(scope="module")
def reference(tiny_distilled_ckpt, requests_):
    """Per setting, per request: (latents, {branch: decisions}) from the cached distilled pipeline."""
    out = {}
    for name, settings in SETTINGS.items():
        pipe = distilled_reference(tiny_distilled_ckpt)
        pipe.transformer.enable_cache(settings.diffusers_config())
        decisions = record_sea_decisions(pipe)
        for r in requests_:
            decisions.clear()
            generator = torch.Generator("cpu").manual_seed(r.seed)
            latents = pipe(**distilled_kwargs(r), generator=generator, output_type="latent", output="videos")
            out[name, r.id] = (latents, {k: letters(v) for k, v in decisions.items()})
    return out


@pytest.mark.parametrize("max_active", [1, 4])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_bit_exact_and_same_decisions_as_the_distilled_pipeline(
    tiny_distilled_ckpt, requests_, reference, setting, max_active
):
    ours, runner = run_cached(tiny_distilled_ckpt, requests_, max_active, SETTINGS[setting])
    letters_all = ""
    for r in requests_:
        ref_latents, ref_decisions = reference[setting, r.id]
        latents, decisions = ours[r.id]
        assert list(ref_decisions) == ["cond"] and len(ref_decisions["cond"]) == 4, r.id  # one branch
        assert decisions == ref_decisions, r.id
        assert torch.equal(latents, ref_latents.float()), r.id
        letters_all += decisions["cond"]
    # The settings are chosen so that the test compares both paths: some forwards reuse, some compute.
    assert "R" in letters_all and "C" in letters_all
    # A reused forward runs no layer: the GEN half ran once per computed forward and layer.
    assert runner.apply.gen_runs == letters_all.count("C") * runner.ctx.split.num_layers


def test_the_cache_changes_distilled_outputs(tiny_distilled_ckpt, requests_, reference):
    """Guards the test: a request that reused differs from the uncached distilled pipeline's output."""
    pipe = distilled_reference(tiny_distilled_ckpt)
    (name, rid), (cached, decisions) = next(
        (key, value) for key, value in sorted(reference.items()) if "R" in value[1]["cond"]
    )
    r = next(r for r in requests_ if r.id == rid)
    generator = torch.Generator("cpu").manual_seed(r.seed)
    plain = pipe(**distilled_kwargs(r), generator=generator, output_type="latent", output="videos")
    assert not torch.equal(plain, cached), (name, rid, decisions)
