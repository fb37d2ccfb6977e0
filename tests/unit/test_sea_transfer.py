"""`--cache sea` with Transfer (issue 43 item 4) against `Cosmos3OmniModularPipeline` called with
`control_videos` and `transformer.enable_cache(SeaCacheConfig(same fields))`: every chunk's latents and the
frames bit-exact in float32 on CPU, and per request, branch ("cond", "cond_no_control", "uncond": the
reference's cache-context names) and step the same decision, "-" where the branch's guidance interval has it
off (the reference enters no context there), with the reference's reset at each chunk after the first. A
T2I request shares the passes (against `Cosmos3OmniPipeline` with the same cache). A pass no branch anywhere
computes walks no layer, and plan's simulator given the recorded decisions counts the run's passes."""

from __future__ import annotations

from pathlib import Path

import imageio
import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.plan.branches import COND, sim_request, transfer_plan
from cosmos3_batch.plan.cache import SeaSettings, step_decisions
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.simulator import simulate
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import moving_square, write_jsonl
from tests.reference import reference_kwargs, transfer_outputs, transfer_reference

pytestmark = pytest.mark.exact

BASE = {"size": "48x32", "num_inference_steps": 8}
CASES = [
    # Both axes switched by their intervals: 1 to 3 forwards per step.
    {"id": "two", "prompt": "a wet road", "control": {"blur": "blur.mp4", "edge": "edge.mp4"},
     "guidance_scale": 4.0, "control_guidance": 2.0, "guidance_interval": [700, 1000],
     "control_guidance_interval": [0, 800], "seed": 2},
    # 17 frames in chunks of 9 overlapping by 1: 2 chunks, the cache reset at the second; text guidance
    # switched off for the last steps.
    {"id": "chain", "prompt": "night", "negative_prompt": "blurry", "control": {"edge": "long.mp4"},
     "num_frames": 17, "frames_per_chunk": 9, "guidance_scale": 3.0, "control_guidance": 1.5,
     "guidance_interval": [500, 1000], "seed": 5},
    {"id": "t2i", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "seed": 7},
]  # fmt: skip
SETTINGS = {
    "default-fields-0.5": SeaSettings(threshold=0.5),
    "order0-nocap": SeaSettings(
        threshold=0.3, residual_order=0, retention_steps=2, cache_end_steps=2, max_consecutive_cached=0
    ),
}


