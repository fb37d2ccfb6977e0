"""Real `torchrun` jobs with gloo on CPU: every mode and world size reproduces the single-process run
bit for bit, every rank issues the same collectives, and edge cases finish cleanly."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.checkpoint.reader import TensorStore
from cosmos3_batch.cli import app
from cosmos3_batch.engine.layout import ParamSpec, build_part_layout
from cosmos3_batch.model.cosmos3 import GEN, layer_parts
from cosmos3_batch.model.loading import build_transformer_on_meta
from cosmos3_batch.plan.prefill import PrefillRule
from tests.conftest import assert_same_outputs, write_jsonl
from tests.dist.jobs import ENV, JOB_PYTHON, free_port, run_here, torchrun_jobs

pytestmark = pytest.mark.dist


MIX = 10  # requests in the shared mix


def random_mix(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        frames = rng.choice([1, 1, 5, 9])
        row = {
            "id": f"r{i}",
            "prompt": rng.choice(["a cat", "ocean waves at night", "a busy street", "snow"]),
            "num_frames": frames,
            "size": rng.choice(["32x32", "48x32", "32x64"]),
            "num_inference_steps": rng.randint(1, 4),
            "guidance_scale": rng.choice([1.0, 4.0, 6.0]),
        }
        if rng.random() < 0.5:
            row["flow_shift"] = rng.choice([2.0, 7.0])
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def mix(tmp_path_factory, tiny_ckpt):
    folder = tmp_path_factory.mktemp("mix")
    prompts = write_jsonl(folder / "mix.jsonl", random_mix(seed=0, count=MIX))
    ref = folder / "ref"
    args = ["run", prompts, "--model", tiny_ckpt, "--out", ref, "--offload", "resident", "--save-latents"]
    assert run_here([*args, "--no-progress"]) == 0
    return prompts, ref


def layer_bytes(tiny_ckpt: Path, world_size: int) -> dict[str, int]:
    """Sum of shard bytes of all UND parts and of all GEN parts, from the engine's own layout rules."""
    ckpt = Checkpoint.open(tiny_ckpt)
    store = TensorStore(tiny_ckpt / "transformer")
    model = build_transformer_on_meta(ckpt.config("transformer"))
    sums = {"und_shard": 0, "gen_shard": 0, "und_full": 0, "gen_full": 0}
    for key, params in layer_parts(model.layers):
        layout = build_part_layout(
            key, [ParamSpec(name, *store.info(name)) for _, _, name in params], world_size
        )
        half = "gen" if key.endswith(GEN) else "und"
        sums[f"{half}_shard"] += layout.shard_bytes
        sums[f"{half}_full"] += layout.nbytes
    return sums


