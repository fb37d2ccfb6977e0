"""Shared fixtures: one tiny checkpoint per test session, built locally (nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

# HF `datasets` reads what the tests write (shards, parquet): it must never reach the network. Set before
# anything imports huggingface_hub or datasets, which read these once.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads that wait for work sleep instead of spinning. Each pytest-xdist worker computes on both
# cores (torch's default threads) beside the other worker and the ranks they launch: spinning threads
# burned about 40% of the unit tier's CPU for nothing (99 s against 52 s of user time for the same tests,
# measured on the 2-core reference machine). Only how idle threads wait changes, not how work is split:
# results are the same bits. Read by libgomp when torch loads, so set before `import torch` below;
# inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from cosmos3_batch.model.tiny import TinySpec, write_tiny

# tests/guardrails needs cosmos-guardrail and a torchvision that works, which live in the guardrail virtualenv
# (scripts/env.sh guardrails, README "Tests"); scripts/test.sh runs that tier there, the rest here.
collect_ignore = [] if importlib.util.find_spec("cosmos_guardrail") else ["guardrails"]

# Seconds a module takes on this project's 2-core reference machine (measured with --durations), for the
# split below; unlisted modules count one second per test.
MODULE_SECONDS = {
    "tests/slurm/test_slurm.py": 290,
    "tests/dist/test_runs.py": 230,
    "tests/dist/test_stop.py": 220,
    # The stall chain (a 2-rank and a 4-rank --sp 2 SIGSTOP, each a collective timeout and a meeting, then a
    # rerun): 163 s here while another suite ran beside it, where the 2-rank stall alone took 103 s (87 s on
    # its own): scaled alike.
    "tests/dist/test_stall.py": 140,
    "tests/dist/test_metrics.py": 35,
    "tests/unit/test_bench_smoke.py": 110,
    "tests/dist/test_sp.py": 150,
    "tests/dist/test_memory.py": 120,
    "tests/dist/test_fp8_runs.py": 120,
    "tests/unit/test_fidelity_modes.py": 100,
    "tests/dist/test_modes_dist.py": 90,
    "tests/dist/test_engine_toy.py": 90,
    "tests/dist/test_resume.py": 60,
    "tests/dist/test_demo_model.py": 140,
    "tests/dist/test_launcher.py": 45,
    "tests/dist/test_checkpoints.py": 70,
    "tests/dist/test_transfer_dist.py": 130,  # 6 jobs in one world-2 launch, measured on 2 shared cores
    "tests/unit/test_distilled.py": 20,
    "tests/unit/test_edge.py": 16,
    "tests/unit/test_faults.py": 35,
    "tests/unit/test_fidelity.py": 50,
    "tests/unit/test_inputs.py": 40,
    "tests/unit/test_fp8_fidelity.py": 30,
    "tests/unit/test_dtypes.py": 45,
    "tests/unit/test_fp8_w8a8.py": 30,
    "tests/unit/test_sync_free.py": 8,
    "tests/unit/test_datasets.py": 25,
    "tests/unit/test_transfer_derived.py": 40,  # a derived-control run and its modular reference
    "tests/unit/test_transfer_outputs.py": 30,  # a files and a webdataset run
    "tests/unit/test_reason_shards.py": 20,  # a files and a webdataset run, three reruns (two do nothing)
    "tests/unit/test_transfer_variants.py": 30,  # 11 runs and their references, 26 s alone on 2 cores
    "tests/unit/test_transfer_boundary.py": 40,  # 8 runs of a 3-chunk chain, 37 s alone on 2 cores
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `-n 2` (scripts/test.sh), give each pytest-xdist worker half the long modules, first.

    worksteal hands the first worker the first half of the list and the second the rest, and an idle worker
    steals from the end of the other's queue: long tests collected together would be one worker's serial
    tail. So the modules are dealt to two halves longest first (each to the lighter half), long ones at the
    front of their half, a module's tests kept together (its fixtures are built once per worker).

    The modules whose grids run in shared launches (tests/dist/jobs.py `torchrun_jobs`: one launch per world
    size and worker) are dealt as one, to one worker: a launch costs each rank's start-up (about 7 CPU-s),
    and dealt apart the other worker started launches of the same sizes (21 ranks in all; worlds 1 to 4 on one
    worker are 10)."""
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT") != "2":  # set in each worker, which is what collects
        return
    from tests.dist.jobs import torchrun_jobs

    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    weight = {path: MODULE_SECONDS.get(path, len(tests)) for path, tests in modules.items()}
    by_weight = sorted(modules, key=lambda p: -weight[p])
    shared = [
        p
        for p in by_weight
        if getattr(getattr(modules[p][0], "module", None), "torchrun_jobs", None) is torchrun_jobs
    ]
    units = [shared] + [[p] for p in by_weight if p not in shared]
    halves: list[list[str]] = [[], []]
    loads = [0.0, 0.0]
    for unit in sorted(units, key=lambda u: -sum(weight[p] for p in u)):
        side = loads.index(min(loads))
        halves[side] += unit
        loads[side] += sum(weight[p] for p in unit)
    first = [item for path in halves[0] for item in modules[path]]
    second = [item for path in halves[1] for item in modules[path]]
    # The first worker takes exactly len(items) // 2: move the lightest tests across until it is so.
    while len(first) > len(items) // 2:
        second.append(first.pop())
    while len(first) < len(items) // 2:
        first.append(second.pop())
    items[:] = first + second


