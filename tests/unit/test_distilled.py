"""4-step distilled checkpoints (DESIGN.md §18) against diffusers' `Cosmos3DistilledModularPipeline`: T2I,
T2V, I2V and V2V through our pass loop bit-exact on CPU (latents and frames), float32 and bf16 as stored,
at --max-active 1 and 4; the sampler and defaults come from the folder; what a distilled checkpoint fixes
is refused before anything loads (exit 2, line and field named)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.model.tiny import TinySpec, write_tiny
from cosmos3_batch.model.tiny_kinds import TINY_DISTILLED_SIGMAS
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.reference import distilled_kwargs, distilled_reference
from tests.unit.test_fidelity import run_ours

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA

CLIP = Path(__file__).resolve().parents[2] / "examples" / "clip.mp4"
SMALL = {"size": "48x32", "num_frames": 9}
CASES = [
    {"id": "t2i", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "seed": 7},
    {"id": "t2v", "prompt": "a cat walks", **SMALL, "seed": 1},
    {"id": "i2v", "prompt": "the scene moves", **SMALL, "image": "IMAGE", "seed": 3},
    {"id": "v2v", "prompt": "the clip goes on", **SMALL, "video": str(CLIP), "seed": 11},
    {"id": "v2v-last", "prompt": "a slow pan", **SMALL, "video": str(CLIP), "condition_video_keep": "last",
     "condition_frames": [0], "seed": 12, "num_inference_steps": 4, "guidance_scale": 1.0},
]  # fmt: skip


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def checkpoint(request, tiny_distilled_ckpt, tmp_path_factory):
    if request.param == "float32":
        return tiny_distilled_ckpt
    folder = tmp_path_factory.mktemp("bf16") / "tiny-4step-bf16"
    return write_tiny(folder, TinySpec(distilled=True, dtype="bfloat16"))


@pytest.fixture(scope="module")
def requests_(checkpoint, cond_image, tmp_path_factory):
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.model.limits import limits_for

    rows = [{**c, "image": str(cond_image)} if c.get("image") else c for c in CASES]
    path = write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", rows)
    requests, errors = load_requests(str(path), limits_for(Checkpoint.open(checkpoint), 65536))
    assert errors == []
    return requests


@pytest.fixture(scope="module")
def reference(checkpoint, requests_):
    dtype = torch.bfloat16 if "bf16" in checkpoint.name else torch.float32
    pipe = distilled_reference(checkpoint, dtype)
    out = {}
    for r in requests_:
        results = []
        for output_type in ("latent", "np"):
            generator = torch.Generator("cpu").manual_seed(r.seed)
            results.append(
                pipe(**distilled_kwargs(r), generator=generator, output_type=output_type, output="videos")
            )
        out[r.id] = tuple(results)
    return out


def test_requests_take_the_checkpoints_schedule_and_guidance(requests_):
    assert {(r.num_inference_steps, r.guidance_scale, r.negative_prompt) for r in requests_} == {
        (4, 1.0, None)
    }


@pytest.mark.parametrize("max_active", [1, 4])
def test_bit_exact_with_the_distilled_modular_pipeline(checkpoint, requests_, reference, max_active):
    ours, runner = run_ours(checkpoint, requests_, max_active)
    assert sorted(ours) == sorted(reference)
    for rid, (ref_latents, ref_frames) in reference.items():
        assert torch.equal(ours[rid].latents, ref_latents.float()), rid
        expected = np.asarray(ref_frames)  # [1, T, H, W, 3]; an image: [1, H, W, 3]
        assert np.array_equal(ours[rid].frames, expected.reshape(ours[rid].frames.shape)), rid
        assert expected.size == ours[rid].frames.size
    # One branch per step: 4 forwards per request, however many share a pass; one UND prefill each.
    layers = runner.ctx.split.num_layers
    assert (runner.apply.gen_runs, runner.apply.und_runs) == (
        4 * layers * len(requests_),
        layers * len(requests_),
    )


def test_a_distilled_folder_declares_its_sampler_and_defaults(tiny_distilled_ckpt, tmp_path):
    """No model_index.json: the modular index's distilled_sigmas fix the steps; size and frames default to
    Cosmos3DistilledTextEncoderStep's (1280x720, 189 frames), guidance to 1.0."""
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.model.limits import limits_for

    checkpoint = Checkpoint.open(tiny_distilled_ckpt)
    assert not (tiny_distilled_ckpt / "model_index.json").exists()
    assert (checkpoint.sampler.kind, checkpoint.sampler.sigmas) == ("euler", tuple(TINY_DISTILLED_SIGMAS))
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "v", "prompt": "x"}, {"id": "i", "prompt": "x", "num_frames": 1}]
    )
    (video, image), errors = load_requests(str(path), limits_for(checkpoint, 10**6))
    assert errors == []
    for r in (video, image):
        assert (r.width, r.height, r.num_inference_steps, r.guidance_scale) == (1280, 720, 4, 1.0)
    assert (video.num_frames, image.num_frames, video.fps) == (189, 1, 24.0)


