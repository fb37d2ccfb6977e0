"""What a Transfer request writes beyond the media (DESIGN.md §17): with `--format webdataset` its samples go
to shards of their own kind (`transfer-video-latents`: a chunk chain's latents are [chunks, C, T, H, W]), next
to the T2V samples' `video-latents`, each sample's json carrying the sidecar's `controls`; the latents member
equals the `--format files` run's file bit for bit."""

from __future__ import annotations

import json
import tarfile

import imageio
import pytest
from safetensors.torch import load, load_file

from tests.conftest import moving_square, write_jsonl
from tests.unit.test_datasets import run, tars

ROWS = [
    {"id": "tr", "prompt": "a red car", "control": {"edge": "edge.mp4"}, "num_frames": 9,
     "frames_per_chunk": 5, "seed": 1},
    {"id": "t2v", "prompt": "a cat walks", "num_frames": 5, "seed": 2},
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_ckpt):
    folder = tmp_path_factory.mktemp("transfer-outputs")
    imageio.mimwrite(folder / "edge.mp4", moving_square(9, step=2), fps=8)
    prompts = write_jsonl(
        folder / "p.jsonl", [{**row, "size": "48x32", "num_inference_steps": 2} for row in ROWS]
    )
    for fmt in ("files", "webdataset"):
        result = run(prompts, tiny_ckpt, folder / fmt, "--format", fmt, "--max-active", "2")
        assert result.exit_code == 0, result.output
    return folder


def members(shard: str) -> dict[str, bytes]:
    with tarfile.open(shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_transfer_samples_get_shards_of_their_own_kind(runs):
    out = runs / "webdataset"
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["transfer-video-latents", "video-latents"]
    (shard,) = tars(out, "transfer-video-latents")
    found = members(shard)
    assert sorted(found) == ["tr.json", "tr.latents.safetensors", "tr.mp4", "tr.txt"]
    latents = load(found["tr.latents.safetensors"])["latents"]
    assert latents.shape[0] == 2  # two chunks of 5 frames overlapping by 1 make 9
    assert latents.equal(load_file(runs / "files" / "tr.latents.safetensors")["latents"])
    sidecar = json.loads(found["tr.json"])
    assert sidecar["kind"] == "transfer" and [c["hint"] for c in sidecar["controls"]] == ["edge"]
    assert sidecar["controls"] == json.loads((runs / "files" / "tr.json").read_text())["controls"]
    (plain,) = tars(out, "video-latents")
    assert sorted(members(plain)) == ["t2v.json", "t2v.latents.safetensors", "t2v.mp4", "t2v.txt"]
    assert len(found["tr.mp4"]) > 0
