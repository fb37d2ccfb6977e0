"""`LayerOffload` under real `torchrun` + gloo on a toy 3-layer model built on the meta device.

One launch per world size runs all four modes (start-up dominates the cost); counters and layouts are
compared with values worked out by hand below, never with timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("engine_toy_worker.py")
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
TIMEOUT_S = 120
WORLDS = [1, 2, 3, 4]
MODES = ["allgather", "sharded", "local", "staged"]
ORDERS = ([0, 1, 2, 3, 4, 5], [1, 3, 5])  # as in the worker: all parts, then the GEN parts only

# Byte layout of the worker's parts, by hand (ALIGN = 256; dtype groups in order f32, bf16, f16):
#   und: f32 5x3 = 60 B at 0; bf16 x7 = 14 B at 256; f16 x1 = 2 B at 512 -> data ends at 514
#   gen: f32 7x9 = 252 B at 0; bf16 x300 = 600 B at 256 (ends 856); f16 x1 = 2 B at 1024 -> ends at 1026
END = {"und": 514, "gen": 1026}
PAYLOAD = {"und": 60 + 14 + 2, "gen": 252 + 600 + 2}


def nbytes(half: str, world: int) -> int:
    unit = 256 * world
    return -(-END[half] // unit) * unit


def halves(order: list[int]) -> list[str]:
    return ["und" if index % 2 == 0 else "gen" for index in order]


def expected_layouts(world: int) -> list[list]:
    return [
        [f"{layer}.{half}", nbytes(half, world), nbytes(half, world) // world, PAYLOAD[half]]
        for layer in range(3)
        for half in ("und", "gen")
    ]


def expected_counters(mode: str, world: int, order: list[int]) -> dict[str, int]:
    full = sum(nbytes(half, world) for half in halves(order))
    shard = full // world
    gathered = full - shard if world > 1 and mode != "local" else 0
    local = sum(PAYLOAD[half] for half in halves(order))
    # staged (ranks sharing one GPU): gathered in host memory, so the whole part crosses to the device.
    h2d = {"allgather": shard, "sharded": 0, "local": local, "staged": full}[mode]
    return {"h2d_bytes": h2d, "gathered_bytes": gathered, "fetches": len(order)}


def launch(out: Path, world: int, scenario: str) -> tuple[int, str, list[dict]]:
    """torchrun the worker (standalone: a free port each time); return code, output, each rank's JSON."""
    # The test process's interpreter: the worker imports a test module (FakeCuda), and no diffusers.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += [str(WORKER), "--ckpt", str(out / "ckpt"), "--out", str(out), "--scenario", scenario]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the workers it started, nothing else
        output, _ = proc.communicate()
        pytest.fail(f"torchrun (world {world}, {scenario}) hung for {TIMEOUT_S} s:\n{output[-4000:]}")
    results = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    return proc.returncode, output, results


@pytest.fixture(scope="module")
def ok_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict]]:
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            rc, output, results = launch(tmp_path_factory.mktemp(f"world{world}"), world, "ok")
            assert rc == 0, output[-4000:]
            assert [r["rank"] for r in results] == list(range(world)), output[-4000:]
            cache[world] = results
        return cache[world]

    return get


def mode_results(results: list[dict], mode: str) -> list[dict]:
    """Each rank's record of `mode` (the worker runs the modes in the order of MODES)."""
    records = [r["modes"][MODES.index(mode)] for r in results]
    assert all(rec["mode"] == mode for rec in records)
    return records


@pytest.mark.parametrize("world", WORLDS)
def test_layouts_and_digest_agree_on_every_rank(ok_run: Callable[[int], list[dict]], world: int) -> None:
    results = ok_run(world)
    assert all(r["error"] is None and r["world_size"] == world for r in results)
    for mode in MODES:
        records = mode_results(results, mode)
        assert all(rec["layouts"] == expected_layouts(world) for rec in records)
        assert len({rec["digest"] for rec in records}) == 1
    # The layout does not depend on the mode.
    assert len({rec["digest"] for r in results for rec in r["modes"]}) == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
def test_every_acquired_part_holds_the_true_weights(
    ok_run: Callable[[int], list[dict]], world: int, mode: str
) -> None:
    for rank, rec in enumerate(mode_results(ok_run(world), mode)):
        assert [p["order"] for p in rec["passes"]] == list(ORDERS)
        for p in rec["passes"]:
            assert p["wrong"] == [], f"rank {rank}, pass {p['order']}: {p['wrong']}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
def test_counters_are_exact(ok_run: Callable[[int], list[dict]], world: int, mode: str) -> None:
    for rank, rec in enumerate(mode_results(ok_run(world), mode)):
        for p in rec["passes"]:
            counters = p["counters"]
            got = {key: counters[key] for key in ("h2d_bytes", "gathered_bytes", "fetches")}
            assert got == expected_counters(mode, world, p["order"]), f"rank {rank}, pass {p['order']}"
            if world == 1 or mode == "local":
                assert counters["collective_s"] == 0.0  # no gather was issued at all
            assert counters["stall_s"] >= 0.0


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_fetches_the_same_parts(ok_run: Callable[[int], list[dict]], world: int) -> None:
    per_rank = [
        [
            [p["counters"]["fetches"], p["counters"]["gathered_bytes"]]
            for rec in r["modes"]
            for p in rec["passes"]
        ]
        for r in ok_run(world)
    ]
    assert all(fetches == per_rank[0] for fetches in per_rank)


def test_hand_computed_values() -> None:
    """The expectations themselves, spelled out once for world 3 (shards of 256 and 512 bytes)."""
    assert [nbytes("und", w) for w in WORLDS] == [768, 1024, 768, 1024]
    assert [nbytes("gen", w) for w in WORLDS] == [1280, 1536, 1536, 2048]
    assert expected_counters("allgather", 3, [1, 3, 5]) == {
        "h2d_bytes": 3 * 512,
        "gathered_bytes": 3 * 1024,
        "fetches": 3,
    }
    assert expected_counters("local", 3, [0, 1]) == {"h2d_bytes": 76 + 854, "gathered_bytes": 0, "fetches": 2}
    assert expected_counters("staged", 3, [1, 3, 5]) == {
        "h2d_bytes": 3 * 1536,
        "gathered_bytes": 3 * 1024,
        "fetches": 3,
    }


MISMATCH = [
    pytest.param("shape", 3, id="rank1-other-param-shape"),
    pytest.param("world", 2, id="rank1-larger-world-size"),
    pytest.param("world_less", 3, id="rank1-smaller-world-size"),
]


@pytest.mark.parametrize(("scenario", "world"), MISMATCH)
def test_layout_mismatch_fails_every_rank(tmp_path: Path, scenario: str, world: int) -> None:
    rc, output, results = launch(tmp_path, world, scenario)
    assert rc != 0
    assert [r["rank"] for r in results] == list(range(world)), output[-4000:]
    for r in results:
        assert r["error"] is not None, output[-4000:]
        assert r["error"]["type"] == "LayoutMismatch", r["error"]
        assert "layouts differ" in r["error"]["message"]
        assert f"rank {r['rank']}: LayoutMismatch: layer layouts differ" in output
