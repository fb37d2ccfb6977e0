"""`plan --cache sea`: the estimate with a reuse share (time drops with the computing branches, the fetch
does not), and the pass simulator replaying a real run's recorded decisions: its passes, UND passes and
skipped passes equal the run's counters exactly."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.plan.cache import PUBLISHED_REUSE, SeaSettings, skip_share, step_decisions
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.simulator import PartBytes, SimRequest, simulate
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.unit.test_sea_fidelity import run_cached


def test_step_decisions_compute_where_any_branch_computes():
    assert step_decisions({"cond": "CRRC", "uncond": "CRCC"}) == "CRCC"
    assert step_decisions({"cond": "CRR"}) == "CRR"
    with pytest.raises(ValueError):
        step_decisions({"cond": "CR", "uncond": "CRR"})


def test_a_pass_every_active_request_reuses_is_skipped():
    """One rank, two slots: a and b admitted together (pass 0, UND); both reuse on pass 1 (skipped, no
    bytes), a alone on pass 2 (b computes: fetched), both compute on pass 3."""
    queue = [SimRequest("a", 4, 2, "CRRC"), SimRequest("b", 4, 1, "CRCC")]
    sim = simulate([queue], 2, PrefillRule(free_share=1.0, max_wait=0, lookahead=0), PartBytes(10, 7))
    assert (sim.passes, sim.und_passes, sim.skipped_passes, sim.bytes_per_rank) == (4, 1, 1, 3 * 10 + 7)


# Four identical requests decide alike; t2i beside them computes where they reuse on some passes only.
SAME = [{"id": f"same{k}", "prompt": "waves", "size": "48x32", "num_frames": 9, "seed": 5} for k in range(4)]
ROWS = [
    *[{**r, "num_inference_steps": 8} for r in SAME],
    {"id": "t2i", "prompt": "a red cube", "num_frames": 1, "size": "32x32", "num_inference_steps": 6},
]


@pytest.mark.parametrize("max_active", [2, 3])
def test_the_simulator_replays_a_runs_decisions_exactly(tiny_ckpt, tmp_path, max_active):
    requests, errors = load_requests(str(write_jsonl(tmp_path / "p.jsonl", ROWS)))
    assert errors == []
    results, runner = run_cached(tiny_ckpt, requests, max_active, SeaSettings(threshold=0.5))
    queue = [SimRequest(r.id, r.num_inference_steps, 2, step_decisions(results[r.id][1])) for r in requests]
    sim = simulate([queue], max_active, PrefillRule(), PartBytes(10, 7))
    assert runner.skipped_passes > 0  # the job is chosen so that whole passes reuse
    assert (sim.passes, sim.und_passes, sim.skipped_passes) == (
        runner.passes,
        runner.und_passes,
        runner.skipped_passes,
    )
    # Without the decisions the simulator predicts the same passes and none skipped.
    plain = simulate([[SimRequest(q.id, q.steps, 2) for q in queue]], max_active, PrefillRule())
    assert (plain.passes, plain.skipped_passes) == (runner.passes, 0)


def plan_doc(*args) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_plan_estimates_with_the_reuse_share(tiny_ckpt, tmp_path):
    prompts = str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "num_frames": 9, "size": "48x32"}]))
    # Resident (no fetch) on a slow device, so that the tiny model's pass is long enough to be resolved.
    common = [prompts, "--model", str(tiny_ckpt), "--offload", "resident", "--max-active", "1"]
    common += ["--tflops", "1e-4", "--hbm-gbps", "1e-3"]
    plain = plan_doc(*common)
    default = plan_doc(*common, "--cache", "sea")
    half = plan_doc(*common, "--cache", "sea", "--cache-reuse", "0.5")
    assert "cache" not in plain and plain["estimate"]["cache_reuse"] == 0.0
    assert default["cache"] == {**SeaSettings().record(), "reuse": PUBLISHED_REUSE}
    assert half["estimate"]["cache_reuse"] == 0.5
    # One request in flight: every pass it reuses is a pass no branch computes.
    assert half["estimate"]["skipped_share"] == skip_share(0.5, 1) == 0.5
    assert skip_share(0.5, 8) == 0.5**8 and skip_share(0.0, 8) == 0.0
    seconds = [d["estimate"]["seconds_per_pass"] for d in (plain, default, half)]
    assert seconds[0] > seconds[1] > seconds[2]
    assert plain["simulation"] == half["simulation"]  # the passes a request rides do not change
    # Offloaded, a pass that computes anything fetches every layer: the bytes per pass stay.
    moved = [prompts, "--model", str(tiny_ckpt), "--offload", "allgather", "--nproc", "2"]
    fetched = [plan_doc(*moved, *extra)["estimate"] for extra in ([], ["--cache", "sea"])]
    keys = ("bytes_h2d_per_pass", "bytes_gathered_per_pass")
    plain_bytes, cached_bytes = ([e[k] for k in keys] for e in fetched)
    assert plain_bytes == cached_bytes
    assert fetched[0]["bytes_h2d_per_pass"] > 0 and fetched[1]["skipped_share"] == skip_share(0.44, 8)


def test_plan_refuses_a_reuse_share_out_of_range(tmp_path):
    prompts = str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "num_frames": 1, "size": "32x32"}]))
    for share in ("1.0", "-0.1"):
        result = CliRunner().invoke(app, ["plan", prompts, "--cache", "sea", "--cache-reuse", share])
        assert result.exit_code == 2 and "--cache-reuse must be in [0, 1)" in result.output, result.output


def test_plan_help_names_the_reuse_flag_and_its_source():
    result = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert "--cache-reuse" in result.output and "PR #6922" in result.output, result.output
