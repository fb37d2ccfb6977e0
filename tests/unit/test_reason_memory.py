"""--und-resident and --max-reason-active left to the job (plan/reason_memory.py): the one function `plan` and
`run` decide with, by hand; `plan` printing it and a CPU run recording it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.pipeline.job.sizing import smallest
from cosmos3_batch.plan.reason_memory import (
    CHAT_TOKENS,
    CPU_REASON_SLOTS,
    MAX_REASON_SLOTS,
    prompt_bound,
    sequence_kv,
    size_reasoner,
)
from tests.conftest import write_jsonl

GIB = 2**30
REASON = SimpleNamespace(id="r", reason=SimpleNamespace(max_new_tokens=10), upsample=None, captions=None)
T2I = SimpleNamespace(id="g", reason=None, upsample=None, captions=None)
ALLGATHER = OffloadMode.ALLGATHER


def sized(
    requests, flags=(None, None), device=80 * GIB, need=(30 * GIB, 20 * GIB), kv=(GIB, 100), mode=ALLGATHER
):
    """`need`: plan's device estimate (with the UND half, without it); `kv`: one sequence's K/V and tokens.
    Either raises when called where the decision must not need it."""
    asked = []

    def estimate(und: bool) -> int:
        asked.append(und)
        return need[0] if und else need[1]

    sizing = size_reasoner(requests, mode, flags, device, estimate, lambda: kv)
    return sizing, asked


def test_und_resident_fits_does_not_fit_cpu_and_forced():
    fits, asked = sized([REASON, T2I])
    assert (fits.und_resident.value, fits.und_resident.chosen_by) == (True, "default")
    assert "30.00 GiB, fits 72.00 GiB (80.00 GiB less a 10% reserve)" in fits.und_resident.why
    assert asked[0] is True
    tight, _ = sized([REASON], device=32 * GIB)  # 30 GiB would fit 32, not the 28.8 the reserve leaves
    assert tight.und_resident.value is False and "does not fit 28.80 GiB" in tight.und_resident.why
    cpu, asked = sized([REASON], device=None)
    assert cpu.und_resident.value is False and "CPU device" in cpu.und_resident.why and asked == []
    for flag in (True, False):  # either flag forces it, fits or not, CPU or not
        for device in (None, 25 * GIB, 80 * GIB):
            forced, _ = sized([REASON], (flag, None), device)
            assert (forced.und_resident.value, forced.und_resident.chosen_by) == (flag, "flag")
        # --offload resident holds every layer already: recorded off, whatever the flag
        held = sized([REASON], (flag, None), mode=OffloadMode.RESIDENT)[0].und_resident
        assert (held.value, held.chosen_by) == (False, "default") and "--offload resident" in held.why
    alone, asked = sized([T2I])  # nothing decodes: off, nothing estimated
    assert alone.und_resident.value is False and "no reasoner decoding" in alone.und_resident.why
    caption = SimpleNamespace(
        **{**vars(T2I), "captions": SimpleNamespace(max_new_tokens=5, tasks=lambda: [1])}
    )
    assert sized([caption])[0].und_resident.value is True  # a caption stage decodes too
    assert sized([REASON], mode=OffloadMode.RESIDENT)[0].und_resident.value is False  # on the device anyway


def test_reason_slots_from_the_memory_left_capped_and_floored():
    # 80 GiB less the 10% reserve (72) less the estimate with the UND half held (30): 42 sequences of 1 GiB.
    sizing, _ = sized([REASON, T2I])
    assert (sizing.max_reason_active.value, sizing.max_reason_active.chosen_by) == (42, "default")
    assert "42.00 GiB left after the device estimate and the 10% reserve" in sizing.max_reason_active.why
    # Not held (forced off): the estimate without it, 20 GiB: 52 left.
    assert sized([REASON], (False, None))[0].max_reason_active.value == 52
    # Requests prefilled ahead of a slot hold their K/V too: 3 fewer.
    ahead = size_reasoner([REASON], ALLGATHER, (None, None), 80 * GIB, lambda u: 30 * GIB, lambda: (GIB, 9),
                          lookahead=3)  # fmt: skip
    assert ahead.max_reason_active.value == 39 and "less the 3 prefilled ahead" in ahead.max_reason_active.why
    assert sized([REASON], kv=(GIB // 8, 10))[0].max_reason_active.value == MAX_REASON_SLOTS  # capped
    assert sized([REASON], device=27 * GIB, kv=(4 * GIB, 10))[0].max_reason_active.value == 1  # floored
    assert sized([REASON], device=10 * GIB)[0].max_reason_active.value == 1  # nothing left: still 1
    assert sized([REASON], device=None)[0].max_reason_active.value == CPU_REASON_SLOTS
    assert sized([REASON], (None, 3), device=None)[0].max_reason_active.value == 3
    assert sized([T2I])[0].max_reason_active.why == "no reasoner requests: no reasoner slot is used"


def test_a_sequence_keeps_every_layer_k_and_v_of_its_tokens():
    shape = SimpleNamespace(layers=3, kv_heads=2, head_dim=8, act_bytes=2)
    other = SimpleNamespace(id="s", reason=SimpleNamespace(max_new_tokens=4), upsample=None, captions=None)
    kv, tokens = sequence_kv(shape, [REASON, T2I, other], {"r": 7, "s": 30, "g": 99}, lambda r: 5)
    assert tokens == 30 + 5 + 4  # the longest reasoner sequence; the T2I request's tokens do not count
    assert kv == 3 * 2 * 2 * 8 * tokens * 2
    # A prompt outside plan's tokenizer sample: its UTF-8 bytes (and its system message's) + the template's.
    spec = SimpleNamespace(max_new_tokens=4, system="Be")
    unsampled = SimpleNamespace(id="u", prompt="Décris.", reason=spec)
    assert prompt_bound(unsampled) == len("Décris.".encode()) + 2 + CHAT_TOKENS == 8 + 2 + CHAT_TOKENS
    assert sequence_kv(shape, [REASON, unsampled], {"r": 7}, lambda r: 0)[1] == prompt_bound(unsampled) + 4


def test_every_rank_sizes_from_the_smallest_device(monkeypatch):
    assert smallest([80 * GIB, 79 * GIB]) == 79 * GIB
    assert smallest([None, None]) is None
    # The figure rides the start's plan check: each rank's own in, the smallest out, the same on every rank;
    # ranks that planned different requests still stop there.
    from cosmos3_batch.pipeline.job import run as job_run

    monkeypatch.setattr(job_run, "device_memory", lambda device: 80 * GIB)
    plan = SimpleNamespace(requests=[])
    peers = {"same": lambda mine: [mine, (mine[0], 79 * GIB), (mine[0], 81 * GIB)],
             "other": lambda mine: [mine, ("another digest", 79 * GIB)]}  # fmt: skip
    world = SimpleNamespace(device=None, all_gather_object=peers["same"])
    assert job_run._check_same_plan(world, plan) == 79 * GIB
    world.all_gather_object = peers["other"]
    with pytest.raises(RuntimeError, match="ranks planned different request lists"):
        job_run._check_same_plan(world, plan)


@pytest.mark.parametrize("device_gib", ["80", "0.001"])
def test_plan_prints_and_a_cpu_run_records_the_choice(tiny_reasoner_ckpt, tmp_path, device_gib):
    rows = [{"id": f"r{i}", "prompt": "Describe.", "reason": {"max_new_tokens": 3}} for i in range(3)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    args = ["plan", str(prompts), "--model", str(tiny_reasoner_ckpt), "--device-gib", device_gib]
    text = CliRunner().invoke(app, args, catch_exceptions=False).output
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"], catch_exceptions=False).output)
    slots = doc["reasoner_sizing"]["max_reason_active"]
    if device_gib == "80":  # a tiny model: the cap
        assert (slots["value"], slots["chosen_by"]) == (MAX_REASON_SLOTS, "default")
        assert f"reasoner memory: --max-reason-active {MAX_REASON_SLOTS} (default: " in text
        assert "--und-resident (default: " in text
        return
    assert slots["value"] == 1 and "--no-und-resident (default: " in text  # nothing left: 1, streamed
    out = tmp_path / "out"
    run = ["run", str(prompts), "--model", str(tiny_reasoner_ckpt), "--out", str(out), "--no-progress"]
    run += ["--device", "cpu"]  # no memory figure there (a GPU host's auto would size from its device)
    assert CliRunner().invoke(app, run, catch_exceptions=False).exit_code == 0
    config = json.loads((out / "summary.json").read_text())["config"]
    assert (config["max_reason_active"], config["und_resident"]) == (CPU_REASON_SLOTS, False)
    assert config["reasoner_sizing"]["max_reason_active"]["why"].startswith(f"{CPU_REASON_SLOTS} on the CPU")


@pytest.mark.parametrize("device_gib", [80, 0.001])
def test_run_decides_as_plan_does_for_the_same_device(tiny_reasoner_ckpt, cond_image, tmp_path, device_gib):
    """A run on a device of N GiB (its figure handed in as on CUDA) takes the decisions `plan --device-gib N`
    prints: the same function on the same inputs (the flags, the requests, the checkpoint's shape)."""
    from cosmos3_batch.config import make_config
    from cosmos3_batch.parallel.world import World
    from cosmos3_batch.pipeline.job.run import plan_run
    from cosmos3_batch.pipeline.job.sizing import size_run

    rows = [
        {"id": "t2i", "prompt": "a ball", "size": "32x32", "num_frames": 1, "num_inference_steps": 2},
        {"id": "r1", "prompt": "What is it?", "image": str(cond_image), "reason": {"max_new_tokens": 20}},
        {"id": "r2", "prompt": "Describe.", "reason": {"max_new_tokens": 5}},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = make_config("allgather", None, model=tiny_reasoner_ckpt, prompts=prompts, out=tmp_path / "out")
    run_cfg, record = size_run(cfg, World(), plan_run(cfg), int(device_gib * GIB))
    args = [
        "plan",
        str(prompts),
        "--model",
        str(tiny_reasoner_ckpt),
        "--device-gib",
        str(device_gib),
        "--json",
    ]
    planned = json.loads(CliRunner().invoke(app, args, catch_exceptions=False).output)["reasoner_sizing"]
    assert record == planned
    assert (run_cfg.und_resident, run_cfg.max_reason_active) == (
        record["und_resident"]["value"],
        record["max_reason_active"]["value"],
    )
    assert run_cfg.und_resident is (device_gib == 80)
