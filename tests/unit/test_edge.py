"""Cosmos3-Edge (DESIGN.md §18): the Nemotron backbone (`hidden_act` relu2: an MLP without a gate projection,
Nemotron RMSNorms, the UND k-norm for GEN) through our split forward and pass loop equals
`Cosmos3OmniPipeline.__call__` bit for bit on CPU in every mode Edge's config allows, at --max-active 1
and 3; Edge's request defaults (640x640 images, 832x480 videos, guidance 5.0, flow shift 3.0); FP8
conversion names the linears the built model has. tests/dist/test_checkpoints.py runs it under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.model.limits import limits_for
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.reference import reference_kwargs
from tests.unit.test_fidelity import run_ours

pytestmark = pytest.mark.exact  # run twice by scripts/test.sh: the second time under a lower ISA

CLIP = Path(__file__).resolve().parents[2] / "examples" / "clip.mp4"
SMALL = {"size": "48x32", "num_frames": 9, "num_inference_steps": 3}
CASES = [
    {"id": "t2i", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 3,
     "seed": 7},
    {"id": "t2v", "prompt": "a cat walks", "negative_prompt": "blurry", **SMALL, "seed": 1},
    {"id": "t2v-nocfg", "prompt": "a dog runs", **SMALL, "guidance_scale": 1.0, "seed": 2},
    {"id": "i2v", "prompt": "the scene moves", **SMALL, "image": "IMAGE", "seed": 3},
    {"id": "v2v", "prompt": "the clip goes on", **SMALL, "video": str(CLIP), "seed": 11},
]  # fmt: skip


@pytest.fixture(scope="module")
def requests_(tiny_edge_ckpt, cond_image, tmp_path_factory):
    rows = [{**c, "image": str(cond_image)} if c.get("image") else c for c in CASES]
    path = write_jsonl(tmp_path_factory.mktemp("req") / "p.jsonl", rows)
    requests, errors = load_requests(str(path), limits_for(Checkpoint.open(tiny_edge_ckpt), 65536))
    assert errors == []
    return requests


def test_edge_defaults_are_its_recipes(tiny_edge_ckpt, tmp_path):
    rows = [{"id": "i", "prompt": "x", "num_frames": 1}, {"id": "v", "prompt": "x"}]
    limits = limits_for(Checkpoint.open(tiny_edge_ckpt), 10**6)
    (image, video), errors = load_requests(str(write_jsonl(tmp_path / "p.jsonl", rows)), limits)
    assert errors == []
    assert (image.width, image.height, video.width, video.height) == (640, 640, 832, 480)
    assert {(r.guidance_scale, r.flow_shift) for r in (image, video)} == {(5.0, 3.0)}
    assert (image.num_inference_steps, video.num_inference_steps, video.num_frames) == (50, 35, 189)


def test_edge_bit_exact_with_the_reference_pipeline(tiny_edge_ckpt, requests_):
    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_edge_ckpt)
    pipe.set_progress_bar_config(disable=True)
    base = dict(pipe.scheduler.config)
    reference = {}
    for r in requests_:
        pipe.scheduler = UniPCMultistepScheduler.from_config(base, flow_shift=r.flow_shift)
        generator = torch.Generator("cpu").manual_seed(r.seed)
        reference[r.id] = pipe(**reference_kwargs(r), generator=generator, output_type="latent").video
    for max_active in (1, 3):
        ours, _ = run_ours(tiny_edge_ckpt, requests_, max_active)
        for rid, latents in reference.items():
            assert torch.equal(ours[rid].latents, latents), (rid, max_active)


def test_fp8_conversion_takes_the_linears_the_built_model_has(tiny_edge_ckpt):
    """relu2 has no gate projection: the names come from the model, never from a fixed list."""
    names = decoder_linear_weights(Checkpoint.open(tiny_edge_ckpt).config("transformer"))
    assert not any("gate_proj" in name for name in names)
    assert {name.split(".", 2)[2] for name in names if name.startswith("layers.0.")} >= {
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
