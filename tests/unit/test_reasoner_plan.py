"""`plan`'s pass simulator counts a reasoner request's passes as the run does (issue 44 item 6): one pass a
generated token, every pass one is active on fetching the UND parts, beside generation requests."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.simulator import SimRequest, simulate
from tests.conftest import write_jsonl
from tests.dist.test_runs import assert_simulated, layer_bytes

T2V = {"prompt": "a ball rolls", "size": "32x32", "num_frames": 5, "num_inference_steps": 4}


def test_every_pass_with_an_active_reasoner_is_a_und_pass():
    queues = [[SimRequest("g", 6), SimRequest("r", 3, decodes=True)], [SimRequest("g2", 9)]]
    sim = simulate(queues, 1, PrefillRule(1.0, 0, 0), max_reason_active=1)
    # rank 0: g on passes 0-5 and r in its reasoner slot on 0-2 (each UND); rank 1: g2 on 0-8. UND: 0-2.
    assert (sim.passes, sim.und_passes, sim.outputs) == (9, 3, 3)
    assert sim.decode_passes == 3
    queues = [[SimRequest("g", 6), SimRequest("r", 3, decodes=True, chained=True)], [SimRequest("g2", 9)]]
    sim = simulate(queues, 1, PrefillRule(1.0, 0, 0), max_reason_active=1)
    # A caption stage rides the generation slot: r on passes 6-8 (UND: pass 0, pass 6 admits r, 7, 8).
    assert (sim.passes, sim.und_passes, sim.outputs, sim.decode_passes) == (9, 4, 3, 3)


def test_simulated_passes_equal_a_mixed_run(tiny_reasoner_ckpt, cond_image, tmp_path):
    rows = [
        {"id": "t2v", **T2V},
        {"id": "r1", "prompt": "Describe.", "reason": {"max_new_tokens": 6}},
        {"id": "r2", "prompt": "What is it?", "image": str(cond_image), "reason": {"max_new_tokens": 11}},
        {"id": "t2v-b", **T2V, "num_inference_steps": 2, "guidance_scale": 1.0},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    args = ["run", str(prompts), "--model", str(tiny_reasoner_ckpt), "--out", str(out), "--no-progress"]
    args += ["--device", "cpu"]  # no memory figure: the UND half streams (asserted below)
    result = CliRunner().invoke(app, [*args, "--max-active", "2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # The plan of the same requests, each reasoner's budget its tokens in the run (EOS may end one sooner).
    for row in rows[1:3]:
        row["reason"]["max_new_tokens"] = json.loads((out / f"{row['id']}.json").read_text())["reason"][
            "generated_tokens"
        ]
    planned = write_jsonl(tmp_path / "planned.jsonl", rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"][0]["und_passes"] > 2  # the reasoners' passes fetched UND
    assert_simulated(summary, planned, tiny_reasoner_ckpt, "allgather", 2, PrefillRule())
    # The run was on the CPU device: the UND half streamed (plan alone would hold it on an 80 GiB device).
    assert summary["config"]["reasoner_sizing"]["und_resident"]["value"] is False
    plan_args = ["plan", str(planned), "--model", str(tiny_reasoner_ckpt), "--json", "--no-und-resident"]
    plan = CliRunner().invoke(app, plan_args)
    work = json.loads(plan.output)["reason"]
    tokens = sum(row["reason"]["max_new_tokens"] for row in rows[1:3])
    assert (work["requests"], work["tokens_planned"]) == (2, tokens)
    sim = json.loads(plan.output)["simulation"]
    budgets = [row["reason"]["max_new_tokens"] for row in rows[1:3]]
    assert max(budgets) <= work["decode_passes"] == sim["decode_passes"] <= sum(budgets)
    assert work["und_bytes_per_token"] == sim["decode_und_bytes"] / tokens > 0


def _timeline(out) -> list[dict]:
    with open(out / ".cosmos3_batch" / "passes.rank0.csv") as f:
        return list(csv.DictReader(f))


def _run_planned(ckpt, rows: list[dict], folder, max_active: int, *flags: str) -> tuple[dict, list[dict]]:
    """Run the requests, then hold `plan`'s simulator to the run with each reasoner's budget its tokens in the
    run (EOS may end one sooner): (rank 0's report, its pass timeline)."""
    prompts = write_jsonl(folder / "p.jsonl", rows)
    out = folder / "out"
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress", "--device", "cpu"]
    args += flags  # on the CPU device: no memory figure, so the UND half streams (the asserts below)
    result = CliRunner().invoke(app, [*args, "--max-active", str(max_active)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    planned = [dict(row) for row in rows]
    for row in planned:
        if "reason" in row:
            sidecar = json.loads((out / f"{row['id']}.json").read_text())
            row["reason"] = {**row["reason"], "max_new_tokens": sidecar["reason"]["generated_tokens"]}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == []
    assert_simulated(summary, write_jsonl(folder / "planned.jsonl", planned), ckpt, "allgather", max_active,
                     PrefillRule())  # fmt: skip
    return summary["ranks"][0], _timeline(out)


def test_a_reasoner_only_job_moves_no_gen_byte(tiny_reasoner_ckpt, cond_image, tmp_path):
    """No rank has GEN work on any pass: every pass fetches the UND parts alone, and the bytes moved are the
    UND parts' alone (0 GEN bytes host->device and gathered), as `plan` predicts."""
    rows = [
        {"id": "r1", "prompt": "Describe.", "reason": {"max_new_tokens": 6}},
        {"id": "r2", "prompt": "What is it?", "image": str(cond_image), "reason": {"max_new_tokens": 4}},
    ]
    rank, timeline = _run_planned(tiny_reasoner_ckpt, rows, tmp_path, 2)
    sizes = layer_bytes(tiny_reasoner_ckpt, 1)
    assert rank["gen_passes"] == 0 and rank["und_passes"] == rank["passes"] > 0
    assert rank["h2d_bytes"] == rank["und_passes"] * sizes["und_shard"] and rank["gathered_bytes"] == 0
    assert rank["fetches"] == 2 * rank["und_passes"]  # 2 layers' UND parts, no GEN part
    assert [(p["und"], p["gen"]) for p in timeline] == [("True", "False")] * rank["passes"]


def test_a_mixed_job_fetches_gen_parts_while_its_t2i_request_is_active(tiny_reasoner_ckpt, tmp_path):
    """One T2I request (3 steps) beside reasoners with more tokens: the GEN parts are fetched on exactly the
    passes on which the T2I request takes a step (all admitted on pass 0: passes 0-2), the UND parts on every
    pass; the reasoner-only tail moves UND bytes alone; `plan` predicts the same counts and bytes."""
    rows = [
        {"id": "t2i", **T2V, "num_frames": 1, "num_inference_steps": 3},
        {"id": "r1", "prompt": "Describe.", "reason": {"max_new_tokens": 8}},
        {"id": "r2", "prompt": "What is it?", "reason": {"max_new_tokens": 7}},
    ]
    rank, timeline = _run_planned(tiny_reasoner_ckpt, rows, tmp_path, 3)
    assert rank["passes"] > 3  # a tail of reasoner-only passes
    assert [p["gen"] for p in timeline] == ["True"] * 3 + ["False"] * (rank["passes"] - 3)
    assert [p["und"] for p in timeline] == ["True"] * rank["passes"]
    sizes = layer_bytes(tiny_reasoner_ckpt, 1)
    assert rank["gen_passes"] == 3 and rank["und_passes"] == rank["passes"]
    assert rank["h2d_bytes"] == 3 * sizes["gen_shard"] + rank["passes"] * sizes["und_shard"]
    tail = [int(p["weight_bytes"]) for p in timeline[3:]]
    assert tail == [sizes["und_shard"]] * (rank["passes"] - 3)


def test_und_resident_streams_only_gen_parts_and_plan_counts_the_same(tiny_reasoner_ckpt, tmp_path):
    """--und-resident: the UND halves stay on the device, the same tokens come out, and the bytes moved are
    the GEN parts' alone, as `plan --und-resident` predicts (0 UND bytes per generated token)."""
    rows = [{"id": "t2v", **T2V}, {"id": "r1", "prompt": "Describe.", "reason": {"max_new_tokens": 5}}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    outs = {}
    for flag in ("--und-resident", "--no-und-resident"):
        out = outs[flag] = tmp_path / flag.strip("-")
        args = ["run", str(prompts), "--model", str(tiny_reasoner_ckpt), "--out", str(out), "--no-progress"]
        result = CliRunner().invoke(app, [*args, flag, "--save-latents"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    resident, streamed = (json.loads((outs[f] / "summary.json").read_text())["ranks"][0] for f in outs)
    ids = [json.loads((out / "r1.json").read_text())["reason"]["token_ids"] for out in outs.values()]
    assert ids[0] == ids[1] and len(ids[0]) == 5
    assert (resident["passes"], resident["und_passes"]) == (streamed["passes"], streamed["und_passes"])
    assert resident["fetches"] == streamed["fetches"] - streamed["und_passes"] * 2  # 2 layers' UND parts
    plan_args = ["plan", str(prompts), "--model", str(tiny_reasoner_ckpt), "--json", "--und-resident"]
    doc = json.loads(CliRunner().invoke(app, plan_args, catch_exceptions=False).output)
    assert doc["simulation"]["bytes_per_rank"] == resident["h2d_bytes"] + resident["gathered_bytes"]
    assert doc["reason"]["und_bytes_per_token"] == 0
    from safetensors.torch import load_file

    latents = [load_file(out / "t2v.latents.safetensors")["latents"] for out in outs.values()]
    assert latents[0].equal(latents[1])


def test_plan_counts_the_tokens_of_chained_stages(tiny_reasoner_ckpt, tmp_path):
    """A request's upsampling and its caption and score are reasoner tokens `plan` counts (issue 45): each
    stage's max_new_tokens, on top of the reasoner requests'."""
    rows = [
        {"id": "a", **T2V, "upsample": True, "caption_instruction": True, "score_instruction": "Rate 1-5."},
        {"id": "b", **T2V, "caption_instruction": "Name the colours."},
        {"id": "c", **T2V},
        {"id": "r", "prompt": "Describe.", "reason": {"max_new_tokens": 7}},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    args = ["plan", str(prompts), "--model", str(tiny_reasoner_ckpt)]
    args += ["--upsample-max-new-tokens", "40", "--caption-max-new-tokens", "9"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    work = json.loads(result.output)["reason"]
    # Only a upsamples (c follows the job: no --upsample); a has a caption and a score, b a caption.
    assert (work["upsample_tokens_planned"], work["caption_tokens_planned"]) == (40, 9 * 3)
    assert work["tokens_planned"] == 40 + 27 + 7
    assert work["requests"] == 1
    text = CliRunner().invoke(app, args).output
    assert "of which 40 upsampling prompts and 27 captioning and scoring outputs" in text
    every = json.loads(CliRunner().invoke(app, [*args, "--json", "--upsample", "--caption"]).output)["reason"]
    assert (every["upsample_tokens_planned"], every["caption_tokens_planned"]) == (40 * 3, 9 * 4)


def test_plan_counts_the_und_half_with_und_resident_and_says_whether_it_fits(tiny_reasoner_ckpt, tmp_path):
    """`plan --und-resident` (issue 44 items 3/6): every layer's UND part, whole on each rank (not its shard),
    is in the device line, its bytes those stored in the checkpoint, and the UND slot is gone; the plan says
    whether that fits --device-gib, and a plan without the flag says what it would take."""
    from safetensors.torch import load_file

    from cosmos3_batch.model.cosmos3 import UND, part_of

    stored = load_file(tiny_reasoner_ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    und = sum(
        t.numel() * t.element_size()
        for name, t in stored.items()
        if name.startswith("layers.") and part_of(name.split(".", 2)[2]) == UND
    )
    rows = [{"id": "t2v", **T2V}, {"id": "r1", "prompt": "Describe.", "reason": {"max_new_tokens": 5}}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)

    def plan(*flags) -> tuple[dict, str]:
        args = ["plan", str(prompts), "--model", str(tiny_reasoner_ckpt), "--nproc", "2", *flags]
        text = CliRunner().invoke(app, args, catch_exceptions=False).output
        doc = json.loads(CliRunner().invoke(app, [*args, "--json"], catch_exceptions=False).output)
        return doc, text

    (with_und, text), (without, hint) = plan("--und-resident"), plan("--no-und-resident")
    held, streamed = with_und["estimate"], without["estimate"]
    assert held["device_breakdown"]["und_resident"] == und > 0  # whole on each of the 2 ranks: not a shard
    assert "und_resident" not in streamed["device_breakdown"]
    assert sum(held["device_breakdown"].values()) == held["device_bytes_per_rank"]
    assert held["device_breakdown"]["slots"] < streamed["device_breakdown"]["slots"]  # no UND slot
    fit = with_und["und_resident"]
    assert fit == {**without["und_resident"], "held": True}  # the same figures, held or not
    assert fit["und_bytes_per_rank"] == und and fit["device_bytes_per_rank"] == held["device_bytes_per_rank"]
    assert fit["fits"] and "--und-resident: the UND half" in text and "fits --device-gib 80" in text
    assert "drop --no-und-resident" in hint
    # Left to the job, it is held: it fits the 80 GiB device (the decision `run` takes on such a GPU).
    auto, auto_text = plan()
    decision = auto["reasoner_sizing"]["und_resident"]
    assert auto["estimate"] == held and auto["und_resident"] == fit
    assert (decision["value"], decision["chosen_by"]) == (True, "default")
    assert "fits 72.00 GiB (80.00 GiB less a 10% reserve)" in decision["why"]
    assert "--und-resident (default: the device estimate with the UND half" in auto_text
    # 1 GiB: not even the CUDA runtime's constants (1.06 GiB) fit: forced, it is said; left to the job, off.
    small, small_text = plan("--und-resident", "--device-gib", "1")
    assert (
        not small["und_resident"]["fits"] and "does not fit --device-gib 1: drop --und-resident" in small_text
    )
    small, small_text = plan("--device-gib", "1")
    assert small["reasoner_sizing"]["und_resident"]["value"] is False and not small["und_resident"]["held"]
    assert (
        "does not fit 0.90 GiB (1.00 GiB less a 10% reserve)"
        in small["reasoner_sizing"]["und_resident"]["why"]
    )
    assert "und_resident" not in small["estimate"]["device_breakdown"]
    resident, _ = plan("--offload", "resident", "--und-resident")  # every part is on the device already
    assert "und_resident" not in resident and "und_resident" not in resident["estimate"]["device_breakdown"]


def test_plan_prices_a_decode_pass_both_ways(tiny_reasoner_ckpt, tmp_path):
    """Issue 44: a decode pass is as long as its slowest stream or its GEMMs; streamed at world 2 it copies
    half the UND half host->device and gathers the other half, resident it only reads the UND half from
    HBM. The figures are the arithmetic of the hardware flags, exactly, and the text says both."""
    from cosmos3_batch.plan.reason_plan import UND_BYTES_PER_PARAM

    rows = [{"id": f"r{i}", "prompt": "Describe.", "reason": {"max_new_tokens": 6}} for i in range(4)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    hw = ["--h2d-gbps", "0.5", "--gather-gbps", "2", "--hbm-gbps", "10", "--tflops", "5e-3"]
    model = ["--model", str(tiny_reasoner_ckpt)]
    args = ["plan", str(prompts), *model, "--nproc", "2", "--max-active", "2", *hw]
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"], catch_exceptions=False).output)
    text = CliRunner().invoke(app, args, catch_exceptions=False).output
    und = doc["und_resident"]["und_bytes_per_rank"]  # the UND half, as stored (the --und-resident test)
    tokens = doc["reason"]["tokens_per_decode_pass"]
    assert tokens == 4.0  # 2 ranks x 2 sequences, one token each
    compute = 2 * und / UND_BYTES_PER_PARAM * tokens / 2 / 5e9
    copy, gather, hbm = und / 2 / 0.5e9, und / 2 / 2e9, und / 10e9
    assert doc["reason"]["decode"] == {
        "pass_s_streamed": max(copy, gather, hbm, compute),
        "pass_s_und_resident": max(hbm, compute),
        "tokens_per_s_streamed": tokens / max(copy, gather, hbm, compute),
        "tokens_per_s_und_resident": tokens / max(hbm, compute),
    }
    assert copy > compute > hbm  # each branch of the max taken somewhere: a slow host link, slow GEMMs
    assert f"{copy * 1e3:.1f} ms streaming the UND parts (--offload allgather)" in text
    assert f"{compute * 1e3:.1f} ms with the UND half on the device" in text


def test_reasoners_beyond_max_active_share_passes_while_t2i_holds_the_generation_slot(
    tiny_reasoner_ckpt, cond_image, tmp_path
):
    """Issue 44 item 3: 6 reasoner requests and 2 T2I at --max-active 1 --max-reason-active 4 (world 1), both
    kinds on one queue in schedule order. The T2I requests hold the one generation slot one after the other
    (GEN parts on exactly their 8 steps, the first 8 passes) while 4 reasoner sequences share each pass beside
    them: neither kind waits for the other's slots. Token ids equal `generate`'s; `plan` predicts the passes,
    UND and GEN passes, bytes and both pools' occupancy exactly; summary.json and `plan` record the value."""
    from cosmos3_batch.plan.reason_memory import vision_counter
    from cosmos3_batch.requests.reason import ReasonSpec
    from tests.reasoner_reference import reference_ids

    prompts = ["Describe.", "What is it?", "Name a colour.", "Count to three.", "Say hello.", "Why?"]
    reasoners = [{"id": f"r{i}", "prompt": p, "reason": {"max_new_tokens": 6}} for i, p in enumerate(prompts)]
    reasoners[1]["image"] = str(cond_image)
    t2i = [{"id": f"t2i-{k}", **T2V, "num_frames": 1, "num_inference_steps": 4} for k in range(2)]
    rows = [t2i[0], *reasoners[:3], t2i[1], *reasoners[3:]]
    rank, timeline = _run_planned(tiny_reasoner_ckpt, rows, tmp_path, 1, "--max-reason-active", "4")
    out = tmp_path / "out"
    sidecars = {row["id"]: json.loads((out / f"{row['id']}.json").read_text()) for row in reasoners}
    for row in reasoners:
        spec = ReasonSpec(**row["reason"])
        expected = reference_ids(tiny_reasoner_ckpt, row["prompt"], spec, 0, row.get("image"))
        assert sidecars[row["id"]]["reason"]["token_ids"] == expected, row["id"]
    tokens = sum(s["reason"]["generated_tokens"] for s in sidecars.values())
    assert rank["reason_active_sum"] == tokens  # a reasoner is active one pass a token, in a reasoner slot
    assert rank["active_sum"] - tokens == 2 * 4  # the T2I requests' steps, in the generation slot
    assert int(timeline[0]["active"]) == 5  # the first T2I and 4 reasoner sequences share pass 0
    assert max(int(p["active"]) for p in timeline) == 5
    assert rank["gen_passes"] == 8 and [p["gen"] for p in timeline[:8]] == ["True"] * 8
    summary = json.loads((out / "summary.json").read_text())
    sizing = summary["config"]["reasoner_sizing"]
    assert summary["config"]["max_reason_active"] == 4 and sizing["max_reason_active"]["chosen_by"] == "flag"
    assert summary["config"]["und_resident"] is False and "the CPU device" in sizing["und_resident"]["why"]
    # plan sizes an image's K/V at the image processor's pixel bound (no file read): at least what it gave.
    config = json.loads((tiny_reasoner_ckpt / "preprocessor_config.json").read_text())
    bound = config["size"]["longest_edge"] // (config["patch_size"] * config["merge_size"]) ** 2
    counted = vision_counter(tiny_reasoner_ckpt, 65536)(SimpleNamespace(image="no/such/file.png", video=None))
    assert counted == bound >= sidecars["r1"]["reason"]["vision_tokens"] > 0
    args = ["plan", str(tmp_path / "planned.jsonl"), "--model", str(tiny_reasoner_ckpt), "--max-active", "1"]
    text = CliRunner().invoke(app, [*args, "--max-reason-active", "4"], catch_exceptions=False).output
    assert "reasoner memory: --max-reason-active 4 (given)" in text
