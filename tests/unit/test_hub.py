"""`--model ORG/NAME[@REV]` from a Hugging Face cache the test builds (offline: nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants
from typer.testing import CliRunner

from cosmos3_batch.checkpoint.hub import resolve_model
from cosmos3_batch.cli import app
from tests.conftest import write_jsonl
from tests.dist.jobs import run_here

MAIN, TAGGED = "a" * 40, "b" * 40  # snapshot commits


@pytest.fixture
def hub(tmp_path, tiny_ckpt, monkeypatch) -> Path:
    """HF_HUB_CACHE with models--org--tiny: refs main and v1, a snapshot for each."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for commit in (MAIN, TAGGED):
        shutil.copytree(tiny_ckpt, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(TAGGED)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    return cache


def test_repo_ids_resolve_to_their_snapshot(hub):
    source = resolve_model("org/tiny")
    assert (source.path, source.repo, source.revision, source.commit) == (
        hub / "models--org--tiny" / "snapshots" / MAIN, "org/tiny", "main", MAIN
    )  # fmt: skip
    assert resolve_model("org/tiny@v1").commit == TAGGED
    assert resolve_model(f"org/tiny@{TAGGED}").commit == TAGGED


def test_an_uncached_repo_names_repo_revision_cache_and_the_command(hub):
    with pytest.raises(ValueError) as err:
        resolve_model("org/missing@v2")
    assert str(err.value) == (
        f"--model org/missing@v2: offline (HF_HUB_OFFLINE=1): not in the Hugging Face cache {hub}; "
        "download it first: hf download org/missing --revision v2 "
        f"(and no folder {Path('org/missing@v2').resolve()} exists)"
    )
    with pytest.raises(ValueError, match="not a checkpoint folder nor a Hugging Face repo id"):
        resolve_model("no/such/folder")


def test_plan_and_run_record_the_snapshot(hub, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x", "size": "32x32", "num_frames": 1,
                                                  "num_inference_steps": 1}])  # fmt: skip
    result = CliRunner().invoke(app, ["plan", str(prompts), "--model", "org/tiny@v1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["model"]["model_commit"] == TAGGED
    out = tmp_path / "out"
    assert run_here(["run", prompts, "--model", "org/tiny", "--out", out, "--no-progress"]) == 0
    sidecar = json.loads((out / "a.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    for record in (sidecar, summary["config"]):
        assert (record["model_repo"], record["model_revision"], record["model_commit"]) == (
            "org/tiny",
            "main",
            MAIN,
        )
        assert record["model"] == str(hub / "models--org--tiny" / "snapshots" / MAIN)
    result = CliRunner().invoke(
        app, ["run", str(prompts), "--model", "org/none", "--out", str(tmp_path / "o2")]
    )
    assert result.exit_code == 2 and "org/none@main" in result.output and not (tmp_path / "o2").exists()
