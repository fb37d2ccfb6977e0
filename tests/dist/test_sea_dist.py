"""`--cache sea` in real `torchrun` jobs with gloo on CPU, world 2: allgather at --max-active 1 and 4, local,
and --sp 2 equal the single-process run (latents bit for bit, every branch's per-step decisions; that run
equals diffusers' cached pipeline: tests/unit/test_sea_fidelity.py); world-wide collectives identical on
every rank; and a job of identical requests admitted together, in which every branch of every rank reuses
at the same passes: those passes walk no layer and fetch nothing (the pass timeline and the fetch count
show it); and the pass simulator, replaying each job's recorded decisions, predicts its passes exactly."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cosmos3_batch.model.tiny import TinySpec, write_tiny
from tests.conftest import write_jsonl
from tests.dist.jobs import run_here, torchrun_jobs

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"size": "48x32", "num_frames": 9}
ROWS = [
    {"id": "t2i", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 8},
    {"id": "t2v", "prompt": "a cat walks", **SMALL, "num_inference_steps": 8, "seed": 1},
    {"id": "t2v-nocfg", "prompt": "a dog", **SMALL, "num_inference_steps": 6, "guidance_scale": 1.0},
    {"id": "i2v", "prompt": "swirl", **SMALL, "image": "first_frame.png", "num_inference_steps": 7},
    {"id": "v2v", "prompt": "drift", **SMALL, "video": "clip.mp4", "num_inference_steps": 8},
]
# Same prompt, seed and steps: the same latents at every step, so every branch decides alike at every pass.
SAME = [{"id": f"same{k}", "prompt": "waves", **SMALL, "num_inference_steps": 8, "seed": 5} for k in range(4)]
CACHE = ["--cache", "sea", "--cache-threshold", "0.5"]
LAYERS = 2  # the tiny model's


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sea")
    ckpt = write_tiny(folder / "tiny8", TinySpec(heads=8, kv_heads=2))  # --sp 2 divides its heads
    for name in ("first_frame.png", "clip.mp4"):
        (folder / name).write_bytes((ROOT / "examples" / name).read_bytes())
    return ckpt, write_jsonl(folder / "p.jsonl", ROWS), write_jsonl(folder / "same.jsonl", SAME), folder


def job(prompts, ckpt, out, *extra):
    return ["run", prompts, "--model", ckpt, "--out", out, "--no-progress", "--save-latents", *CACHE, *extra]


def outputs(out: Path, ids: list[str]) -> dict:
    found = {}
    for rid in ids:
        decisions = json.loads((out / f"{rid}.json").read_text())["cache"]["decisions"]
        found[rid] = (load_file(out / f"{rid}.latents.safetensors")["latents"], decisions)
    return found


def passes(out: Path, rank: int) -> list[dict]:
    with open(out / ".cosmos3_batch" / f"passes.rank{rank}.csv") as f:
        return list(csv.DictReader(f))


def replay(prompts: Path, out: Path, flags: list[str]) -> tuple[int, int, int]:
    """The pass simulator on the run's schedule (as `plan` builds it) with each request's decisions read
    back from its sidecar: (passes, UND passes, skipped passes)."""
    from cosmos3_batch.plan.branches import steps_and_texts
    from cosmos3_batch.plan.cache import step_decisions
    from cosmos3_batch.plan.prefill import PrefillRule
    from cosmos3_batch.plan.schedule import assign
    from cosmos3_batch.plan.simulator import SimRequest, simulate
    from cosmos3_batch.requests.parse import load_requests

    max_active, sp = int(flags[flags.index("--max-active") + 1]), 2 if "--sp" in flags else 1
    requests, errors = load_requests(str(prompts))
    assert errors == []
    queues = [
        [SimRequest(r.id, *steps_and_texts(r), step_decisions(outputs(out, [r.id])[r.id][1])) for r in queue]
        for queue in assign(requests, 2 // sp).queues
    ]
    sim = simulate(queues, max_active, PrefillRule(), ranks_per_queue=sp)
    return sim.passes, sim.und_passes, sim.skipped_passes


def test_world_2_equals_one_process_and_skips_fetches_together(setup):
    ckpt, prompts, same, folder = setup
    single = folder / "single"
    assert run_here(job(prompts, ckpt, single, "--max-active", "4")) == 0
    ids = [r["id"] for r in ROWS]
    expected = outputs(single, ids)
    configs = {
        "ag1": ["--max-active", "1"],
        "ag4": ["--max-active", "4"],
        "local4": ["--max-active", "4", "--offload", "local"],
        "sp2": ["--max-active", "2", "--sp", "2"],
        "same": ["--max-active", "2"],
    }
    jobs = [
        job(same if name == "same" else prompts, ckpt, folder / name, *flags)
        for name, flags in configs.items()
    ]
    assert torchrun_jobs(2, jobs, folder / "launch") == [0] * len(configs)
    reused = 0
    for name in ("ag1", "ag4", "local4", "sp2"):
        got = outputs(folder / name, ids)
        for rid in ids:
            assert got[rid][1] == expected[rid][1], (name, rid)
            assert got[rid][0].equal(expected[rid][0]), (name, rid)
            reused += sum(d.count("R") for d in got[rid][1].values())
        ranks = json.loads((folder / name / "summary.json").read_text())["ranks"]
        assert len({r["world_trace"] for r in ranks}) == 1, name
        if name == "ag4":  # a rank whose active branches all reuse still fetched the parts the other needed
            idle = [
                p
                for r in (0, 1)
                for p in passes(folder / name, r)
                if p["active"] != "0" and p["computed"] == "0" and p["fetch_skipped"] == "False"
            ]
            assert idle and all(int(p["weight_bytes"]) > 0 for p in idle)
    assert reused > 0
    for name in configs:  # the simulator, given the run's decisions, predicts its passes exactly
        rows = SAME if name == "same" else ROWS
        replayed = replay(same if name == "same" else prompts, folder / name, configs[name])
        ranks = json.loads((folder / name / "summary.json").read_text())["ranks"]
        for report in ranks:
            counters = (report["passes"], report["und_passes"], report["skipped_passes"])
            assert counters == replayed, (name, [r["id"] for r in rows])
    # Every branch of every rank reuses at the same passes: those passes fetch nothing, on both ranks.
    summary = json.loads((folder / "same" / "summary.json").read_text())
    decisions = outputs(folder / "same", [r["id"] for r in SAME])
    letters = {d for _, branches in decisions.values() for d in branches.values()}
    assert len(letters) == 1 and "R" in next(iter(letters))
    for report in summary["ranks"]:
        timeline = passes(folder / "same", report["rank"])
        skipped = [p for p in timeline if p["fetch_skipped"] == "True"]
        assert len(skipped) == report["skipped_passes"] == next(iter(letters)).count("R") > 0
        assert all(p["weight_bytes"] == "0" for p in skipped)
        assert all(int(p["weight_bytes"]) > 0 for p in timeline if p["fetch_skipped"] == "False")
        walked = report["passes"] - report["skipped_passes"]
        assert report["fetches"] == report["gathers"] == (walked + report["und_passes"]) * LAYERS
    assert len({r["world_trace"] for r in summary["ranks"]}) == 1
    assert summary["cache"]["skipped_passes"] == summary["ranks"][0]["skipped_passes"]
