"""A damaged checkpoint stops `run` with exit 2 and an error naming the file (and tensor), before any
weight is loaded and before anything is written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.pipeline.job import load as job_load
from cosmos3_batch.pipeline.job import run as job
from tests.conftest import write_jsonl

REQUEST = {"id": "img", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = f"{WEIGHTS}.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
DROPPED = "layers.1.mlp.down_proj.weight"  # a tensor the damages drop or move (it sorts into shard 1)


@pytest.fixture(autouse=True)
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("got past planning with a checkpoint that should have been rejected")

    monkeypatch.setattr(job_load, "load_context", refuse)
    monkeypatch.setattr(job_load, "build_weights", refuse)
    monkeypatch.setattr(job, "_check_same_plan", refuse)  # the first collective after planning


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def remove_vae(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "vae")


def remove_tokenizer(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "text_tokenizer")


def truncate_half(ckpt: Path) -> None:
    path = ckpt / "transformer" / WEIGHTS
    _truncate(path, path.stat().st_size // 2)


def truncate_header(ckpt: Path) -> None:
    _truncate(ckpt / "transformer" / WEIGHTS, 4)


def corrupt_header(ckpt: Path) -> None:
    with open(ckpt / "vae" / WEIGHTS, "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 16)


def remove_weights(ckpt: Path) -> None:
    (ckpt / "vae" / WEIGHTS).unlink()


def shrink_intermediate(ckpt: Path) -> None:
    path = ckpt / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["intermediate_size"] = 96  # the tensors stay 128 wide
    path.write_text(json.dumps(config))


def drop_tensor(ckpt: Path) -> None:
    path = ckpt / "transformer" / WEIGHTS
    tensors = load_file(path)
    del tensors[DROPPED]
    save_file(tensors, path)


def shard(ckpt: Path, edit: Callable[[dict[str, str], dict[str, dict]], None] = lambda m, s: None) -> None:
    """Re-save the transformer as two shards plus an index; `edit(weight_map, shards)` damages them."""
    folder = ckpt / "transformer"
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    names = sorted(tensors)
    weight_map = {name: SHARDS[i * 2 // len(names)] for i, name in enumerate(names)}
    shards: dict[str, dict] = {file: {} for file in SHARDS}
    for name, file in weight_map.items():
        shards[file][name] = tensors[name]
    edit(weight_map, shards)
    for file, part in shards.items():
        if part:
            save_file(part, folder / file)
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def index_points_at_wrong_file(ckpt: Path) -> None:
    def edit(weight_map: dict[str, str], shards: dict[str, dict]) -> None:
        assert weight_map[DROPPED] == SHARDS[0]
        weight_map[DROPPED] = SHARDS[1]  # the tensor stays in shard 1

    shard(ckpt, edit)


def index_names_missing_file(ckpt: Path) -> None:
    def edit(weight_map: dict[str, str], shards: dict[str, dict]) -> None:
        shards[SHARDS[1]] = {}  # not written at all

    shard(ckpt, edit)


def index_lacks_entry(ckpt: Path) -> None:
    shard(ckpt, lambda weight_map, shards: weight_map.pop(DROPPED))


def index_lacks_tensor_everywhere(ckpt: Path) -> None:
    def edit(weight_map: dict[str, str], shards: dict[str, dict]) -> None:
        del shards[weight_map.pop(DROPPED)][DROPPED]

    shard(ckpt, edit)


T = "{ckpt}/transformer"
CASES = [
    pytest.param(remove_vae, ["component folder 'vae/' is missing", "{ckpt}"], id="missing-vae-folder"),
    pytest.param(remove_tokenizer, ["component folder 'text_tokenizer/' is missing"], id="missing-tokenizer"),
    pytest.param(remove_weights, ["{ckpt}/vae: no safetensors files"], id="missing-weights-file"),
    pytest.param(truncate_half, [f"{T}/{WEIGHTS}: truncated: tensor '", "file size"], id="truncated-half"),
    pytest.param(truncate_header, [f"{T}/{WEIGHTS}: truncated (4 bytes, no header)"], id="truncated-header"),
    pytest.param(
        corrupt_header, [f"{{ckpt}}/vae/{WEIGHTS}: corrupt safetensors header"], id="corrupt-header"
    ),
    pytest.param(
        shrink_intermediate,
        [f"{T}/{WEIGHTS}: tensor 'layers.0.mlp.gate_proj.weight' has shape (128, 64)", "implies (96, 64)"],
        id="shape-disagrees-with-config",
    ),
    pytest.param(drop_tensor, [T, f"tensor '{DROPPED}' is missing from the checkpoint"], id="tensor-missing"),
    pytest.param(
        index_points_at_wrong_file,
        [f"{T}/{SHARDS[1]}: index lists tensor '{DROPPED}' but the file lacks it"],
        id="index-points-at-wrong-file",
    ),
    pytest.param(
        index_names_missing_file, [f"{T}/{SHARDS[1]}: listed in {INDEX} but missing"], id="shard-file-missing"
    ),
    pytest.param(index_lacks_entry, [T, f"tensor '{DROPPED}' is missing"], id="index-lacks-entry"),
    pytest.param(
        index_lacks_tensor_everywhere, [T, f"tensor '{DROPPED}' is missing"], id="tensor-missing-sharded"
    ),
]


@pytest.mark.parametrize(("damage", "expected"), CASES)
def test_damaged_checkpoint_exits_2_naming_file_and_tensor(
    tmp_path: Path, tiny_ckpt: Path, damage: Callable[[Path], None], expected: list[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    damage(ckpt)
    prompts = write_jsonl(tmp_path / "p.jsonl", [REQUEST])
    out = tmp_path / "out"
    args = ["run", prompts, "--model", ckpt, "--out", out, "--no-progress"]
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    output = result.output.replace("\n", " ")
    for text in expected:
        assert text.format(ckpt=ckpt) in output, result.output
    assert not out.exists() or not any(out.rglob("*"))


def test_intact_sharded_checkpoint_passes_validation(tmp_path: Path, tiny_ckpt: Path) -> None:
    """The sharded copy the damages start from is itself valid: the failures above are the damage's."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    shard(ckpt)
    prompts = write_jsonl(tmp_path / "p.jsonl", [REQUEST, {"prompt": "x", "seed": True}])
    args = ["run", prompts, "--model", ckpt, "--out", tmp_path / "out", "--no-progress"]
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 2 and "line 2, field 'seed'" in result.output  # got past the checkpoint
