"""No output path resolves outside --out: hostile ids, and symlinks planted in the output folder."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.io.outputs import paths_for
from cosmos3_batch.requests.fields import LineErrors, check_id
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl

REQUEST = {"id": "img", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}
VICTIM = b"outside --out: must never change\n"


def run(tiny_ckpt: Path, prompts: Path, out: Path, *extra: str):
    args = ["run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress", *extra]
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(prompts, out, victim): `victim` lives outside --out and must keep its bytes."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [REQUEST])
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "outside" / "victim"
    victim.parent.mkdir()
    victim.write_bytes(VICTIM)
    return prompts, out, victim


@pytest.mark.parametrize("request_id", ["a", "A-b_c.d", "line000001", "x" * 128, "a.b.c", "0", "_", "-"])
@pytest.mark.parametrize("num_frames", [1, 9])
def test_paths_for_keeps_valid_ids_in_out(tmp_path: Path, request_id: str, num_frames: int) -> None:
    paths = paths_for(tmp_path, request_id, num_frames)
    suffix = "png" if num_frames == 1 else "mp4"
    assert paths.media == tmp_path.resolve() / f"{request_id}.{suffix}"
    assert paths.sidecar.name == f"{request_id}.json"
    assert {p.parent for p in (paths.media, paths.sidecar, paths.latents)} == {tmp_path.resolve()}


def test_paths_for_keeps_every_validated_id_in_out(tmp_path: Path) -> None:
    rng = random.Random(0)
    alphabet = "abcXYZ019._-/\\"
    for _ in range(2000):
        request_id = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        if check_id(LineErrors(1), {"id": request_id}, 1) is None:
            continue  # rejected by validation, never reaches paths_for
        paths = paths_for(tmp_path, request_id, 1)
        assert {p.parent for p in (paths.media, paths.sidecar, paths.latents)} == {tmp_path.resolve()}


@pytest.mark.parametrize("request_id", ["../x", "../../etc/passwd", "a/b", "/abs", "sub/../../x", "x/.."])
def test_paths_for_refuses_ids_that_escape(tmp_path: Path, request_id: str) -> None:
    with pytest.raises(ValueError, match="would write outside"):
        paths_for(tmp_path, request_id, 1)


def test_symlinked_outputs_are_replaced_not_followed(setup: tuple[Path, Path, Path], tiny_ckpt: Path) -> None:
    prompts, out, victim = setup
    names = ["img.png", "img.latents.safetensors", "metrics.csv", "summary.json"]
    for name in names:
        (out / name).symlink_to(victim)
    result = run(tiny_ckpt, prompts, out, "--save-latents")
    assert result.exit_code == 0, result.output
    assert victim.read_bytes() == VICTIM
    for name in names:
        assert not (out / name).is_symlink() and (out / name).is_file(), name


# Working files the run writes besides the final outputs; names that use the pid are predictable here
# because CliRunner runs the command in this process.
WORKING_FILES = [
    pytest.param(
        lambda pid: ".cosmos3_batch/metrics.rank0.csv",
        id="metrics-part-file",
    ),
    pytest.param(lambda pid: ".cosmos3_batch", id="state-folder"),
    pytest.param(lambda pid: ".cosmos3_batch/passes.rank0.csv", id="pass-timeline"),
    pytest.param(
        lambda pid: f".write-probe-{pid}",
        id="write-probe",
    ),
    # Leftover temporaries of the requests to generate are removed before anything is written.
    pytest.param(lambda pid: f".img.{pid}.tmp.png", id="media-temp-file"),
    pytest.param(lambda pid: f".img.{pid}.tmp.json", id="sidecar-temp-file"),
    pytest.param(lambda pid: f".img.latents.{pid}.tmp.safetensors", id="latents-temp-file"),
    pytest.param(
        lambda pid: f".summary.{pid}.tmp.json",
        id="summary-temp-file",
    ),
    pytest.param(
        lambda pid: f".metrics.{pid}.tmp.csv",
        id="metrics-csv-temp-file",
    ),
]


@pytest.mark.parametrize("name", WORKING_FILES)
def test_symlinked_working_files_are_not_followed(
    setup: tuple[Path, Path, Path], tiny_ckpt: Path, name: Callable[[int], str]
) -> None:
    prompts, out, victim = setup
    planted = out / name(os.getpid())
    planted.parent.mkdir(exist_ok=True)
    planted.symlink_to(victim)
    result = run(tiny_ckpt, prompts, out, "--save-latents")
    assert victim.read_bytes() == VICTIM
    assert result.exit_code == 0, result.output
    assert not (out / "img.png").is_symlink() and not (out / "img.json").is_symlink()


def _sidecar(prompts: Path, files: object) -> bytes:
    content_hash = load_requests(str(prompts))[0][0].content_hash()
    return json.dumps({"status": "complete", "request_hash": content_hash, "files": files}).encode()


PNG_BYTES = 4096
FORGED_SIDECARS = [
    pytest.param({"media": {"name": "img.png", "bytes": PNG_BYTES}}, id="lists-a-missing-png"),
    pytest.param(
        {},
        id="lists-no-files",
    ),
    pytest.param(
        {"media": {"name": "../outside.png", "bytes": PNG_BYTES}},
        id="lists-a-file-outside-out",
    ),
    pytest.param(
        {"media": "img.png"},
        id="malformed-files-entry",
    ),
]


@pytest.mark.parametrize("files", FORGED_SIDECARS)
def test_symlinked_sidecar_is_not_trusted_unless_it_describes_the_outputs(
    setup: tuple[Path, Path, Path], tiny_ckpt: Path, files: object
) -> None:
    prompts, out, _ = setup
    (out.parent / "outside.png").write_bytes(b"\0" * PNG_BYTES)
    forged = out.parent / "outside" / "forged.json"
    forged.write_bytes(_sidecar(prompts, files))
    (out / "img.json").symlink_to(forged)
    result = run(tiny_ckpt, prompts, out)
    assert result.exit_code == 0, result.output
    assert "1 generated, 0 failed, 0 already complete" in result.output
    assert forged.read_bytes() == _sidecar(prompts, files)
    assert not (out / "img.json").is_symlink()
    sidecar = json.loads((out / "img.json").read_text())
    assert sidecar["files"]["media"] == {"name": "img.png", "bytes": (out / "img.png").stat().st_size}


def test_symlinked_genuine_sidecar_is_trusted_and_left_alone(
    setup: tuple[Path, Path, Path], tiny_ckpt: Path
) -> None:
    prompts, out, _ = setup
    assert run(tiny_ckpt, prompts, out).exit_code == 0
    moved = out.parent / "outside" / "img.json"
    (out / "img.json").rename(moved)
    (out / "img.json").symlink_to(moved)
    before, mtime = moved.read_bytes(), (out / "img.png").stat().st_mtime_ns
    result = run(tiny_ckpt, prompts, out)
    assert result.exit_code == 0 and "0 generated, 0 failed, 1 already complete" in result.output
    assert moved.read_bytes() == before and (out / "img.png").stat().st_mtime_ns == mtime


def test_out_may_be_a_symlink_to_a_folder(tmp_path: Path, tiny_ckpt: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [REQUEST])
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    result = run(tiny_ckpt, prompts, link)
    assert result.exit_code == 0, result.output
    assert link.is_symlink()
    assert {p.name for p in target.iterdir()} >= {"img.png", "img.json", "metrics.csv", "summary.json"}
    assert json.loads((target / "img.json").read_text())["status"] == "complete"
