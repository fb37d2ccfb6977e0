"""`--cache sea` pieces against diffusers' SeaCache (hooks/sea_cache.py, pinned 0.42): the settings and their
checks, the gate (resolve_gate cut at its distance read), the device indicator, the pinned sources; the flags
end to end (sidecar, metrics, summary, manifest, resume identity) and the refusal for inverse dynamics."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import random

import pyarrow.parquet as pq
import pytest
import torch
from diffusers import SeaCacheConfig
from diffusers.hooks import sea_cache as diffusers_sea
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.pipeline.kinds.step_cache import gate as sea_gate
from cosmos3_batch.pipeline.kinds.step_cache.indicator import device_indicator
from cosmos3_batch.plan.cache import SeaSettings, parse_cache
from tests.conftest import write_jsonl
from tests.unit.test_sea_fidelity import CLIP

# What pipeline/kinds/step_cache/ (gate.py, indicator.py, cache.py) mirrors or calls. A change in diffusers
# fails here: re-read the new source, update the mirror, then these digests.
PINNED = {
    "SeaCacheSharedState.resolve_gate": "459924b8c3b03e05",
    "SeaCacheRootHook.prepare_decoder_stack": "dd86ee2ef4b6f75f",
    "SeaCacheRootHook.pre_forward": "16933d0ac628e029",
    "_apply_sea_filter": "d004c28873e2b23b",
    "_build_indicator": "4d65176c86de1837",
    "_record_full_execution": "5f12dbf784ec8730",
    "_prepare_cosmos3_raw_vision_metadata": "db1fb0137b6741a0",
    "SeaCacheConfig": "b043a6ee1131bb50",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_mirrored_diffusers_sources_are_pinned(name):
    obj = diffusers_sea
    for part in name.split("."):
        obj = getattr(obj, part)
    assert hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16] == PINNED[name]


def test_settings_defaults_and_checks_are_diffusers():
    ours = dataclasses.asdict(SeaSettings())
    theirs = {
        f.name: f.default for f in dataclasses.fields(SeaCacheConfig) if f.name != "raw_vision_callback"
    }
    assert ours == theirs
    bad = [
        {"threshold": -0.1},
        {"threshold": float("inf")},
        {"residual_order": 2},
        {"retention_steps": -1},
        {"cache_end_steps": -1},
        {"max_consecutive_cached": -1},
        {"power_exp": 0.0},
    ]
    for fields in bad:
        with pytest.raises(ValueError):
            SeaCacheConfig(**fields)
        with pytest.raises(ValueError, match="--cache-"):
            SeaSettings(**fields)
    assert parse_cache(("none", 0.25, 1, 1, 1, 2, 3.0)) is None
    assert parse_cache(("sea", 0.4, 0, 2, 1, 0, 2.0)) == SeaSettings(0.4, 0, 2, 1, 0, 2.0)
    with pytest.raises(ValueError, match="--cache must be one of"):
        parse_cache(("tea", 0.25, 1, 1, 1, 2, 3.0))


def _ours(state, config, step, sigma, steps, indicator):
    """Our two halves as step_cache runs them: the distance read only where the gate asks for it."""
    asks = sea_gate.needs_distance(state, step, steps, indicator is not None, config)
    distance = [float(sea_gate.distance_of(indicator, state.previous_indicator[0]))] if asks else None
    return sea_gate.resolve(state, step, sigma, steps, indicator, distance, config)


@pytest.mark.parametrize("seed", range(6))
def test_gate_decides_as_resolve_gate(seed):
    """Random indicator walks, with skipped steps, missing indicators and the consecutive cap: diffusers'
    resolve_gate and ours, each on its own SeaCacheContextState, agree on every decision and state field."""
    rng = random.Random(seed)
    config = SeaCacheConfig(
        threshold=rng.choice([0.3, 0.6, 1.0]),
        retention_steps=rng.randint(0, 2),
        cache_end_steps=rng.randint(0, 2),
        max_consecutive_cached=rng.randint(0, 3),
    )
    shared = diffusers_sea.SeaCacheSharedState()
    theirs, ours = diffusers_sea.SeaCacheContextState(), diffusers_sea.SeaCacheContextState()
    steps, step, base = 20, 0, torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(seed))
    decisions = []
    while step < steps:
        indicator = None if rng.random() < 0.1 else base + rng.uniform(0, 0.4) * torch.randn(base.shape)
        sigma = 1.0 - step / steps
        metadata = diffusers_sea._SeaCacheForwardMetadata(step, sigma, steps)
        expected = shared.resolve_gate(theirs, metadata, None if indicator is None else [indicator], config)
        got = _ours(ours, config, step, sigma, steps, indicator)
        assert got == expected
        for field in ("gate_key", "gate_should_compute", "accumulated_distance", "consecutive_cached"):
            assert getattr(ours, field) == getattr(theirs, field), field
        for state in (theirs, ours):  # prepare_decoder_stack's count (history is never empty here)
            state.consecutive_cached = 0 if got else state.consecutive_cached + 1
        decisions.append(got)
        step += 2 if rng.random() < 0.1 else 1  # now and then a non-adjacent step
    assert True in decisions and False in decisions


def test_reuse_without_history_computes():
    state = diffusers_sea.SeaCacheContextState()
    state.accumulated_distance = 0.1
    assert sea_gate.reuse_or_compute(state, False) is True
    assert (state.accumulated_distance, state.gate_should_compute) == (0.0, True)
    sea_gate.record(state, 0, torch.ones(2), SeaCacheConfig())
    assert sea_gate.reuse_or_compute(state, False) is False and state.consecutive_cached == 1


def test_extrapolated_residual_is_diffusers_formula():
    config = SeaCacheConfig(residual_order=1)
    state = diffusers_sea.SeaCacheContextState()
    sea_gate.record(state, 1, torch.tensor([1.0, 2.0]), config)
    sea_gate.record(state, 3, torch.tensor([2.0, 5.0]), config)
    # latest + (latest - previous) * (step - latest) / (latest - previous): step 4 -> half a stride on
    assert torch.equal(sea_gate.cached_residual(state, 4, config), torch.tensor([2.5, 6.5]))
    assert torch.equal(
        sea_gate.cached_residual(state, 4, SeaCacheConfig(residual_order=0)), torch.tensor([2.0, 5.0])
    )


@pytest.mark.parametrize("shape", [(48, 1, 2, 2), (16, 3, 4, 6), (8, 5, 3, 7)])
@pytest.mark.parametrize("sigma", [0.0, 0.37, 1.0])
def test_device_indicator_equals_diffusers_bit_for_bit(shape, sigma):
    raw = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    metadata = diffusers_sea._SeaCacheForwardMetadata(0, sigma, 4, raw_vision=[raw])
    (expected,) = diffusers_sea._build_indicator(SeaCacheConfig(power_exp=2.5), metadata)
    assert torch.equal(device_indicator(raw, sigma, 2.5), expected)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_run_records_the_cache_everywhere(tmp_path, tiny_ckpt):
    rows = [
        {"id": "a", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 8},
        {"id": "b", "prompt": "waves", "num_frames": 1, "size": "32x32", "num_inference_steps": 6, "seed": 2},
    ]
    prompts, out = write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out"
    flags = ("--cache", "sea", "--cache-threshold", "0.5", "--cache-max-consecutive", "3")
    result = invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress", *flags)
    assert result.exit_code == 0, result.output
    settings = {**dataclasses.asdict(SeaSettings(threshold=0.5, max_consecutive_cached=3)), "kind": "sea"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["cache"] == settings
    sidecars = {rid: json.loads((out / f"{rid}.json").read_text())["cache"] for rid in ("a", "b")}
    computed = reused = 0
    for cache in sidecars.values():
        assert {k: cache[k] for k in settings} == settings
        letters = cache["decisions"]["cond"] + cache["decisions"]["uncond"]
        assert cache["forwards"]["cond"] == {
            "computed": cache["decisions"]["cond"].count("C"),
            "reused": cache["decisions"]["cond"].count("R"),
        }
        computed, reused = computed + letters.count("C"), reused + letters.count("R")
    assert reused > 0
    shares = summary["cache"]
    assert (shares["forwards_computed"], shares["forwards_reused"]) == (computed, reused)
    assert shares["reused_share"] == round(reused / (computed + reused), 6)
    metrics = (out / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    by_id = {row.split(",")[0]: dict(zip(header, row.split(","), strict=True)) for row in metrics[1:]}
    for rid, cache in sidecars.items():
        letters = cache["decisions"]["cond"] + cache["decisions"]["uncond"]
        assert by_id[rid]["forwards_computed"] == str(letters.count("C"))
        assert by_id[rid]["forwards_reused"] == str(letters.count("R"))
    manifest = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert json.loads(manifest["a"]["forwards"]) == sidecars["a"]["forwards"]
    # Other cache settings make other bytes: a rerun with them regenerates instead of skipping.
    again = invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress", "--cache", "sea")
    assert json.loads((out / "summary.json").read_text())["skipped_complete"] == 0, again.output


def test_inverse_dynamics_is_refused_before_loading(tmp_path, tiny_av_ckpt):
    """The same request runs without --cache; with it, run and plan exit 2 naming the mode and the reason."""
    row = {
        "id": "inv",
        "prompt": "a robot arm",
        "video": str(CLIP),
        "action": {"mode": "inverse_dynamics", "chunk_size": 8, "domain": "bridge_orig_lerobot"},
    }
    prompts = write_jsonl(tmp_path / "p.jsonl", [row])
    plan = invoke("plan", prompts, "--model", tiny_av_ckpt)
    assert plan.exit_code == 0, plan.output
    result = invoke("run", prompts, "--model", tiny_av_ckpt, "--out", tmp_path / "o", "--cache", "sea")
    assert result.exit_code == 2
    assert "--cache sea does not apply to action mode inverse_dynamics" in result.output
    assert not (tmp_path / "o").exists()
    planned = invoke("plan", prompts, "--model", tiny_av_ckpt, "--cache", "sea")  # plan refuses it alike
    assert planned.exit_code == 2
    assert "--cache sea does not apply to action mode inverse_dynamics" in planned.output


class StubGate:
    """A request's step cache as gate_rank drives it: one distance asked, computed iff it reaches 0.5."""

    def __init__(self, distance: float) -> None:
        self.distance, self.seen, self.computes, self.names = distance, [], [True], ("cond",)

    def begin_gate(self, job) -> list[torch.Tensor]:
        return [torch.tensor(self.distance, dtype=torch.float64)]

    def end_gate(self, step: int, distances: list[float]) -> None:
        self.seen = distances
        self.computes = [distances[0] >= 0.5]