def assert_simulated(
    summary: dict,
    prompts: Path,
    tiny_ckpt: Path,
    mode: str,
    max_active: int,
    rule: PrefillRule,
    sp: int = 1,
    extra: tuple[str, ...] = (),
) -> None:
    """`plan --json`'s pass simulator predicted this run's passes, UND passes, GEN passes, bytes and the
    occupancy of both pools of slots exactly. `extra`: more of the run's flags that `plan` takes too; the
    reasoner's slots and UND residency are the run's as taken (summary.json's config)."""
    world, config = len(summary["ranks"]), summary["config"]
    args = ["plan", str(prompts), "--model", str(tiny_ckpt), "--nproc", str(world), "--offload", mode]
    args += ["--sp", str(sp), *extra, "--max-reason-active", str(config["max_reason_active"])]
    args += ["--und-resident" if config["und_resident"] else "--no-und-resident"]
    args += ["--max-active", str(max_active), "--prefill-free-share", str(rule.free_share)]
    args += ["--prefill-max-wait", str(rule.max_wait), "--prefill-lookahead", str(rule.lookahead), "--json"]
    args += ["--chunk-gap-passes", str(rule.chunk_gap)]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    sim = json.loads(result.output)["simulation"]
    ranks = summary["ranks"]
    assert (sim["passes"], sim["und_passes"]) == (ranks[0]["passes"], ranks[0]["und_passes"])
    assert isinstance(sim["passes"], int) and isinstance(sim["und_passes"], int)
    assert [r["gen_passes"] for r in ranks] == [sim["gen_passes"]] * world
    assert [r["h2d_bytes"] + r["gathered_bytes"] for r in ranks] == [sim["bytes_per_rank"]] * world
    reasoning = sum(r["reason_active_sum"] for r in ranks) // sp  # an --sp group's requests count once
    active = sum(r["active_sum"] for r in ranks) // sp - reasoning
    assert active == round(sim["occupancy"] * sim["passes"] * (world // sp) * max_active)
    slot_passes = sim["passes"] * (world // sp) * config["max_reason_active"]
    assert reasoning == round(sim["reason_occupancy"] * slot_passes)


def assert_lockstep(summary: dict, world_size: int) -> None:
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world_size))
    for key in ("passes", "und_passes", "all_reduces", "gathers", "fetches", "collective_trace"):
        assert len({r[key] for r in ranks}) == 1, (key, [r[key] for r in ranks])
    assert ranks[0]["all_reduces"] == ranks[0]["passes"] + 1  # one per pass, and the one that ends the run


# The allgather runs at 2-4 ranks also take the prefill rules' extremes (look-ahead, every starved slot,
# a long wait): prefilled-ahead requests, waits and coalesced UND passes change when UND runs, never outputs.
# (mode, world) -> (--max-active, prefill rule); the outputs must not depend on --max-active either.
CONFIGS = {
    ("allgather", 1): (2, PrefillRule()),
    ("allgather", 2): (2, PrefillRule(0.5, 1, 3)),
    ("allgather", 3): (3, PrefillRule(1.0, 0, 0)),
    ("allgather", 4): (2, PrefillRule(0.25, 6, 1)),
    **{
        (mode, world): (1 + world % 3, PrefillRule())
        for mode in ("local", "sharded")
        for world in (1, 2, 3, 4)
    },
}


def grid_job(mode: str, world_size: int, prompts: Path, tiny_ckpt: Path, out: Path) -> list:
    max_active, rule = CONFIGS[mode, world_size]
    args = ["run", prompts, "--model", tiny_ckpt, "--out", out, "--offload", mode, "--save-latents"]
    args += ["--prefill-free-share", rule.free_share, "--prefill-max-wait", rule.max_wait]
    return [*args, "--prefill-lookahead", rule.lookahead, "--max-active", max_active, "--no-progress"]


def check_grid_run(mode: str, world_size: int, prompts: Path, ref: Path, tiny_ckpt: Path, out: Path) -> None:
    max_active, rule = CONFIGS[mode, world_size]
    assert_same_outputs(ref, out, [f"r{i}" for i in range(MIX)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_ok"] == MIX and summary["failed"] == []
    assert_lockstep(summary, world_size)
    assert_simulated(summary, prompts, tiny_ckpt, mode, max_active, rule)
    # Every branch ran its UND half exactly once, prefilled ahead or not.
    branches = sum(1 if row["guidance_scale"] == 1.0 else 2 for row in random_mix(0, MIX))
    assert sum(r["und_runs"] for r in summary["ranks"]) == branches * 2  # x 2 layers
    sizes = layer_bytes(tiny_ckpt, world_size)
    layers = 2
    for rank in summary["ranks"]:
        passes, und_passes = rank["passes"], rank["und_passes"]
        assert rank["fetches"] == layers * (passes + und_passes)
        shard = passes * sizes["gen_shard"] + und_passes * sizes["und_shard"]
        full = passes * sizes["gen_full"] + und_passes * sizes["und_full"]
        if mode == "allgather":
            assert rank["h2d_bytes"] == shard
        if mode == "sharded":
            assert rank["h2d_bytes"] == 0
        if mode in ("allgather", "sharded"):
            assert rank["gathered_bytes"] == (full - shard if world_size > 1 else 0)
        if mode == "local":
            assert rank["gathered_bytes"] == 0 and 0 < rank["h2d_bytes"] <= full


# Edge cases that ride on a grid launch of their world size: (job arguments, check of (exit code, out)).
def more_ranks_than_requests(folder: Path, prompts: Path, ref: Path, tiny_ckpt: Path):
    one = write_jsonl(folder / "one.jsonl", [json.loads(prompts.read_text().splitlines()[2])])
    out = folder / "out"

    def check(code: int) -> None:
        assert code == 0
        assert_same_outputs(ref, out, ["r2"])
        assert_lockstep(json.loads((out / "summary.json").read_text()), 3)

    return ["run", one, "--model", tiny_ckpt, "--out", out, "--save-latents", "--no-progress"], check


def zero_valid_requests_finish_cleanly(folder: Path, prompts: Path, ref: Path, tiny_ckpt: Path):
    bad = folder / "bad.jsonl"
    bad.write_text('{"prompt": ""}\n{"prompt": "x", "size": "33x32"}\n')
    out = folder / "out"

    def check(code: int) -> None:
        assert code == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["generated_ok"] == 0 and len(summary["invalid"]) == 2
        # Nothing to generate: every rank returns before loading the model, so no pass and no rank report.
        assert summary["ranks"] == [] and "interrupted" not in summary

    return ["run", bad, "--model", tiny_ckpt, "--out", out, "--skip-invalid", "--no-progress"], check


def rank_whose_every_request_fails(folder: Path, prompts: Path, ref: Path, tiny_ckpt: Path):
    rows = [
        {"id": f"f{i}", "prompt": "x", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}
        for i in range(2)
    ]
    failing = write_jsonl(folder / "p.jsonl", rows)
    out = folder / "out"
    for i in range(2):
        (out / f"f{i}.png").mkdir(parents=True)  # every write fails: a directory is in the way

    def check(code: int) -> None:
        assert code == 1
        summary = json.loads((out / "summary.json").read_text())
        assert sorted(f["id"] for f in summary["failed"]) == ["f0", "f1"]
        assert_lockstep(summary, 2)

    return ["run", failing, "--model", tiny_ckpt, "--out", out, "--no-progress"], check


def requests_from_standard_input(folder: Path, prompts: Path, ref: Path, tiny_ckpt: Path):
    """`run -` under torchrun: rank 0 reads the mix from the launcher's standard input for every rank."""
    out = folder / "out"

    def check(code: int) -> None:
        assert code == 0
        assert_same_outputs(ref, out, [f"r{i}" for i in range(MIX)])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["config"]["prompts"] == ["-"] and summary["generated_ok"] == MIX
        assert_lockstep(summary, 2)

    return ["run", "-", "--model", tiny_ckpt, "--out", out, "--save-latents", "--no-progress"], check


EDGE_CASES = {
    2: [zero_valid_requests_finish_cleanly, rank_whose_every_request_fails, requests_from_standard_input],
    3: [more_ranks_than_requests],
}


@pytest.mark.parametrize("world_size", sorted({world for _, world in CONFIGS}))
def test_modes_and_world_sizes_are_bit_exact(mix, tmp_path, tiny_ckpt, world_size):
    """Every offload mode of this world size, then its edge cases, in one launch (tests/dist/jobs.py)."""
    prompts, ref = mix
    modes = [mode for mode, world in CONFIGS if world == world_size]
    jobs = [grid_job(mode, world_size, prompts, tiny_ckpt, tmp_path / mode) for mode in modes]
    checks = []
    for case in EDGE_CASES.get(world_size, []):
        (tmp_path / case.__name__).mkdir()
        args, check = case(tmp_path / case.__name__, prompts, ref, tiny_ckpt)
        jobs.append(args)
        checks.append(check)
    codes = torchrun_jobs(world_size, jobs, tmp_path / "launch", stdin=prompts.read_bytes())
    for mode, code in zip(modes, codes, strict=False):
        assert code == 0, (mode, (tmp_path / "launch" / "stderr.txt").read_text()[-3000:])
        check_grid_run(mode, world_size, prompts, ref, tiny_ckpt, tmp_path / mode)
    for check, code in zip(checks, codes[len(modes) :], strict=True):
        check(code)  # a failure's traceback names the case


def kill_rank_1_midrun(run_args: list[str], out: Path) -> tuple[subprocess.Popen, float, str]:
    """Two ranks as plain processes (no torchrun to tear the survivor down); once a first sidecar exists,
    SIGKILL rank 1 (request ids start with k). (rank 0, seconds from the kill until it exited, its stderr)."""
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [JOB_PYTHON, "-m", "cosmos3_batch", "run", *run_args, "--out", str(out)]
    # The survivor's meeting waits min(timeout, 60 s) for the dead rank, which never comes: 10 s, as
    # test_stall.py's stalls (above the start-up skew of two ranks on a busy 2-core machine).
    cmd += ["--max-active", "1", "--no-progress", "--collective-timeout-s", "10"]
    procs = [
        subprocess.Popen(
            cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + 120
    while not list(out.glob("k*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(out.glob("k*.json")), "no request finished before the kill"
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    stderr = procs[0].communicate(timeout=120)[1]
    seconds = time.monotonic() - killed_at
    procs[1].wait()
    return procs[0], seconds, stderr


def test_killing_one_rank_makes_the_other_exit(tmp_path, tiny_ckpt):
    rows = [
        {"id": f"k{i}", "prompt": "x", "num_frames": 1, "size": "32x32", "num_inference_steps": 40}
        for i in range(8)
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    survivor, seconds, stderr = kill_rank_1_midrun(
        [str(prompts), "--model", str(tiny_ckpt)], tmp_path / "out"
    )
    assert survivor.returncode == 69  # a peer stalled or died (DESIGN.md §6): requeue the job
    assert seconds < 60
    # One line naming the rank that left and where the job was (parallel/stall.py), no traceback.
    assert re.search(r"rank 1 (left the job|did not arrive within) ", stderr), stderr[-2000:]
    assert "Traceback" not in stderr
