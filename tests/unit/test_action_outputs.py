"""Action modes through the real `run`: `<id>.actions.safetensors` and `<id>.actions.json`, the sidecar,
metrics kind and resume covering them; forward dynamics writes no actions (the reference returns none)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from tests.conftest import write_jsonl
from tests.unit.test_fidelity_modes import CLIP

COMMON = {"num_inference_steps": 1, "seed": 3}
ROWS = [
    {"id": "pol", "prompt": "grab it", "image": "IMAGE", **COMMON,
     "action": {"mode": "policy", "chunk_size": 4, "domain": "robomind-franka-dual", "resolution_tier": 256}},
    {"id": "inv", "prompt": "what moved", "video": str(CLIP), **COMMON,
     "action": {"mode": "inverse_dynamics", "chunk_size": 4, "domain": "pusht", "resolution_tier": 256}},
    {"id": "fwd", "prompt": "push", "image": "IMAGE", **COMMON,
     "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "pusht", "resolution_tier": 256,
                "actions": [[0.5, -0.5]]}},
]  # fmt: skip


def run(ckpt, prompts, out):
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress"]
    return CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_av_ckpt, cond_image):
    folder = tmp_path_factory.mktemp("actions")
    rows = [{**r, "image": str(cond_image)} if r.get("image") else r for r in ROWS]
    prompts = write_jsonl(folder / "p.jsonl", rows)
    out = folder / "out"
    result = run(tiny_av_ckpt, prompts, out)
    assert result.exit_code == 0, result.output
    return prompts, out


def test_actions_files_hold_the_predicted_tensor(job):
    _, out = job
    for rid, width in (("pol", 20), ("inv", 2)):
        actions = load_file(out / f"{rid}.actions.safetensors")["actions"]
        assert actions.dtype == torch.float32 and tuple(actions.shape) == (4, width), rid
        readable = json.loads((out / f"{rid}.actions.json").read_text())
        assert readable["shape"] == [4, width] and readable["domain"] in ("robomind-franka-dual", "pusht")
        # The JSON numbers read back to exactly the float32 tensor.
        assert torch.equal(torch.tensor(np.asarray(readable["actions"], dtype=np.float32)), actions), rid
    assert not (out / "fwd.actions.safetensors").exists() and (out / "fwd.mp4").is_file()


def test_sidecar_metrics_and_resume_cover_the_actions(job, tiny_av_ckpt):
    prompts, out = job
    sidecar = json.loads((out / "pol.json").read_text())
    assert sidecar["kind"] == "policy"
    assert set(sidecar["files"]) == {"media", "actions", "actions_json"}
    assert sidecar["actions"] == {"shape": [4, 20], "dtype": "float32"}
    with open(out / "metrics.csv") as f:
        assert sorted(row["kind"] for row in csv.DictReader(f)) == [
            "forward_dynamics",
            "inverse_dynamics",
            "policy",
        ]
    assert "3 already complete" in run(tiny_av_ckpt, prompts, out).output
    (out / "inv.actions.json").unlink()
    result = run(tiny_av_ckpt, prompts, out)
    assert "1 generated" in result.output and "2 already complete" in result.output, result.output
    assert (out / "inv.actions.json").is_file()


def test_export_lerobot_writes_the_v3_layout_with_the_actions_exactly(job, tmp_path):
    """`lerobot` does not install beside this project's pins (it pulls torch 2.10, diffusers 0.35, numpy 2.2),
    so the layout is checked against LeRobot's documented v3.0 schema, read with pyarrow, pandas and HF
    datasets as LeRobotDataset reads it."""
    import pandas as pd
    from datasets import load_dataset

    _, out = job
    dst = tmp_path / "lerobot"
    args = ["export", "lerobot", str(out), str(dst), "--fps", "24", "--domain", "pusht"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    info = json.loads((dst / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 24 and info["robot_type"] == "pusht"
    # forward dynamics: the one row it was given; inverse dynamics: its 4 predicted rows
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (2, 5, 2)
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["features"]["action"] == {"dtype": "float32", "shape": [2], "names": None}
    assert info["features"]["observation.images.main"]["dtype"] == "video"
    tasks = pd.read_parquet(dst / "meta/tasks.parquet")
    assert list(tasks.index) == ["push", "what moved"] and list(tasks["task_index"]) == [0, 1]
    episodes = pd.read_parquet(dst / "meta/episodes/chunk-000/file-000.parquet")
    assert list(episodes["cosmos3/request_id"]) == ["fwd", "inv"] and list(episodes["length"]) == [1, 4]
    assert list(episodes["dataset_from_index"]) == [0, 1] and list(episodes["dataset_to_index"]) == [1, 5]
    data = load_dataset("parquet", data_files=str(dst / "data/*/*.parquet"), split="train")
    assert data.column_names == ["action", "timestamp", "frame_index", "episode_index", "index", "task_index"]
    rows = data.with_format("numpy")[:]
    inverse = load_file(out / "inv.actions.safetensors")["actions"].numpy()
    assert np.array_equal(np.stack(rows["action"][1:]), inverse)  # the predicted rows, bit for bit
    assert np.array_equal(np.stack(rows["action"][:1]), np.float32([[0.5, -0.5]]))
    assert list(rows["frame_index"]) == [0, 0, 1, 2, 3] and list(rows["task_index"]) == [0, 1, 1, 1, 1]
    assert list(rows["episode_index"]) == [0, 1, 1, 1, 1] and list(rows["index"]) == [0, 1, 2, 3, 4]
    assert np.array_equal(rows["timestamp"], np.float32([0 / 24, 0 / 24, 1 / 24, 2 / 24, 3 / 24]))
    video = dst / "videos/observation.images.main/chunk-000/file-001.mp4"
    assert video.read_bytes() == (out / "inv.mp4").read_bytes()
    assert CliRunner().invoke(app, args).exit_code == 2  # DST is not empty now: nothing overwritten
    slower = tmp_path / "at-10fps"  # another fps: the clip's frames re-encoded at it, one for one
    args = ["export", "lerobot", str(out), str(slower), "--fps", "10", "--domain", "pusht"]
    assert CliRunner().invoke(app, args, catch_exceptions=False).exit_code == 0
    import imageio.v3 as iio

    clip = slower / "videos/observation.images.main/chunk-000/file-001.mp4"
    frames = iio.improps(out / "inv.mp4", plugin="FFMPEG").shape
    assert iio.improps(clip, plugin="FFMPEG").shape == frames
    assert json.loads((slower / "meta/info.json").read_text())["fps"] == 10
