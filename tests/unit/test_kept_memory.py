"""plan counts what a job keeps between steps (issue 43): Transfer's controls and decoded pieces in host
memory per rank, SeaCache's residuals on the device (plan/kept_memory.py), in the estimate and its text."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.plan.hardware import Hardware
from cosmos3_batch.plan.kept_memory import TRANSFER_AHEAD, cache_device_bytes, transfer_host_bytes
from cosmos3_batch.plan.model_shape import model_shape
from cosmos3_batch.plan.planner import estimate
from cosmos3_batch.plan.schedule import gen_tokens
from cosmos3_batch.plan.text import describe
from cosmos3_batch.requests.parse import parse_lines


def chain(frames: int, controls: int, chunk: int = 93, size=(720, 1280)):
    spec = SimpleNamespace(controls=(("edge", "e.mp4"),) * controls, chunk_frames=chunk)
    return SimpleNamespace(transfer=spec, num_frames=frames, height=size[0], width=size[1])


def test_a_720p_chain_keeps_its_controls_in_the_transformer_dtype_and_its_pieces_in_float32():
    one = chain(189, 1)
    control, pieces = 3 * 189 * 720 * 1280 * 2, 3 * 189 * 720 * 1280 * 4  # ~1 GiB bf16, ~2 GiB float32
    assert transfer_host_bytes([one], max_active=1, control_bytes=2, ahead=0) == control + pieces
    # K chains at once (the largest count) and the controls of those prepared ahead of admission.
    small, two = chain(93, 1), chain(189, 2)
    got = transfer_host_bytes([one, small, two], max_active=2, control_bytes=2, ahead=1)
    assert got == (2 * control + pieces) + (control + pieces) + 3 * 93 * 720 * 1280 * 2  # small: ahead
    assert transfer_host_bytes([SimpleNamespace(transfer=None)], 4, 2) == 0
    assert TRANSFER_AHEAD == 2


def test_the_cache_keeps_order_plus_one_residuals_and_an_input_per_branch():
    requests, errors = parse_lines([b'{"id": "a", "prompt": "x", "size": "64x64", "num_frames": 1}'])
    assert errors == []
    tokens = gen_tokens(requests[0])
    # CFG: two branches, each residual_order + 1 = 2 residuals, and the request's one stack input.
    assert cache_device_bytes(requests, 4, 1, hidden=64, act_bytes=2) == (2 * 2 + 1) * tokens * 64 * 2


def test_the_estimate_and_its_text_carry_both(tiny_ckpt):
    from cosmos3_batch.checkpoint.folder import Checkpoint

    shape = model_shape(Checkpoint.open(tiny_ckpt), 1, torch.bfloat16)
    requests, _ = parse_lines([b'{"id": "a", "prompt": "x", "size": "64x64", "num_frames": 1}'])
    est = estimate(shape, requests, {"a": 10}, 1, 1, OffloadMode.ALLGATHER, 1, Hardware(), cache_order=1)
    expected = cache_device_bytes(requests, 1, 1, shape.hidden, shape.act_bytes)
    assert est.device_breakdown["cache_residuals"] == expected > 0
    assert est.device_bytes_per_rank == sum(est.device_breakdown.values())
    assert "cache_residuals" not in estimate(shape, requests, {"a": 10}, 1, 1, OffloadMode.ALLGATHER, 1,
                                             Hardware()).device_breakdown  # fmt: skip
    assert est.transfer_host_bytes_per_rank == 0 and "Transfer per rank" not in describe(est)
    assert "--cache sea, each request's residuals" in describe(est)


def test_plan_shows_a_transfer_jobs_host_memory(tmp_path, tiny_ckpt):
    import imageio

    from cosmos3_batch.plan.job_plan import plan_job
    from tests.conftest import moving_square, write_jsonl

    imageio.mimwrite(tmp_path / "edge.mp4", moving_square(9), fps=8)
    rows = [{"id": "tr", "prompt": "night", "control": {"edge": "edge.mp4"}, "size": "48x32"}]
    doc, text = plan_job(str(write_jsonl(tmp_path / "p.jsonl", rows)), str(tiny_ckpt), 1, 1, "allgather", 1,
                         Hardware())  # fmt: skip
    got = doc["estimate"]["transfer_host_bytes_per_rank"]
    frames = 9  # the control's length, which the chunk covers
    assert got == 3 * frames * 32 * 48 * 4 * 2  # its controls and pieces, in float32
    assert "+ Transfer per rank" in text
