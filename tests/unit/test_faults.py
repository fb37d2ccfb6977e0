"""Faults that stop the job (DESIGN.md §14), on real filesystems and real checkpoint files, in one process:
a full disk (a small tmpfs, mounted here as root) stops with 75 and leaves nothing half-written, a rerun
after freeing space does exactly the rest; no room for the largest output is exit 2 before loading; a
checkpoint rewritten or truncated in place stops with 1 and writes nothing computed from it; ffmpeg says
one line; an orphan media file and a torn metrics line are survived on resume."""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.io import outputs
from cosmos3_batch.io.ffmpeg import EncoderError, run_ffmpeg
from cosmos3_batch.io.metrics import read_part
from cosmos3_batch.io.space import disk_errno
from cosmos3_batch.pipeline.job import load as job_load
from tests.conftest import assert_same_outputs, write_jsonl

ROWS = [
    {"id": f"op{i}", "prompt": "a red cube", "size": "64x64", "num_frames": 9 if i % 2 else 1}
    | {"num_inference_steps": 1 + i % 2}
    for i in range(16)
]
IDS = [r["id"] for r in ROWS]
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def invoke(*args) -> object:
    """`cosmos3_batch run ...` in this process at torchrun's one thread (the references run alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return CliRunner().invoke(app, ["run", *map(str, args), "--no-progress"], catch_exceptions=False)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root, or no mount namespace): {mounted.stderr.decode()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path, leave: int) -> Path:
    """A ballast file that leaves `leave` bytes free on `folder`'s filesystem; deleting it frees the space."""
    st = os.statvfs(folder)
    ballast = folder / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return ballast


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_ckpt) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("faults-ref")
    prompts = write_jsonl(folder / "p.jsonl", ROWS)
    assert invoke(prompts, "--model", tiny_ckpt, "--out", folder / "out", "--save-latents").exit_code == 0
    return prompts, folder / "out"


def metrics_rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def assert_nothing_half_written(out: Path) -> list[str]:
    """Every output under a final name belongs to a complete request; no temporaries. Returns those ids."""
    done = [rid for rid in IDS if (out / f"{rid}.json").exists()]
    for path in out.iterdir():
        if path.is_file() and path.name != "ballast":
            assert ".tmp" not in path.name, path
            assert path.stat().st_size > 0, path
            stem = path.name.split(".")[0]
            if stem in IDS:
                assert stem in done, f"{path.name} is left without its sidecar"
    for rid in done:
        assert json.loads((out / f"{rid}.json").read_text())["status"] == "complete"
    return done


def test_a_full_disk_stops_the_job_with_75_and_the_rerun_does_exactly_the_rest(
    tmp_path, tiny_ckpt, reference
):
    prompts, ref = reference
    with tmpfs(tmp_path / "disk", "2m") as disk:
        out = disk / "out"
        ballast = fill(disk, leave=120 << 10)  # room for a few outputs: the disk fills mid-run
        result = invoke(prompts, "--model", tiny_ckpt, "--out", out, "--save-latents")
        assert result.exit_code == 75, result.output
        last = result.output.strip().splitlines()[-1]
        assert last.startswith("error: ENOSPC (No space left on device) writing "), last
        assert " free of " in last and str(out) in last and "rerun the same command" in last, last
        assert "Traceback" not in result.output and "ffmpeg" not in result.output.lower()
        done = assert_nothing_half_written(out)
        assert 0 < len(done) < len(IDS)
        summary = json.loads((out / "summary.json").read_text())
        stopped = summary["interrupted"]
        assert (stopped["reason"], stopped["exit_code"], summary["generated_ok"]) == ("disk", 75, len(done))
        assert summary["failed"] == []  # a full disk fails no request: they are interrupted
        rows = {row["id"]: row["status"] for row in metrics_rows(out)}
        assert {rid for rid, status in rows.items() if status == "ok"} == set(done)
        assert set(rows.values()) <= {"ok", "interrupted"}

        ballast.unlink()  # free the space, rerun the same command
        again = invoke(prompts, "--model", tiny_ckpt, "--out", out, "--save-latents")
        assert again.exit_code == 0, again.output
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["generated_ok"], summary["skipped_complete"]) == (len(IDS) - len(done), len(done))
        assert_same_outputs(ref, out, IDS)
        assert {row["id"]: row["status"] for row in metrics_rows(out)} == dict.fromkeys(IDS, "ok")
        assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_no_room_for_the_largest_output_is_exit_2_before_any_weight_is_read(tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setattr(job_load, "load_context", lambda *a, **k: pytest.fail("weights were loaded"))
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "big", "prompt": "x", "size": "512x512", "num_frames": 33}]
    )
    with tmpfs(tmp_path / "disk", "1m") as disk:
        result = invoke(prompts, "--model", tiny_ckpt, "--out", disk / "out")
    assert result.exit_code == 2, result.output
    assert f"--out {disk / 'out'}: " in result.output and "request 'big' needs about" in result.output


def test_a_read_only_output_stops_the_job_with_75(tmp_path, tiny_ckpt, monkeypatch):
    """EROFS mid-run (a filesystem remounted read-only): the same stop as ENOSPC, named as such."""
    real, calls = outputs.write_png, []

    def remounted(path, frame):
        calls.append(path)
        if len(calls) > 2:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, frame)

    monkeypatch.setattr(outputs, "write_png", remounted)
    prompts = write_jsonl(tmp_path / "p.jsonl", [r for r in ROWS if r["num_frames"] == 1])
    result = invoke(prompts, "--model", tiny_ckpt, "--out", tmp_path / "out")
    assert result.exit_code == 75, result.output
    assert "error: EROFS (Read-only file system) writing " in result.output
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["generated_ok"] == 2