REFUSED = [
    ({"guidance_scale": 4.0}, "guidance_scale", "guidance is baked into"),
    ({"num_inference_steps": 8}, "num_inference_steps", "fixed at 4 steps"),
    ({"negative_prompt": "blurry"}, "negative_prompt", "no unconditional branch"),
    ({"flow_shift": 3.0}, "flow_shift", "sigmas are fixed"),
    ({"sound": True, "size": "32x32", "num_frames": 5}, "sound", "images and videos only"),
]


@pytest.mark.parametrize(("fields", "field", "why"), REFUSED)
def test_what_a_distilled_checkpoint_fixes_is_refused_before_loading(
    tiny_distilled_ckpt, tmp_path, fields, field, why
):
    rows = [
        {"id": "ok", "prompt": "x", "size": "32x32", "num_frames": 1},
        {"id": "bad", "prompt": "x", **fields},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    for command in (["run", str(prompts), "--out", str(tmp_path / "out")], ["plan", str(prompts)]):
        result = CliRunner().invoke(app, [*command, "--model", str(tiny_distilled_ckpt)])
        assert result.exit_code == 2, result.output
        assert f"line 2, field '{field}': " in result.output and why in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_an_action_request_on_a_distilled_checkpoint_is_refused(tiny_distilled_ckpt, tmp_path, cond_image):
    action = {"mode": "policy", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256}
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "image": str(cond_image), "action": action}])
    result = CliRunner().invoke(app, ["plan", str(prompts), "--model", str(tiny_distilled_ckpt)])
    assert result.exit_code == 2 and "line 1, field 'action': " in result.output, result.output


def scheduler_says(folder: Path, name: str) -> None:
    path = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "_class_name": name}))


def test_a_sampler_the_reference_does_not_use_is_refused_by_name(tiny_ckpt, tiny_distilled_ckpt, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "size": "32x32", "num_frames": 1}])
    cases = {}
    base = shutil.copytree(tiny_ckpt, tmp_path / "euler-ancestral")
    scheduler_says(base, "EulerAncestralDiscreteScheduler")
    cases[base] = "scheduler 'EulerAncestralDiscreteScheduler' is not one the reference pipelines run"
    lone = shutil.copytree(tiny_ckpt, tmp_path / "flow-match-base")
    scheduler_says(lone, "FlowMatchEulerDiscreteScheduler")
    cases[lone] = "FlowMatchEulerDiscreteScheduler without a distilled schedule"
    nosigmas = shutil.copytree(tiny_distilled_ckpt, tmp_path / "no-sigmas")
    index = json.loads((nosigmas / "modular_model_index.json").read_text())
    (nosigmas / "modular_model_index.json").write_text(json.dumps({**index, "distilled_sigmas": None}))
    cases[nosigmas] = "a distilled checkpoint needs distilled_sigmas"
    for folder, message in cases.items():
        for command in (["run", str(prompts), "--out", str(tmp_path / "out")], ["plan", str(prompts)]):
            result = CliRunner().invoke(app, [*command, "--model", str(folder)])
            assert result.exit_code == 2, result.output
            assert message in result.output and str(folder) in result.output, result.output
    assert not (tmp_path / "out").exists()
