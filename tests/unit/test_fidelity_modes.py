"""Every generation mode beyond T2I/T2V/I2V against `Cosmos3OmniPipeline.__call__`, on the sound+action tiny
model: V2V (keep first/last, two condition_frames settings), system_prompt off/on, T2V/I2V/V2V+sound (latents,
frames, waveform), forward dynamics, inverse dynamics and policy at two action widths (latents, frames,
actions), policy and forward dynamics with sound: bit-exact in float32 on CPU, all in one job, at
--max-active 1 and 3."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

from cosmos3_batch.requests.parse import Request, load_requests
from tests.conftest import write_jsonl
from tests.reference import reference_kwargs
from tests.unit.test_fidelity import run_ours

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA

CLIP = Path(__file__).resolve().parents[2] / "examples" / "clip.mp4"
SMALL = {"size": "48x32", "num_frames": 9, "num_inference_steps": 3}
CASES = [
    {"id": "v2v-first", "prompt": "the clip goes on", **SMALL, "video": "CLIP", "seed": 11},
    {
        "id": "v2v-last",
        "prompt": "the clip goes on",
        **SMALL,
        "video": "CLIP",
        "condition_video_keep": "last",
        "seed": 11,
    },
    {
        "id": "v2v-first-0",
        "prompt": "a slow pan",
        **SMALL,
        "video": "CLIP",
        "condition_frames": [0],
        "guidance_scale": 1.0,
        "seed": 12,
    },
    {
        "id": "v2v-last-12",
        "prompt": "a slow pan",
        **SMALL,
        "video": "CLIP",
        "condition_frames": [1, 2],
        "condition_video_keep": "last",
        "seed": 12,
    },
    {"id": "sys-off", "prompt": "a red cube", **SMALL, "system_prompt": False, "seed": 13},
    {"id": "sys-on", "prompt": "a red cube", **SMALL, "system_prompt": True, "seed": 13},
    {"id": "sys-off-t2i", "prompt": "a red cube", "size": "32x32", "num_frames": 1, "system_prompt": False},
]


TWO_STEPS = {"num_inference_steps": 2}
FD_ROWS = [[0.1 * i - 0.3 * j for j in range(10)] for i in range(3)]  # 3 rows < chunk 4: the last repeats
ACTION_CASES = [
    {
        "id": "fd-image",
        "prompt": "the arm pushes the cube",
        "image": "IMAGE",
        "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256,
                   "actions": FD_ROWS},
        **TWO_STEPS,
        "seed": 31,
    },
    {
        "id": "fd-npy-video",
        "prompt": "the car drives on",
        "video": "CLIP",
        "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "av", "resolution_tier": 256,
                   "actions": "AV_NPY", "viewpoint": "third_person_view"},
        "guidance_scale": 1.0,
        **TWO_STEPS,
        "seed": 32,
    },
    {
        "id": "inverse",
        "prompt": "what moved",
        "video": "CLIP",
        "action": {"mode": "inverse_dynamics", "chunk_size": 8, "domain": "bridge_orig_lerobot",
                   "resolution_tier": 256},
        **TWO_STEPS,
        "seed": 33,
    },
    {
        "id": "policy-fractal",
        "prompt": "pick up the cup",
        "image": "IMAGE",
        "action": {"mode": "policy", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256},
        **TWO_STEPS,
        "seed": 34,
    },
    {
        "id": "policy-hands",
        "prompt": "wave both hands",
        "image": "IMAGE",
        "action": {"mode": "policy", "chunk_size": 4, "domain": "hand_pose", "resolution_tier": 256,
                   "viewpoint": "wrist_view"},
        "guidance_scale": 1.0,
        **TWO_STEPS,
        "seed": 35,
    },
]  # fmt: skip


ACTION_CASES += [
    {
        "id": "policy-sound",
        "prompt": "pick up the cup, it clinks",
        "image": "IMAGE",
        "sound": True,
        "action": {"mode": "policy", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256},
        **TWO_STEPS,
        "seed": 36,
    },
    {
        "id": "fd-sound",
        "prompt": "the arm pushes the cube with a scrape",
        "image": "IMAGE",
        "sound": True,
        "guidance_scale": 1.0,
        "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256,
                   "actions": FD_ROWS},
        **TWO_STEPS,
        "seed": 37,
    },
]  # fmt: skip
SOUND_CASES = [
    {"id": "t2v-sound", "prompt": "rain on a tin roof", **SMALL, "sound": True, "seed": 21},
    {
        "id": "i2v-sound",
        "prompt": "the scene moves and hums",
        **SMALL,
        "image": "IMAGE",
        "sound": True,
        "guidance_scale": 1.0,
        "fps": 16,
        "seed": 22,
    },
    {"id": "v2v-sound", "prompt": "the clip goes on", **SMALL, "video": "CLIP", "sound": True, "seed": 23},
    {"id": "t2v-silent", "prompt": "rain on a tin roof", **SMALL, "seed": 21},
]


def fill(value, paths: dict):
    if isinstance(value, dict):
        return {k: fill(v, paths) for k, v in value.items()}
    return paths.get(value, value) if isinstance(value, str) else value


@pytest.fixture(scope="module")
def requests_(tmp_path_factory, cond_image) -> list[Request]:
    folder = tmp_path_factory.mktemp("modes")
    av = folder / "av.npy"
    np.save(av, np.linspace(-1, 1, 5 * 9, dtype=np.float32).reshape(5, 9))  # 5 rows > chunk 4: truncated
    paths = {"IMAGE": str(cond_image), "CLIP": str(CLIP), "AV_NPY": str(av)}
    rows = [fill(c, paths) for c in CASES + SOUND_CASES + ACTION_CASES]
    next(r for r in rows if r["id"] == "sys-off-t2i")["num_inference_steps"] = 2
    requests, errors = load_requests(str(write_jsonl(folder / "p.jsonl", rows)))
    assert errors == []
    return requests


def run_reference(ckpt: Path, requests: list[Request], output_types=("latent", "np")) -> dict:
    pipe = Cosmos3OmniPipeline.from_pretrained(ckpt)
    pipe.set_progress_bar_config(disable=True)
    base = dict(pipe.scheduler.config)
    out = {}
    for r in requests:
        overrides = {} if r.flow_shift is None else {"flow_shift": r.flow_shift}
        results = []
        for output_type in output_types:
            pipe.scheduler = UniPCMultistepScheduler.from_config(base, **overrides)
            generator = torch.Generator("cpu").manual_seed(r.seed)
            results.append(pipe(**reference_kwargs(r), generator=generator, output_type=output_type))
        out[r.id] = results
    return out


@pytest.fixture(scope="module")
def reference(tiny_av_ckpt, requests_):
    return run_reference(tiny_av_ckpt, requests_)


@pytest.mark.parametrize("max_active", [1, 3])
def test_every_mode_in_one_job_is_bit_exact(tiny_av_ckpt, requests_, reference, max_active):
    ours, runner = run_ours(tiny_av_ckpt, requests_, max_active)
    assert sorted(ours) == sorted(reference)
    # Sound and action tokens ride in the GEN half: the UND half still runs once per branch and layer.
    branches = sum(1 if r.guidance_scale == 1.0 else 2 for r in requests_)
    assert runner.apply.und_runs == branches * 2
    for rid, (latent_out, np_out) in reference.items():
        assert torch.equal(ours[rid].latents, latent_out.video), rid
        assert np.array_equal(ours[rid].frames, np_out.video), rid
        if latent_out.sound is None:
            assert ours[rid].sound is None, rid
        else:
            assert ours[rid].sample_rate == 48000 and ours[rid].sound.shape[0] == 2, rid  # 48 kHz stereo
            assert torch.equal(ours[rid].sound, latent_out.sound), rid
            assert torch.equal(ours[rid].sound, np_out.sound), rid
        if latent_out.action is None:
            assert ours[rid].actions is None, rid
        else:
            assert ours[rid].actions.dtype == torch.float32, rid
            assert torch.equal(ours[rid].actions, latent_out.action[0]), rid


def test_mode_cases_differ(reference):
    # Guards the test: each knob must change the output, or the cases above would prove nothing.
    latents = {rid: outs[0].video for rid, outs in reference.items()}
    assert not torch.equal(latents["v2v-first"], latents["v2v-last"])
    assert not torch.equal(latents["sys-off"], latents["sys-on"])
    # Sound tokens attend with the vision tokens: with and without sound, the same request differs.
    assert not torch.equal(latents["t2v-sound"], latents["t2v-silent"])
    assert reference["t2v-sound"][0].sound.abs().max() > 0


def test_actions_have_the_domains_width(reference):
    assert reference["fd-image"][0].action is None and reference["fd-npy-video"][0].action is None
    assert reference["inverse"][0].action[0].shape == (8, 10)
    assert reference["policy-fractal"][0].action[0].shape == (4, 10)
    assert reference["policy-hands"][0].action[0].shape == (4, 57)
    assert reference["policy-fractal"][0].action[0].abs().max() > 0


def test_system_prompt_default_is_the_checkpoints(tiny_ckpt, requests_):
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.model.prompts import build_helper, load_tokenizer, tokenize

    checkpoint = Checkpoint.open(tiny_ckpt)
    helper = build_helper(checkpoint, load_tokenizer(checkpoint))
    on = next(r for r in requests_ if r.id == "sys-on")
    default = dataclasses.replace(on, system_prompt=None)
    off = next(r for r in requests_ if r.id == "sys-off")
    assert tokenize(helper, default) == tokenize(helper, on)  # the tiny checkpoint's default is on
    assert len(tokenize(helper, off)[0]) < len(tokenize(helper, on)[0])
