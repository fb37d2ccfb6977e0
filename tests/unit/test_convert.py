"""`convert --fp8`: the layout written, what is copied untouched, and refusals (exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.checkpoint.fp8_format import AMAX, FP8, SCALE, quantize_per_tensor
from cosmos3_batch.cli import app
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.model.tiny import TinySpec, write_tiny

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("bf16") / "tiny", TinySpec(dtype="bfloat16"))


@pytest.mark.parametrize("source", ["tiny_ckpt", "bf16_ckpt"])
def test_layout(source: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    src = request.getfixturevalue(source)
    dst = tmp_path / "fp8"
    report = convert_fp8(src, dst, decoder_linear_weights)
    before, after = load_file(src / WEIGHTS), load_file(dst / WEIGHTS)
    config = json.loads((dst / "transformer" / "config.json").read_text())
    targets = decoder_linear_weights(config)
    assert report.quantized == len(targets) == 2 * 14  # 2 layers x (8 attention + 6 MLP) linears
    assert all(name.startswith("layers.") for name in targets)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_type"] == "FP8"
    assert qc["runtime"]["diffusion_step_policy"]["type"] == "first_last_n"
    for name, tensor in before.items():
        if name in targets:
            q, amax, scale = quantize_per_tensor(tensor)
            base = name.removesuffix(".weight")
            assert after[name].dtype == FP8
            assert torch.equal(after[name].view(torch.uint8), q.view(torch.uint8)), name
            assert after[f"{base}.{SCALE}"].dtype == tensor.dtype and after[f"{base}.{SCALE}"].shape == ()
            assert torch.equal(after[f"{base}.{SCALE}"], scale) and torch.equal(after[f"{base}.{AMAX}"], amax)
        else:
            assert torch.equal(after[name], tensor), name  # copied untouched
    added = {f"{n.removesuffix('.weight')}.{s}" for n in targets for s in (AMAX, SCALE)}
    assert set(after) == set(before) | added
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if path.is_file() and rel.parts[0] != "transformer" and not rel.name.startswith(".written-by"):
            assert (dst / rel).read_bytes() == path.read_bytes(), rel
    assert report.target_bytes < report.source_bytes


def test_refusals(tiny_ckpt: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["convert", str(tiny_ckpt), str(busy), "--fp8"])
    assert result.exit_code == 2 and "not an empty folder" in result.output
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"]
    result = runner.invoke(app, ["convert", str(tiny_ckpt), str(tmp_path / "x")])
    assert result.exit_code == 2 and "--fp8" in result.output
    done = tmp_path / "done"
    assert runner.invoke(app, ["convert", str(tiny_ckpt), str(done), "--fp8"]).exit_code == 0
    result = runner.invoke(app, ["convert", str(done), str(tmp_path / "again"), "--fp8"])
    assert result.exit_code == 2 and "already quantized" in result.output
    assert not (tmp_path / "again").exists()