@pytest.mark.parametrize("shared", [True, False])
def test_an_sp_group_gates_with_its_leads_distances(shared):
    """Issue 48: one member's distance a hair off (another GPU kernel) must not make it run layers, with
    their all-to-alls, that its partner skips: both resolve with the lead's numbers. Unshared, they differ."""
    from types import SimpleNamespace

    from cosmos3_batch.parallel.seq_group import SeqGroup
    from cosmos3_batch.pipeline.kinds.step_cache.cache import gate_rank
    from tests.unit.test_vae_patch import in_threads

    def member(group):
        events = []
        sp = SeqGroup(2, group.index, 0, group.pg, note=events.append, host=group.pg)
        distance = 0.5 if group.index == 0 else 0.5 - 1e-9  # the partner's read just under the threshold
        job = SimpleNamespace(cache=StubGate(distance), step_index=3, gen_branches=lambda: ["cond"])
        job.step_names = lambda: ("cond",)  # the reference's context names of this step's branches
        computing = gate_rank([job], sp.share_lead if shared else None)
        return job.cache.seen, job.cache.computes, computing, events

    lead, partner = in_threads(2, member, timeout_s=30)
    assert not isinstance(lead, Exception) and not isinstance(partner, Exception), (lead, partner)
    if shared:
        assert lead[:3] == partner[:3] == ([0.5], [True], 1)
        assert lead[3] == partner[3] == ["share"]  # one broadcast, in the group's trace on both
    else:
        assert lead[1] != partner[1]
