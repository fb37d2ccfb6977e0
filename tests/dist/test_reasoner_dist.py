"""Reasoner requests under real `torchrun` jobs (gloo, CPU; issue 44 item 4): at world 2, with allgather and
with local offload, and with requests prefilled ahead of their slot, token ids equal transformers' `generate`
(run here at the one thread torchrun gives each rank), beside a T2I request, with every rank issuing the same
collectives; GEN parts are fetched only on the T2I request's passes, and `plan` predicts every count."""

from __future__ import annotations

import json

import pytest
import torch

from cosmos3_batch.plan.prefill import PrefillRule
from tests.conftest import write_jsonl
from tests.dist.jobs import torchrun_jobs
from tests.dist.test_runs import assert_lockstep, assert_simulated, layer_bytes
from tests.unit.test_reasoner_fidelity import T2I, _expected, _rows

pytestmark = pytest.mark.dist
# (offload, --max-active, --prefill-lookahead, --sp): one reasoner slot with two prefilled ahead takes the
# ahead path; --sp 2: both ranks decode each sequence alike (UND is replicated in a group), the lead writes;
# --und-resident: the UND halves on the device, only GEN parts gathered. The reasoner slots are the CPU
# default (8) but where EXTRA says.
CONFIGS = [("allgather", 4, 0, 1), ("local", 1, 2, 1), ("allgather", 3, 0, 2), ("allgather", 4, 1, 1)]
EXTRA = {1: ["--max-reason-active", "1"], 3: ["--und-resident"]}


def test_reasoner_under_torchrun_world_2_equals_generate(tiny_reasoner_ckpt, cond_image, tmp_path):
    rows = _rows(cond_image)
    prompts = write_jsonl(tmp_path / "p.jsonl", [*rows, T2I])
    jobs = []
    for number, (mode, max_active, ahead, sp) in enumerate(CONFIGS):
        out = tmp_path / f"{number}-{mode}"
        jobs.append(
            ["run", prompts, "--model", tiny_reasoner_ckpt, "--out", out, "--offload", mode, "--sp", sp]
        )
        jobs[-1] += ["--max-active", max_active, "--prefill-lookahead", ahead, "--no-progress"]
        jobs[-1] += EXTRA.get(number, [])
    codes = torchrun_jobs(2, jobs, tmp_path / "launch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 gives each rank
    try:
        expected = {row["id"]: _expected(tiny_reasoner_ckpt, row) for row in rows}
    finally:
        torch.set_num_threads(threads)
    sizes = layer_bytes(tiny_reasoner_ckpt, 2)
    for number, ((mode, *_), code) in enumerate(zip(CONFIGS, codes, strict=True)):
        out = tmp_path / f"{number}-{mode}"
        assert code == 0, (mode, (tmp_path / "launch" / "stderr.txt").read_text()[-3000:])
        for row in rows:
            sidecar = json.loads((out / f"{row['id']}.json").read_text())
            assert sidecar["reason"]["token_ids"] == expected[row["id"]], (mode, row["id"])
        assert (out / "t2i.png").is_file()
        summary = json.loads((out / "summary.json").read_text())
        assert summary["generated_ok"] == len(rows) + 1 and summary["failed"] == []
        assert_lockstep(summary, 2)
        check_fetches(summary, number, sizes, tiny_reasoner_ckpt, out, rows, tmp_path)


def check_fetches(summary: dict, number: int, sizes: dict, ckpt, out, rows: list[dict], tmp_path) -> None:
    """GEN parts are fetched on exactly the passes the T2I request steps on (its 3 steps), on every rank: the
    reasoner-only passes move UND bytes alone (none with --und-resident); `plan` predicts the same counts and
    bytes, each reasoner's budget its tokens in the run (EOS may end one sooner)."""
    mode, max_active, ahead, sp = CONFIGS[number]
    und_resident = "--und-resident" in EXTRA.get(number, [])
    others = {half: sizes[f"{half}_full"] - sizes[f"{half}_shard"] for half in ("gen", "und")}
    for rank in summary["ranks"]:
        gen, und = rank["gen_passes"], 0 if und_resident else rank["und_passes"]
        assert gen == T2I["num_inference_steps"] < rank["und_passes"] <= rank["passes"]
        assert rank["fetches"] == 2 * (gen + und)  # 2 layers
        if mode == "allgather":
            assert rank["h2d_bytes"] == gen * sizes["gen_shard"] + und * sizes["und_shard"]
            assert rank["gathered_bytes"] == gen * others["gen"] + und * others["und"]
    planned = [
        {**row, "reason": {**row["reason"], "max_new_tokens": reason_tokens(out, row["id"])}} for row in rows
    ]
    prompts = write_jsonl(tmp_path / f"planned-{number}.jsonl", [*planned, T2I])
    rule = PrefillRule(lookahead=ahead)
    assert_simulated(summary, prompts, ckpt, mode, max_active, rule, sp, tuple(EXTRA.get(number, [])))


def reason_tokens(out, rid: str) -> int:
    return json.loads((out / f"{rid}.json").read_text())["reason"]["generated_tokens"]
