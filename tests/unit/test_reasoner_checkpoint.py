"""`make-tiny --reasoner` (issue 44 item 2): transformers loads the folder as
Cosmos3OmniForConditionalGeneration over the transformer's own file (no second copy of a weight), and a
folder without the reasoner's parts is refused with exit 2 naming each of them, before anything is loaded."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.checkpoint.reasoner_parts import missing_parts, vision_files
from cosmos3_batch.cli import app
from tests.conftest import write_jsonl


def test_transformers_loads_the_tiny_reasoner_over_the_transformer_file(tiny_reasoner_ckpt):
    from transformers import Cosmos3OmniForConditionalGeneration

    assert missing_parts(tiny_reasoner_ckpt) == ()
    index = json.loads((tiny_reasoner_ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        "transformer/diffusion_pytorch_model.safetensors",
        "vision_encoder/model.safetensors",
    }
    assert list(vision_files(tiny_reasoner_ckpt)) == ["vision_encoder/model.safetensors"]
    model = Cosmos3OmniForConditionalGeneration.from_pretrained(tiny_reasoner_ckpt)
    stored = load_file(tiny_reasoner_ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    layer = model.model.language_model.layers[1]
    assert torch.equal(layer.self_attn.q_proj.weight, stored["layers.1.self_attn.to_q.weight"])
    assert torch.equal(layer.self_attn.k_norm.weight, stored["layers.1.self_attn.norm_k.weight"])
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    config = json.loads((tiny_reasoner_ckpt / "config.json").read_text())
    tokens = json.loads((tiny_reasoner_ckpt / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tokens}
    assert (
        config["image_token_id"] == ids["<|image_pad|>"] and config["video_token_id"] == ids["<|video_pad|>"]
    )
    assert config["text_config"]["vocab_size"] == len(ids) + 256


def test_a_checkpoint_without_the_reasoner_parts_exits_2_naming_them(tiny_ckpt, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "r", "prompt": "Describe.", "reason": {}}])
    args = ["run", str(prompts), "--model", str(tiny_ckpt), "--out", str(tmp_path / "out"), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    for part in ("config.json of type cosmos3_omni", "the ViT's weights", "preprocessor_config.json"):
        assert part in result.output
    assert not (tmp_path / "out" / "r.txt").exists()


def test_fp8_and_edge_transformers_are_named(tiny_reasoner_ckpt, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_reasoner_ckpt, tmp_path / "copy")
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "hidden_act": "relu2", "quantization_config": {"x": 1}}))
    found = missing_parts(folder)
    assert len(found) == 2 and "FP8" in found[0] and "Edge" in found[1]
