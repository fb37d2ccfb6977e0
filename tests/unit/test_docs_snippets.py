"""Every ```python snippet of docs/outputs.md runs, as written, against a real small run's output (issue 49:
the docs read outputs with packages the set-up did not install, and a snippet used `glob` unimported)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from tests.conftest import write_jsonl

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "outputs.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
# What each snippet's names hold on the run below: its image, its video, both in the manifest.
CHECKS = [
    "assert first['__key__'] == 'vid' and 'mp4' in first and len(ds) == 1",
    "assert sorted(done['id']) == ['img', 'vid'] and len(rows) == 2",
]
ROWS = [
    {"id": "img", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 1},
    {"id": "vid", "prompt": "a cat", "num_frames": 5, "size": "32x32", "num_inference_steps": 1},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_ckpt) -> Path:
    """A folder whose out/ a `run --format webdataset` wrote (an image and a video shard, the manifest)."""
    folder = tmp_path_factory.mktemp("docs")
    prompts = write_jsonl(folder / "p.jsonl", ROWS)
    args = ["run", prompts, "--model", tiny_ckpt, "--out", folder / "out", "--format", "webdataset"]
    result = CliRunner().invoke(app, [str(a) for a in [*args, "--no-progress"]], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return folder


def test_the_page_has_its_snippets_and_the_read_extra_has_their_imports() -> None:
    assert len(SNIPPETS) == 2
    imported = {m.split(".")[0] for s in SNIPPETS for m in re.findall(r"^(?:import|from) (\w+)", s, re.M)}
    assert imported == {"glob", "webdataset", "datasets", "pandas"}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split(r"[<>=]", p)[0] for p in extras["read"]} == {"webdataset", "datasets", "pandas"}


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_each_snippet_runs_on_a_real_output(folder: Path, tmp_path: Path, index: int) -> None:
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = f"{SNIPPETS[index]}\n{CHECKS[index]}\nprint('ran')\n"
    ran = subprocess.run(
        [sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300,
        env={**env, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == "ran"
