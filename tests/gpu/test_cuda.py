"""Runs only where CUDA exists (a lent GPU): the CUDA backend for real, against resident on the same GPU."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import write_jsonl
from tests.dist.jobs import JOB_PYTHON

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROWS = [
    {"id": "img", "prompt": "a cube", "num_frames": 1, "size": "64x64", "num_inference_steps": 3, "seed": 1},
    {"id": "vid", "prompt": "waves", "num_frames": 9, "size": "64x48", "num_inference_steps": 3, "seed": 2},
]


def run(tiny_ckpt, prompts, out, offload):
    cmd = [JOB_PYTHON, "-m", "cosmos3_batch", "run", str(prompts), "--model", str(tiny_ckpt)]
    cmd += ["--out", str(out), "--offload", offload, "--device", "cuda", "--save-latents", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("offload", ["allgather", "local", "sharded"])
def test_cuda_modes_match_resident_on_the_same_gpu(tmp_path, tiny_ckpt, offload):
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    run(tiny_ckpt, prompts, tmp_path / "resident", "resident")
    summary = run(tiny_ckpt, prompts, tmp_path / offload, offload)
    for row in ROWS:
        name = f"{row['id']}.latents.safetensors"
        expected = load_file(tmp_path / "resident" / name)["latents"]
        assert torch.equal(load_file(tmp_path / offload / name)["latents"], expected), row["id"]
    rank = summary["ranks"][0]
    assert rank["fetches"] == 2 * (rank["passes"] + rank["und_passes"])


def test_pinned_region_registers_exactly(tmp_path):
    from cosmos3_batch.engine.cuda_backend import PinnedRegion

    arena = torch.zeros(3 * 2**20 + 17, dtype=torch.uint8)  # not a power of two on purpose
    region = PinnedRegion.of_tensor(arena)
    assert arena.is_pinned()
    region.close()
    assert not arena.is_pinned()