# Tests whose assertion depends on what this CPU's kernels were measured to do say which branch they took
# (the `cpu_branch` fixture); the run's summary lists them, so a log shows what was asserted on which CPU.
_BRANCHES: dict[str, list[str]] = {}


@pytest.fixture
def cpu_branch(record_property):
    """Call with a line saying which CPU-dependent branch the test asserted (and what it measured)."""

    def say(line: str) -> None:
        record_property("cpu_branch", line)

    return say


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Runs in the controller for xdist workers' reports too: their user_properties travel with the report.
    if report.when == "call":
        for name, value in report.user_properties:
            if name == "cpu_branch":
                _BRANCHES.setdefault(str(value), []).append(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _BRANCHES or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminalreporter.section("CPU-dependent branches asserted on this CPU")
    for line, nodeids in sorted(_BRANCHES.items()):
        terminalreporter.write_line(f"{line}  [{len(nodeids)} test(s), e.g. {nodeids[0]}]")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", TinySpec())


@pytest.fixture(scope="session")
def tiny_av_ckpt(tmp_path_factory) -> Path:
    """The tiny model with joint sound and action generation (`make-tiny --sound --action`)."""
    return write_tiny(tmp_path_factory.mktemp("ckpt-av") / "tiny-av", TinySpec(sound=True, action=True))


@pytest.fixture(scope="session")
def tiny_distilled_ckpt(tmp_path_factory) -> Path:
    """A 4-step distilled folder as NVIDIA ships them (`make-tiny --distilled`: modular index only)."""
    return write_tiny(tmp_path_factory.mktemp("ckpt-4step") / "tiny-4step", TinySpec(distilled=True))


@pytest.fixture(scope="session")
def tiny_edge_ckpt(tmp_path_factory) -> Path:
    """The Cosmos3-Edge backbone (`make-tiny --edge`: relu2, Nemotron norms, UND k-norm for GEN)."""
    return write_tiny(tmp_path_factory.mktemp("ckpt-edge") / "tiny-edge", TinySpec(edge=True))


@pytest.fixture(scope="session")
def tiny_reasoner_ckpt(tmp_path_factory) -> Path:
    """The tiny model with the reasoner's files (`make-tiny --reasoner`: root config, ViT, processor)."""
    return write_tiny(tmp_path_factory.mktemp("ckpt-reason") / "tiny-reason", TinySpec(reasoner=True))


@pytest.fixture(scope="session")
def cond_image(tmp_path_factory) -> Path:
    # Not the output size on purpose: the pipeline resizes and centre-crops it.
    path = tmp_path_factory.mktemp("img") / "cond.png"
    pixels = (np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def moving_square(count: int, height: int = 32, width: int = 48, step: int = 1) -> list:
    """`count` RGB frames (uint8) of a bright square moving right by `step` pixels a frame on black: an edge
    map's kind of picture, the Transfer tests' control video."""
    import numpy as np

    frames = [np.zeros((height, width, 3), np.uint8) for _ in range(count)]
    for i, frame in enumerate(frames):
        frame[height // 4 : 5 * height // 8, step * i : step * i + width // 4] = 255
    return frames


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


def pytest_sessionfinish(session) -> None:
    # The launches the grids shared (tests/dist/jobs.py) end with the session that started them.
    from tests.dist.jobs import end_shared_launches

    end_shared_launches()


def x264_settings(path: Path) -> str:
    """The options x264 wrote into an MP4's stream (threads=N among them): what set-up made the file."""
    data = path.read_bytes()
    start = data.find(b"x264 - core")
    if start < 0:
        return "no x264 header"
    return data[start : start + 1000].split(b"\0")[0].decode(errors="replace")


def pytest_collection_finish(session) -> None:
    """What importing and collecting made (torch, diffusers, transformers, ~1,100 test items) lives as long as
    the worker: frozen out of the cyclic collector's reach (`gc.freeze`), the full collections the tests set
    off walk only what the tests made (as a job process does after its imports: cosmos3_batch/startup.py).
    The unit tier here: 232 CPU-s where it took 268."""
    import gc

    gc.freeze()
