"""Checkpoint folders as NVIDIA ships them (DESIGN.md §18): a folder NVIDIA's converter wrote (the
understanding tower `vision_encoder/`, a root `config.json` and a root `model.safetensors.index.json` pointing
into `transformer/` and `vision_encoder/`) runs as the plain folder does, reading `transformer/`'s own index
and nothing generation does not use; a distilled folder without model_index.json resolves from an HF repo
id (offline cache) and runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.checkpoint.hub import resolve_model
from tests.conftest import write_jsonl
from tests.dist.jobs import run_here

REQUESTS = [
    {"id": "img", "prompt": "a red cube", "size": "32x32", "num_frames": 1, "num_inference_steps": 2,
     "seed": 1},
    {"id": "vid", "prompt": "a cat", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 2},
]  # fmt: skip


def converter_layout(tiny_ckpt: Path, root: Path) -> Path:
    """The tiny checkpoint as NVIDIA's converter lays a release out: extra tower, root config and index."""
    shutil.copytree(tiny_ckpt, root)
    tower = root / "vision_encoder"
    tower.mkdir()
    save_file({"patch_embed.weight": torch.ones(4, 4)}, tower / "model.safetensors")
    (tower / "config.json").write_text(json.dumps({"model_type": "cosmos3_vision", "hidden_size": 4}))
    (root / "config.json").write_text(json.dumps({"model_type": "cosmos3_omni", "architectures": ["X"]}))
    weights = {
        name: "transformer/diffusion_pytorch_model.safetensors" for name in ("layers.0.x", "norm.weight")
    }
    weights["vision_encoder.patch_embed.weight"] = "vision_encoder/model.safetensors"
    index = {"metadata": {"total_size": 1}, "weight_map": weights}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def test_a_converter_written_folder_runs_as_the_plain_one(tiny_ckpt, tmp_path):
    folder = converter_layout(tiny_ckpt, tmp_path / "release")
    # Read through transformer/'s own index: the root index (naming tensors that exist nowhere) is never
    # opened. The identity still counts every component folder, as it always has: outputs resume.
    names = [Checkpoint.open(root).store("transformer").names() for root in (folder, tiny_ckpt)]
    assert names[0] == names[1]
    prompts = write_jsonl(tmp_path / "p.jsonl", REQUESTS)
    for model, out in ((tiny_ckpt, tmp_path / "plain"), (folder, tmp_path / "converted")):
        assert (
            run_here(["run", prompts, "--model", model, "--out", out, "--save-latents", "--no-progress"]) == 0
        )
    for rid in ("img", "vid"):
        plain = load_file(tmp_path / "plain" / f"{rid}.latents.safetensors")["latents"]
        assert torch.equal(load_file(tmp_path / "converted" / f"{rid}.latents.safetensors")["latents"], plain)
    assert (tmp_path / "plain" / "img.png").read_bytes() == (tmp_path / "converted" / "img.png").read_bytes()


def test_a_distilled_repo_id_resolves_without_model_index(tiny_distilled_ckpt, tmp_path, monkeypatch):
    commit = "c" * 40
    repo = tmp_path / "hub" / "models--nvidia--Cosmos3-Super-Text2Image-4Step"
    shutil.copytree(tiny_distilled_ckpt, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = resolve_model("nvidia/Cosmos3-Super-Text2Image-4Step")
    assert (source.path.name, source.commit) == (commit, commit)
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "img", "prompt": "x", "size": "32x32", "num_frames": 1}]
    )
    out = tmp_path / "out"
    args = ["run", prompts, "--model", "nvidia/Cosmos3-Super-Text2Image-4Step", "--out", out, "--no-progress"]
    assert run_here(args) == 0
    sidecar = json.loads((out / "img.json").read_text())
    assert sidecar["model_commit"] == commit and sidecar["request"]["num_inference_steps"] == 4
