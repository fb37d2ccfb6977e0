"""Resume compares the files a request read (issue 43): an image or a Transfer control replaced in place under
the same name makes its old output incomplete; a `touch` (same bytes, new mtime) does not; in both dataset
formats. The sidecar and the manifest record each input's size, mtime and sha256."""

from __future__ import annotations

import json
import os

import imageio
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from tests.conftest import moving_square, write_jsonl


def run(ckpt, prompts, out, *flags):
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress", *flags]
    return CliRunner().invoke(app, args)


def _image(path, seed: int) -> None:
    Image.fromarray((np.random.RandomState(seed).rand(32, 32, 3) * 255).astype(np.uint8)).save(path)


@pytest.mark.parametrize("fmt", ["files", "webdataset"])
def test_an_input_replaced_in_place_is_generated_again_and_a_touch_is_not(tmp_path, tiny_ckpt, caplog, fmt):
    _image(tmp_path / "cond.png", 0)
    imageio.mimwrite(tmp_path / "edge.mp4", moving_square(9), fps=8)
    rows = [
        {"id": "i2v", "prompt": "a cat", "image": "cond.png", "num_frames": 5, "size": "32x32",
         "num_inference_steps": 2},
        {"id": "tr", "prompt": "night", "control": {"edge": "edge.mp4"}, "size": "48x32",
         "num_inference_steps": 2},
        {"id": "t2i", "prompt": "a dog", "num_frames": 1, "size": "32x32", "num_inference_steps": 2},
    ]  # fmt: skip
    prompts, out = write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "out"
    flags = ["--format", fmt]
    assert run(tiny_ckpt, prompts, out, *flags).exit_code == 0
    if fmt == "files":
        sidecar = json.loads((out / "i2v.json").read_text())
        recorded = sidecar["inputs"][str(tmp_path / "cond.png")]
        assert recorded["bytes"] == (tmp_path / "cond.png").stat().st_size and len(recorded["sha256"]) == 64
        manifest = pq.read_table(out / "manifest.parquet").to_pydict()
        assert json.loads(manifest["inputs"][manifest["id"].index("i2v")]) == sidecar["inputs"]

    # The same bytes, a new mtime: nothing is generated again (the stat differs, the sha256 does not).
    os.utime(tmp_path / "cond.png", ns=(1, 1))
    result = run(tiny_ckpt, prompts, out, *flags)
    assert result.exit_code == 0 and "0 generated, 0 failed, 3 already complete" in result.output

    # Other bytes under the same names: exactly those two requests again, each saying why.
    _image(tmp_path / "cond.png", 1)
    imageio.mimwrite(tmp_path / "edge.mp4", moving_square(9)[::-1].copy(), fps=8)
    with caplog.at_level("WARNING", logger="cosmos3_batch"):
        result = run(tiny_ckpt, prompts, out, *flags)
    assert result.exit_code == 0 and "2 generated, 0 failed, 1 already complete" in result.output
    assert f"i2v: input {tmp_path / 'cond.png'} changed since it was generated" in caplog.text
    assert f"tr: input {tmp_path / 'edge.mp4'} changed since it was generated" in caplog.text
