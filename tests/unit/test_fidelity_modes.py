"""The generation modes beyond T2I/T2V/I2V against `Cosmos3OmniPipeline.__call__`: bit-exact in float32 on
CPU, all in one job, whatever `--max-active`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
from diffusers.utils import load_video
from PIL import Image

from cosmos3_batch.requests import Request, load_requests
from tests.conftest import write_jsonl
from tests.unit.test_fidelity import run_ours

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


@pytest.fixture(scope="module")
def requests_(tmp_path_factory) -> list[Request]:
    rows = [{**c, "video": str(CLIP)} if c.get("video") else c for c in CASES]
    rows[-1]["num_inference_steps"] = 2
    requests, errors = load_requests(str(write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", rows)))
    assert errors == []
    return requests


def reference_kwargs(r: Request) -> dict:
    """The reference call for one of our requests (DESIGN.md §7), mode fields included."""
    kwargs = dict(
        prompt=r.prompt,
        negative_prompt=r.negative_prompt,
        num_frames=r.num_frames,
        height=r.height,
        width=r.width,
        fps=r.fps,
        num_inference_steps=r.num_inference_steps,
        guidance_scale=r.guidance_scale,
        add_resolution_template=r.use_resolution_template,
        add_duration_template=r.use_duration_template,
        use_system_prompt=r.system_prompt,
        enable_sound=r.sound,
    )
    if r.image is not None:
        kwargs["image"] = Image.open(r.image)
    if r.action is not None:
        for key in ("num_frames", "height", "width", "enable_sound", "image"):
            kwargs.pop(key, None)  # the reference derives them from the action (and wants them unset)
        return {**kwargs, "action": reference_action(r)}
    if r.video is not None:
        kwargs.update(
            video=load_video(r.video),
            condition_frame_indexes_vision=list(r.condition_frames),
            condition_video_keep=r.condition_video_keep,
        )
    return kwargs


def reference_action(r: Request) -> CosmosActionCondition:
    """The action condition built straight from the request's inputs (not through our loader)."""
    spec = r.action
    if isinstance(spec.actions, str):
        raw = torch.from_numpy(np.load(spec.actions))
    else:
        raw = torch.tensor(spec.actions, dtype=torch.float64) if spec.actions is not None else None
    media = {"video": load_video(r.video)} if r.video is not None else {"image": Image.open(r.image)}
    return CosmosActionCondition(
        mode=spec.mode,
        chunk_size=spec.chunk_size,
        domain_name=spec.domain,
        resolution_tier=spec.resolution_tier,
        raw_actions=raw,
        view_point=spec.viewpoint,
        **media,
    )


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
def reference(tiny_ckpt, requests_):
    return run_reference(tiny_ckpt, requests_)


@pytest.mark.parametrize("max_active", [1, 3])
def test_modes_bit_exact_with_reference_pipeline(tiny_ckpt, requests_, reference, max_active):
    ours, _ = run_ours(tiny_ckpt, requests_, max_active)
    assert sorted(ours) == sorted(reference)
    for rid, (latent_out, np_out) in reference.items():
        assert torch.equal(ours[rid].latents, latent_out.video), rid
        assert np.array_equal(ours[rid].frames, np_out.video), rid


def test_mode_cases_differ(reference):
    # Guards the test: each knob must change the output, or the cases above would prove nothing.
    latents = {rid: outs[0].video for rid, outs in reference.items()}
    assert not torch.equal(latents["v2v-first"], latents["v2v-last"])
    assert not torch.equal(latents["sys-off"], latents["sys-on"])


def test_system_prompt_default_is_the_checkpoints(tiny_ckpt, requests_):
    from cosmos3_batch.model.loading import Checkpoint
    from cosmos3_batch.pipeline.context import build_helper, load_tokenizer
    from cosmos3_batch.pipeline.denoise import tokenize

    checkpoint = Checkpoint.open(tiny_ckpt)
    helper = build_helper(checkpoint, load_tokenizer(checkpoint))
    on = next(r for r in requests_ if r.id == "sys-on")
    default = Request(**{**on.__dict__, "system_prompt": None})
    off = next(r for r in requests_ if r.id == "sys-off")
    assert tokenize(helper, default) == tokenize(helper, on)  # the tiny checkpoint's default is on
    assert len(tokenize(helper, off)[0]) < len(tokenize(helper, on)[0])


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


@pytest.fixture(scope="module")
def sound_requests(tmp_path_factory, cond_image) -> list[Request]:
    paths = {"IMAGE": str(cond_image), "CLIP": str(CLIP)}
    rows = [{k: paths.get(v, v) if isinstance(v, str) else v for k, v in c.items()} for c in SOUND_CASES]
    requests, errors = load_requests(str(write_jsonl(tmp_path_factory.mktemp("snd") / "p.jsonl", rows)))
    assert errors == []
    return requests


@pytest.fixture(scope="module")
def sound_reference(tiny_av_ckpt, sound_requests):
    return run_reference(tiny_av_ckpt, sound_requests)


@pytest.mark.parametrize("max_active", [1, 3])
def test_sound_bit_exact_with_reference_pipeline(tiny_av_ckpt, sound_requests, sound_reference, max_active):
    ours, _ = run_ours(tiny_av_ckpt, sound_requests, max_active)
    for rid, (latent_out, np_out) in sound_reference.items():
        assert torch.equal(ours[rid].latents, latent_out.video), rid
        assert np.array_equal(ours[rid].frames, np_out.video), rid
        if latent_out.sound is None:
            assert ours[rid].sound is None, rid
            continue
        assert ours[rid].sample_rate == 48000
        assert ours[rid].sound.shape[0] == 2, rid  # stereo
        assert torch.equal(ours[rid].sound, latent_out.sound), rid
        assert torch.equal(ours[rid].sound, np_out.sound), rid


def test_sound_changes_the_video(sound_reference):
    # Sound tokens attend with the vision tokens: the same request with and without sound must differ,
    # or the test above could pass with the sound stream left out of the GEN half.
    assert not torch.equal(sound_reference["t2v-sound"][0].video, sound_reference["t2v-silent"][0].video)
    assert sound_reference["t2v-sound"][0].sound.abs().max() > 0