@pytest.fixture(scope="module")
def requests_(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sea-transfer")
    rng = np.random.RandomState(0)
    moving = moving_square(17)
    imageio.mimwrite(folder / "long.mp4", moving, fps=8)
    imageio.mimwrite(folder / "edge.mp4", moving[:9], fps=8)
    imageio.mimwrite(folder / "blur.mp4", [(rng.rand(40, 56, 3) * 255).astype(np.uint8)] * 9, fps=8)
    rows = [{**BASE, **case} for case in CASES]
    requests, errors = load_requests(str(write_jsonl(folder / "t.jsonl", rows)))
    assert errors == []
    return requests


def watch(pipe) -> list[tuple[str, int, bool]]:
    """Every decoder-stack decision the SeaCache root hook makes: (context name, step, computed)."""
    hook = pipe.transformer._diffusers_hook.get_hook("sea_cache_root")
    events: list[tuple[str, int, bool]] = []
    prepare = hook.prepare_decoder_stack

    def watched(module, und_seq, gen_seq):
        und_seq, gen_seq, should_compute = prepare(module, und_seq, gen_seq)
        context = hook.state_manager._context
        events.append((context.name, int(context.step_index), should_compute))
        return und_seq, gen_seq, should_compute

    hook.prepare_decoder_stack = watched
    return events


def letters(events: list[tuple[str, int, bool]], steps: int) -> dict[str, str]:
    """The reference's decisions as our sidecar writes them: per name one letter per step of every chunk,
    "-" where the name was not entered. A chunk starts where "cond" (entered at every step) is at step 0."""
    names = list(dict.fromkeys(name for name, _, _ in events))
    seen: dict[tuple[int, int, str], str] = {}
    chunk = -1
    for name, step, computed in events:
        chunk += name == COND and step == 0
        key = (chunk, step, name)
        assert key not in seen, key
        seen[key] = "C" if computed else "R"
    cells = [(c, s) for c in range(chunk + 1) for s in range(steps)]
    return {name: "".join(seen.get((c, s, name), "-") for c, s in cells) for name in names}


@pytest.fixture(scope="module")
def reference(tiny_ckpt, requests_):
    """Per setting, per request: (latents, frames or None, {branch: decisions})."""
    out = {}
    for setting, settings in SETTINGS.items():
        modular = transfer_reference(tiny_ckpt)
        modular.transformer.enable_cache(settings.diffusers_config())
        events = watch(modular)
        for r in requests_:
            if r.transfer is not None:
                events.clear()
                (latents, frames) = transfer_outputs(modular, [r])[r.id]
                out[setting, r.id] = (latents, frames, letters(events, r.num_inference_steps))
        plain = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
        plain.set_progress_bar_config(disable=True)
        plain.transformer.enable_cache(settings.diffusers_config())
        events = watch(plain)
        r = next(r for r in requests_ if r.id == "t2i")
        generator = torch.Generator("cpu").manual_seed(r.seed)
        latents = plain(**reference_kwargs(r), generator=generator, output_type="latent").video
        out[setting, r.id] = (latents, None, letters(events, r.num_inference_steps))
    return out


def run_cached(tiny_ckpt, requests, max_active: int, settings: SeaSettings, gap: int = 0):
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    results, errors = {}, {}

    def on_finished(job, result, error):
        if error is not None:
            errors[job.request.id] = error
            return
        results[job.request.id] = (result, dict(zip(job.cache.names, job.cache.decisions, strict=True)))

    rule = PrefillRule(chunk_gap=gap)
    runner = PassRunner(ctx, ResidentWeights(ctx.layers), max_active, on_finished, rule=rule, cache=settings)
    runner.run(requests)
    assert errors == {}
    return results, runner


@pytest.mark.parametrize("max_active", [1, 3])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_bit_exact_and_same_decisions_per_branch(tiny_ckpt, requests_, reference, setting, max_active):
    ours, runner = run_cached(tiny_ckpt, requests_, max_active, SETTINGS[setting])
    every = ""
    for r in requests_:
        ref_latents, ref_frames, ref_decisions = reference[setting, r.id]
        result, decisions = ours[r.id]
        assert decisions == ref_decisions, r.id
        assert torch.equal(result.latents, ref_latents.float()), r.id
        if ref_frames is not None:
            assert np.array_equal(result.frames, ref_frames.reshape(result.frames.shape)), r.id
        every += "".join(decisions.values())
    # The job compares both paths, and a branch its interval switches off at some steps.
    assert "R" in every and "C" in every and "-" in every
    # A reused forward runs no layer: the GEN half ran once per computed forward and layer.
    assert runner.apply.gen_runs == every.count("C") * runner.ctx.split.num_layers


def test_the_switched_branches_reuse_too(requests_, reference, tiny_ckpt):
    """Guards the job: the intervals switch two of Transfer's three branches within a chunk (off at some
    steps, run at others), some branch reuses, the chain's second chunk starts computing again (the
    reference's reset), and where a branch is off is where plan/branches.py says it is."""
    two = reference["default-fields-0.5", "two"][2]
    chain = reference["default-fields-0.5", "chain"][2]
    assert sorted(two) == ["cond", "cond_no_control", "uncond"]
    for name in ("cond_no_control", "uncond"):
        assert "-" in two[name] and ("C" in two[name] or "R" in two[name]), (name, two)
    assert any("R" in two[name] or "R" in chain.get(name, "") for name in two), (two, chain)
    steps = BASE["num_inference_steps"]
    assert len(chain["cond"]) == 2 * steps and chain["cond"][steps] == "C"
    r = next(r for r in requests_ if r.id == "two")
    scheduler = UniPCMultistepScheduler.from_config(Checkpoint.open(tiny_ckpt).config("scheduler"))
    scheduler.set_timesteps(r.num_inference_steps)
    s = r.transfer
    plan = transfer_plan(scheduler.timesteps.tolist(), r.guidance_scale, s.control_guidance,
                         s.guidance_interval, s.control_guidance_interval)  # fmt: skip
    assert [set(step.names) for step in plan] == [
        {name for name in two if two[name][k] != "-"} for k in range(steps)
    ]


@pytest.mark.parametrize("gap", [0, 2])
def test_a_pass_no_branch_computes_fetches_nothing_and_the_simulator_counts_it(tiny_ckpt, requests_, gap):
    """A lone chain at --max-active 1: every pass on which all of its branches reuse, and every boundary
    pass, walks no layer (no fetch); the simulator given its recorded decisions counts the same passes."""
    chain = [r for r in requests_ if r.id == "chain"]
    ours, runner = run_cached(tiny_ckpt, chain, 1, SETTINGS["default-fields-0.5"], gap)
    per_step = step_decisions(ours["chain"][1])
    assert "R" in per_step
    assert runner.skipped_passes == per_step.count("R") + gap
    assert [p.fetch_skipped for p in runner.timeline].count(True) == runner.skipped_passes
    sim = simulate([[sim_request(chain[0], gap, per_step)]], 1, PrefillRule(chunk_gap=gap))
    assert (sim.passes, sim.und_passes, sim.skipped_passes) == (
        runner.passes,
        runner.und_passes,
        runner.skipped_passes,
    )


def test_plan_takes_transfer_under_the_cache(tiny_ckpt, requests_):
    """`plan --cache sea` no longer refuses Transfer: its branches (up to three per step) are what the reuse
    share thins, the passes the chains ride (chunks and boundaries) do not change."""
    from tests.unit.test_sea_plan import plan_doc

    common = [requests_[0].source, "--model", str(tiny_ckpt), "--offload", "resident", "--max-active", "1"]
    common += ["--tflops", "1e-4", "--hbm-gbps", "1e-3"]  # a pass long enough to be resolved
    plain = plan_doc(*common)
    cached = plan_doc(*common, "--cache", "sea", "--cache-reuse", "0.5")
    assert cached["cache"] == {**SeaSettings().record(), "reuse": 0.5}
    assert cached["estimate"]["seconds_per_pass"] < plain["estimate"]["seconds_per_pass"]
    assert cached["simulation"] == plain["simulation"]


def test_run_takes_transfer_under_the_cache_and_records_its_branches(tmp_path, tiny_ckpt, requests_):
    """`run --cache sea` on a Transfer request (refused with exit 2 before issue 43): exit 0, and its sidecar
    records the three branches' decisions over both chunks, the forwards counted from them."""
    import json

    from tests.unit.test_sea_cache import invoke

    out = tmp_path / "out"
    source = requests_[0].source  # the chain alone: its files are next to the request file
    (line,) = [line for line in Path(source).read_text().splitlines() if '"chain"' in line]
    prompts = Path(source).parent / "chain.jsonl"
    prompts.write_text(line + "\n")
    result = invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress", "--cache", "sea")
    assert result.exit_code == 0, result.output
    cache = json.loads((out / "chain.json").read_text())["cache"]
    decisions = cache["decisions"]
    assert sorted(decisions) == ["cond", "cond_no_control", "uncond"]
    assert {len(d) for d in decisions.values()} == {2 * BASE["num_inference_steps"]}
    assert "-" in decisions["uncond"]
    for name, d in decisions.items():
        assert cache["forwards"][name] == {"computed": d.count("C"), "reused": d.count("R")}, name
