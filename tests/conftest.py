"""Shared fixtures: one tiny checkpoint per test session, built locally (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from cosmos3_batch.model.tiny import TinySpec, write_tiny

# Longest first, a module's tests kept together (its fixtures are built once): each xdist worker starts on
# a block of this order and an idle one steals from the end of the other's, so a long test collected last
# would be a tail no worker can share. The Slurm jobs, the chained stops and the benchmark are the longest.
LONGEST_FIRST = (
    "tests/slurm/",
    "tests/dist/test_stop.py",
    "tests/unit/test_bench_smoke.py",
    "tests/dist/test_runs.py",
    "tests/dist/test_sp.py",
    "tests/dist/",
    "tests/unit/test_fidelity_modes.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        ranks = [i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)]
        return ranks[0] if ranks else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the collected order within each rank


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", TinySpec())


@pytest.fixture(scope="session")
def tiny_av_ckpt(tmp_path_factory) -> Path:
    """The tiny model with joint sound and action generation (`make-tiny --sound --action`)."""
    return write_tiny(tmp_path_factory.mktemp("ckpt-av") / "tiny-av", TinySpec(sound=True, action=True))


@pytest.fixture(scope="session")
def cond_image(tmp_path_factory) -> Path:
    # Not the output size on purpose: the pipeline resizes and centre-crops it.
    path = tmp_path_factory.mktemp("img") / "cond.png"
    pixels = (np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def assert_same_outputs(ref: Path, out: Path, ids: list[str]) -> None:
    """Latents equal bit for bit, PNGs equal byte for byte, videos present (H.264 is compared via latents)."""
    for rid in ids:
        expected = load_file(ref / f"{rid}.latents.safetensors")["latents"]
        assert torch.equal(load_file(out / f"{rid}.latents.safetensors")["latents"], expected), rid
        png = ref / f"{rid}.png"
        if png.exists():
            assert (out / f"{rid}.png").read_bytes() == png.read_bytes(), rid
        else:
            assert (out / f"{rid}.mp4").stat().st_size > 0, rid
