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
