"""Host memory per rank, read from /proc by scripts/tools/mem_probe.py under a real torchrun (N=2)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cosmos3_batch.model.tiny import TinySpec, write_tiny
from tests.dist.jobs import JOB_PYTHON

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mid_ckpt(tmp_path_factory) -> Path:
    # ~250 MB of float32 layer weights in 64 parts: big enough that /proc figures are not noise, and the
    # two fetch slots (2 of 64 parts) stay small next to a rank's shards.
    spec = TinySpec(layers=32, hidden=256, heads=4, kv_heads=2, intermediate=1024)
    return write_tiny(tmp_path_factory.mktemp("mid") / "mid", spec)


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory) -> Path:
    # A large-vocabulary tiny model: a 128 MiB float32 embedding table (131,072 rows, nearly all padding
    # the tokenizer never emits) next to ~3 MB of other resident weights.
    spec = TinySpec(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=131072)
    return write_tiny(tmp_path_factory.mktemp("wide") / "wide", spec)


def probe(ckpt: Path, mode: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / f"{mode}.json"
    cmd = [JOB_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "scripts" / "tools" / "mem_probe.py"), str(ckpt), mode, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def allgather_ranks(mid_ckpt, tmp_path_factory) -> list[dict]:
    """One allgather probe of the mid-size model, read by the two tests below."""
    return probe(mid_ckpt, "allgather", tmp_path_factory.mktemp("allgather"))


def test_allgather_rank_holds_half_the_layers_privately(allgather_ranks):
    for rank in allgather_ranks:
        share = rank["layer_bytes"] / 2
        assert abs(rank["rss_anon_delta"] - share) <= 0.10 * share, rank


def test_local_mode_holds_no_layer_copy_and_naive_holds_all(mid_ckpt, tmp_path):
    for rank in probe(mid_ckpt, "local", tmp_path):
        # Only the two fetch slots may become private; the layers stay in the shared page cache.
        assert rank["rss_anon_delta"] <= rank["slot_bytes"] + 0.02 * rank["layer_bytes"], rank
    for rank in probe(mid_ckpt, "naive", tmp_path):
        assert rank["rss_anon_delta"] >= 0.95 * rank["layer_bytes"], rank


def test_plan_matches_measured_memory(mid_ckpt, allgather_ranks):
    import torch

    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.engine.transport import OffloadMode
    from cosmos3_batch.plan import planner
    from cosmos3_batch.plan.model_shape import model_shape
    from cosmos3_batch.requests.parse import parse_lines

    ckpt = Checkpoint.open(mid_ckpt)
    shape = model_shape(ckpt, world_size=2, fallback_dtype=torch.bfloat16)
    (request,), _ = parse_lines([b'{"id": "i", "prompt": "x", "num_frames": 1, "size": "32x32"}'])
    est = planner.estimate(shape, [request], {"i": 100}, 2, 1, OffloadMode.ALLGATHER, 1, planner.Hardware())
    predicted_shards = est.host_private_bytes_per_rank - shape.host_resident_bytes
    for rank in allgather_ranks:
        # Stated tolerance: 5% (the measurement includes allocator and bookkeeping overhead).
        assert abs(rank["rss_anon_delta"] - predicted_shards) <= 0.05 * predicted_shards, rank
        # Two GEN slots and one UND slot, each the plan's slot (the tiny model's halves are the same size).
        assert rank["slot_bytes"] == 3 * est.slot_bytes


def test_no_rank_holds_a_private_copy_of_the_embedding_table(wide_ckpt, tmp_path):
    for rank in probe(wide_ckpt, "allgather", tmp_path):
        table = rank["embed_bytes"]
        assert table == 131072 * 256 * 4, rank
        assert rank["embed_is_mapped_view"], rank
        # Private memory for the resident weights: the small ones only (5% of the table for allocator
        # and bookkeeping slack); the table itself stays in the node's page cache.
        assert rank["resident_rss_anon_delta"] <= rank["resident_other_bytes"] + 0.05 * table, rank
        # The control: the same probe sees a private copy of the table when one is made.
        assert rank["private_copy_rss_anon_delta"] >= 0.95 * table, rank
