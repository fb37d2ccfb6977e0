"""Transfer (DESIGN.md §17) through our pass loop against `Cosmos3OmniModularPipeline` with
`Cosmos3OmniBlocks` called with `control_videos`: bit-exact on CPU in float32 (latents of every chunk and
frames), one control and two at once, text and control guidance with intervals that switch branches mid-run,
one-frame Transfer, a flow shift, chunk chains with conditional frames and a seeded first chunk, next to T2V
requests, at --max-active 1 and 4; the forwards the layers ran are what plan/branches.py says."""

from __future__ import annotations

import imageio
import numpy as np
import pytest
import torch
from PIL import Image

from cosmos3_batch.plan.branches import transfer_plan
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import moving_square, write_jsonl
from tests.reference import reference_kwargs, transfer_outputs, transfer_reference
from tests.unit.test_fidelity import run_ours

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA

BASE = {"size": "48x32", "num_inference_steps": 4}
CASES = [
    {"id": "edge", "prompt": "a red car", "negative_prompt": "blurry", "control": {"edge": "edge.mp4"},
     "guidance_scale": 3.0, "seed": 1},
    # Both axes, each switched by its interval: 1 to 3 forwards per step.
    {"id": "two", "prompt": "a wet road", "control": {"blur": "blur.mp4", "edge": "edge.mp4"},
     "guidance_scale": 4.0, "control_guidance": 2.0, "guidance_interval": [500, 1000],
     "control_guidance_interval": [0, 700], "seed": 2},
    {"id": "control-only", "prompt": "snow", "control": {"seg": "edge.mp4"}, "guidance_scale": 1.0,
     "control_guidance": 1.5, "num_frames": 5, "seed": 3, "flow_shift": 2.5},
    {"id": "still", "prompt": "a cube", "control": {"depth": "still.png"}, "seed": 4},
    # Chains: 17 frames in chunks of 9 overlapping by 1 -> 2 chunks; 25 frames by 2, seeded -> 4 chunks.
    {"id": "chain", "prompt": "night", "control": {"edge": "long.mp4"}, "num_frames": 17,
     "frames_per_chunk": 9, "seed": 5, "num_inference_steps": 3},
    {"id": "seeded", "prompt": "dawn", "control": {"edge": "long.mp4"}, "frames_per_chunk": 9,
     "conditional_frames": 2, "video": "long.mp4", "first_chunk_conditional_frames": 1, "seed": 6,
     "num_inference_steps": 2, "guidance_scale": 2.0, "control_guidance": 0.5},
]  # fmt: skip
PLAIN = [{"id": "t2v", "prompt": "a cat walks", **BASE, "num_frames": 9, "seed": 7}]


@pytest.fixture(scope="module")
def requests_(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transfer")
    rng = np.random.RandomState(0)
    moving = moving_square(25)
    imageio.mimwrite(folder / "long.mp4", moving, fps=8)
    imageio.mimwrite(folder / "edge.mp4", moving[:9], fps=8)
    imageio.mimwrite(folder / "blur.mp4", [(rng.rand(40, 56, 3) * 255).astype(np.uint8)] * 9, fps=8)
    Image.fromarray(moving[3]).save(folder / "still.png")
    rows = [{**BASE, **case} for case in CASES] + PLAIN
    requests, errors = load_requests(str(write_jsonl(folder / "t.jsonl", rows)))
    assert errors == []
    return requests


@pytest.fixture(scope="module")
def reference(tiny_ckpt, requests_):
    from diffusers import Cosmos3OmniPipeline

    out = transfer_outputs(transfer_reference(tiny_ckpt), requests_)
    plain = Cosmos3OmniPipeline.from_pretrained(tiny_ckpt)
    plain.set_progress_bar_config(disable=True)
    for r in requests_:
        if r.transfer is None:
            generator = torch.Generator("cpu").manual_seed(r.seed)
            out[r.id] = (plain(**reference_kwargs(r), generator=generator, output_type="latent").video, None)
    return out


def _forwards(r, timesteps) -> int:
    """Forwards per chunk by plan/branches.py, times the chunks."""
    if r.transfer is None:
        return r.num_inference_steps * (2 if r.guidance_scale != 1.0 else 1)
    s = r.transfer
    plan = transfer_plan(timesteps, r.guidance_scale, s.control_guidance, s.guidance_interval,
                         s.control_guidance_interval)  # fmt: skip
    return s.num_chunks * sum(step.count for step in plan)


@pytest.mark.parametrize("max_active", [1, 4])
def test_bit_exact_with_the_modular_transfer_pipeline(tiny_ckpt, requests_, reference, max_active):
    ours, runner = run_ours(tiny_ckpt, requests_, max_active)
    assert sorted(ours) == sorted(reference)
    for rid, (ref_latents, ref_frames) in reference.items():
        assert torch.equal(ours[rid].latents, ref_latents.float()), rid
        if ref_frames is not None:
            assert np.array_equal(ours[rid].frames, ref_frames.reshape(ours[rid].frames.shape)), rid
            assert ref_frames.size == ours[rid].frames.size
    by_id = {r.id: r for r in requests_}
    assert [by_id[i].transfer.num_chunks for i in ("chain", "seeded")] == [2, 4]
    # The GEN halves ran exactly the forwards the per-step rule asks for; two texts prefilled per request
    # with text guidance (cond and its no-control twin share one), one without.
    from diffusers import UniPCMultistepScheduler

    layers = runner.ctx.split.num_layers
    forwards, texts = 0, 0
    for r in requests_:
        scheduler = UniPCMultistepScheduler.from_config(runner.ctx.scheduler_config)
        scheduler.set_timesteps(r.num_inference_steps)
        forwards += _forwards(r, scheduler.timesteps.tolist())
        texts += 2 if r.guidance_scale > 1.0 else 1
    assert runner.apply.gen_runs == forwards * layers
    assert runner.apply.und_runs == texts * layers


def test_intervals_switch_branches_mid_run(requests_, tiny_ckpt):
    """The "two" case is not a constant plan: its forwards per step change within the run."""
    from diffusers import UniPCMultistepScheduler

    from cosmos3_batch.checkpoint.folder import Checkpoint

    r = next(r for r in requests_ if r.id == "two")
    scheduler = UniPCMultistepScheduler.from_config(Checkpoint.open(tiny_ckpt).config("scheduler"))
    scheduler.set_timesteps(r.num_inference_steps)
    s = r.transfer
    plan = transfer_plan(scheduler.timesteps.tolist(), r.guidance_scale, s.control_guidance,
                         s.guidance_interval, s.control_guidance_interval)  # fmt: skip
    assert len({step.names for step in plan}) >= 2, [step.names for step in plan]
