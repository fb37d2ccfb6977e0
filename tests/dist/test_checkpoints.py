"""Every checkpoint kind under real torchrun (world 2, gloo, CPU), in one launch (tests/dist/jobs.py): the
4-step distilled folder (float32 and bf16 as stored, allgather and local, --max-active 1 and 4) equals
`Cosmos3DistilledModularPipeline`; the Edge backbone in every offload mode, under --sp 2, with batched
branches and converted to FP8 equals `Cosmos3OmniPipeline` (diffusers' W8A16 linear for FP8); every rank
issues the same collectives, and a distilled request runs 4 forwards of one branch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.model.limits import limits_for
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.model.tiny import TinySpec, write_tiny
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.dist.jobs import torchrun_jobs
from tests.fp8_reference import reference_latents
from tests.reference import distilled_kwargs, distilled_reference

pytestmark = pytest.mark.dist

CLIP = Path(__file__).resolve().parents[2] / "examples" / "clip.mp4"
SMALL = {"size": "48x32", "num_frames": 9}
DISTILLED_ROWS = [
    {"id": "t2i", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "seed": 7},
    {"id": "t2v", "prompt": "a cat walks", **SMALL, "seed": 1},
    {"id": "i2v", "prompt": "the scene moves", **SMALL, "image": "IMAGE", "seed": 3},
    {"id": "v2v", "prompt": "the clip goes on", **SMALL, "video": str(CLIP), "seed": 11},
]
# Edge: batched branches are exact where every branch has >= 16 rows (docs/numerics.md): 128 px sides.
EDGE_ROWS = [
    {"id": "e-img", "prompt": "a red cube", "size": "128x128", "num_frames": 1, "num_inference_steps": 2,
     "seed": 4},
    {"id": "e-vid", "prompt": "a cat", "negative_prompt": "blur", "size": "128x128", "num_frames": 5,
     "num_inference_steps": 3, "seed": 5},
    {"id": "e-i2v", "prompt": "it moves", "size": "128x96", "num_frames": 5, "image": "IMAGE",
     "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 6},
]  # fmt: skip


def one_thread(fn):
    """The references at one thread, as torchrun's workers run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def requests_for(ckpt: Path, prompts: Path):
    requests, errors = load_requests(str(prompts), limits_for(Checkpoint.open(ckpt), 65536))
    assert errors == []
    return requests


def distilled_latents(ckpt: Path, prompts: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    def run():
        pipe = distilled_reference(ckpt, dtype)
        out = {}
        for r in requests_for(ckpt, prompts):
            generator = torch.Generator("cpu").manual_seed(r.seed)
            state = pipe(**distilled_kwargs(r), generator=generator, output_type="latent")
            out[r.id] = state.get("videos").float()
        return out

    return one_thread(run)


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, tiny_distilled_ckpt, tiny_edge_ckpt, cond_image):
    folder = tmp_path_factory.mktemp("kinds")
    image = {"image": str(cond_image)}
    distilled_rows = [{**r, **image} if r.get("image") else r for r in DISTILLED_ROWS]
    edge_rows = [{**r, **image} if r.get("image") else r for r in EDGE_ROWS]
    distilled_prompts = write_jsonl(folder / "distilled.jsonl", distilled_rows)
    edge_prompts = write_jsonl(folder / "edge.jsonl", edge_rows)
    bf16 = write_tiny(folder / "tiny-4step-bf16", TinySpec(distilled=True, dtype="bfloat16"))
    fp8 = folder / "tiny-edge-fp8"
    convert_fp8(tiny_edge_ckpt, fp8, decoder_linear_weights)
    edge_requests = requests_for(tiny_edge_ckpt, edge_prompts)
    edge_ref = one_thread(lambda: reference_latents(tiny_edge_ckpt, None, edge_requests))
    fp8_ref = one_thread(lambda: reference_latents(tiny_edge_ckpt, fp8, edge_requests))
    return {
        "distilled": (
            tiny_distilled_ckpt,
            distilled_prompts,
            distilled_latents(tiny_distilled_ckpt, distilled_prompts, torch.float32),
        ),
        "distilled-bf16": (
            bf16,
            distilled_prompts,
            distilled_latents(bf16, distilled_prompts, torch.bfloat16),
        ),
        "edge": (tiny_edge_ckpt, edge_prompts, edge_ref),
        "edge-fp8": (fp8, edge_prompts, fp8_ref),
    }


JOBS = [  # (name, kind, flags)
    ("distilled-allgather-1", "distilled", ["--offload", "allgather", "--max-active", "1"]),
    ("distilled-allgather-4", "distilled", ["--offload", "allgather", "--max-active", "4"]),
    ("distilled-local-4", "distilled", ["--offload", "local", "--max-active", "4"]),
    ("distilled-bf16-4", "distilled-bf16", ["--offload", "allgather", "--max-active", "4"]),
    ("edge-allgather", "edge", ["--offload", "allgather", "--max-active", "3"]),
    ("edge-local", "edge", ["--offload", "local", "--max-active", "2"]),
    ("edge-sharded", "edge", ["--offload", "sharded", "--max-active", "3"]),
    ("edge-resident", "edge", ["--offload", "resident", "--max-active", "1"]),
    ("edge-sp2", "edge", ["--sp", "2", "--max-active", "2"]),
    ("edge-batched", "edge", ["--batch-branches", "--max-active", "3"]),
    ("edge-fp8", "edge-fp8", ["--offload", "allgather", "--fp8-compute", "a16", "--max-active", "3"]),
]


def test_every_checkpoint_kind_is_bit_exact_under_torchrun(kinds, tmp_path):
    jobs = []
    for name, kind, flags in JOBS:
        ckpt, prompts, _ = kinds[kind]
        jobs.append(
            [
                "run",
                prompts,
                "--model",
                ckpt,
                "--out",
                tmp_path / name,
                *flags,
                "--save-latents",
                "--no-progress",
            ]
        )
    codes = torchrun_jobs(2, jobs, tmp_path / "launch")
    for (name, kind, _), code in zip(JOBS, codes, strict=True):
        assert code == 0, (name, (tmp_path / "launch" / "stderr.txt").read_text()[-3000:])
        _, _, reference = kinds[kind]
        out = tmp_path / name
        for rid, latents in reference.items():
            assert torch.equal(load_file(out / f"{rid}.latents.safetensors")["latents"], latents), (name, rid)
        summary = json.loads((out / "summary.json").read_text())
        ranks = summary["ranks"]
        assert len({r["collective_trace"] for r in ranks}) == 1, name  # lockstep
        if kind.startswith("distilled"):  # 4 forwards of one branch per request, 2 layers each
            assert sum(r["gen_runs"] for r in ranks) == 4 * 2 * len(reference), name