def test_a_disk_that_fills_at_the_end_is_still_exit_75(tmp_path, tiny_ckpt, monkeypatch):
    """Every output written, then the merge of metrics.csv is refused: the rows wait in their part files,
    the job still says the disk is full (a Slurm script holds it), and the rerun merges them."""
    from cosmos3_batch.pipeline.job import ending

    def full(out):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "metrics.csv"))

    rows = [r for r in ROWS if r["num_frames"] == 1][:3]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    monkeypatch.setattr(ending, "merge_metrics", full)
    result = invoke(prompts, "--model", tiny_ckpt, "--out", tmp_path / "out")
    assert result.exit_code == 75, result.output
    assert (
        result.output.strip().splitlines()[-1].startswith("error: ENOSPC (No space left on device) writing ")
    )
    assert not (tmp_path / "out" / "metrics.csv").exists()
    monkeypatch.undo()
    again = invoke(prompts, "--model", tiny_ckpt, "--out", tmp_path / "out")
    assert again.exit_code == 0, again.output
    assert {row["id"]: row["status"] for row in metrics_rows(tmp_path / "out")} == {
        r["id"]: "ok" for r in rows
    }


def rewrite_when_first_output_appears(out: Path, target: Path, damage) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 120
        while not list(out.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.005)
        damage(target)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def same_size_other_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(len(data) - header)  # plausible: a zeroed model, same size
    with open(path, "r+b") as f:  # in place, as `cp other.safetensors model.safetensors` writes
        f.write(data)


def truncate_half(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [same_size_other_bytes, truncate_half], ids=["rewritten", "truncated"])
def test_a_checkpoint_changed_in_place_stops_the_job_and_writes_nothing_from_it(tmp_path, tiny_ckpt, damage):
    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt, model)
    out = tmp_path / "out"
    slow = write_jsonl(tmp_path / "slow.jsonl", [{**r, "num_inference_steps": 8} for r in ROWS])
    writer = rewrite_when_first_output_appears(out, model / WEIGHTS, damage)
    result = invoke(
        slow, "--model", model, "--out", out, "--save-latents", "--offload", "local", "--max-active", 2
    )
    writer.join()
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint file {model / WEIGHTS} changed during the job"), last
    assert "never in place" in last and "Traceback" not in result.output
    done = assert_nothing_half_written(out)
    assert len(done) < len(IDS)
    # What was written came from the checkpoint as loaded: bit-exact with a run on an untouched copy.
    fresh = invoke(
        slow, "--model", tiny_ckpt, "--out", tmp_path / "fresh", "--save-latents", "--offload", "local"
    )
    assert fresh.exit_code == 0, fresh.output
    assert_same_outputs(tmp_path / "fresh", out, done)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["interrupted"]["reason"], summary["failed"]) == ("checkpoint", [])


def test_ffmpeg_speaks_one_line_and_its_own_output_goes_to_the_debug_log(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="cosmos3_batch")
    with pytest.raises(EncoderError) as err:
        run_ffmpeg(["-i", str(tmp_path / "missing.mp4"), "-f", "null", "-"], "read a missing clip")
    assert "\n" not in str(err.value) and str(err.value).startswith("ffmpeg could not read a missing clip: ")
    assert any("missing.mp4" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


def test_an_encoder_on_a_full_disk_keeps_the_errno_and_leaves_no_file(tmp_path):
    frames = torch.randint(0, 255, (9, 64, 64, 3), dtype=torch.uint8).numpy()
    with tmpfs(tmp_path / "disk", "64k") as disk:
        fill(disk, leave=0)
        with pytest.raises(OSError) as err:
            outputs.write_mp4(disk / "clip.mp4", frames, 24.0)
        assert disk_errno(err.value) == errno.ENOSPC and err.value.filename == str(disk / "clip.mp4")
        assert sorted(p.name for p in disk.iterdir()) == ["ballast"]


def test_an_orphan_media_file_is_regenerated_and_a_torn_metrics_line_skipped(tmp_path, tiny_ckpt, reference):
    prompts, ref = reference
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    (out / "op0.json").unlink()  # op0.png stays: an orphan without its sidecar
    (out / "op1.mp4").write_bytes(b"")  # a 0-byte video under a final name, as old versions left on ENOSPC
    part = out / ".cosmos3_batch" / "metrics.rank0.csv"
    with open(part, "ab") as f:
        f.write(b"\x00\x00garbage\x00,\xff\xfe\n")  # not CSV at all
        f.write(b'op5,ok,"t2i,64,6')  # torn mid-append by a crash: no newline, an open quote
    rows, bad = read_part(part)
    assert bad == 2 and {r["id"] for r in rows} == set(IDS)
    result = invoke(prompts, "--model", tiny_ckpt, "--out", out, "--save-latents")
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["generated_ok"], summary["skipped_complete"]) == (2, len(IDS) - 2)
    assert_same_outputs(ref, out, IDS)
    assert {row["id"]: row["status"] for row in metrics_rows(out)} == dict.fromkeys(IDS, "ok")
