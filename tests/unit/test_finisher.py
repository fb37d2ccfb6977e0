"""Decoding happens off the pass loop: passes go on while a finished request is being decoded."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from cosmos3_batch.pipeline.finish.finisher import Finisher
from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.kinds.denoise import RequestJob
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.requests.parse import parse_lines


def test_passes_continue_while_a_finished_request_decodes(tiny_ckpt, monkeypatch):
    requests, errors = parse_lines(
        [
            b'{"id": "short", "prompt": "a", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}',
            b'{"id": "long", "prompt": "b", "num_frames": 1, "size": "32x32", "num_inference_steps": 4}',
        ]
    )
    assert errors == []
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    reached = threading.Event()
    passes_seen_by_decode = []
    real_decode = RequestJob.decode

    def decode(job):
        if job.request.id == "short":
            # Held until the loop has run the long request's remaining passes: with an inline decode the
            # loop would be stuck right here and this wait would time out.
            assert reached.wait(timeout=60), "the pass loop did not advance while a request was decoding"
            passes_seen_by_decode.append(runner.passes)
        return real_decode(job)

    monkeypatch.setattr(RequestJob, "decode", decode)
    done = {}

    def on_finished(job, result, error):
        done[job.request.id] = error
        if job.request.id == "long":
            reached.set()

    runner = PassRunner(ctx, ResidentWeights(ctx.layers), 2, on_finished)
    original_pass = runner._pass

    def counting_pass(active, und, prefill, *rest):
        original_pass(active, und, prefill, *rest)
        if runner.passes >= 4:
            reached.set()

    runner._pass = counting_pass
    runner.run(requests)
    assert done == {"short": None, "long": None}
    assert passes_seen_by_decode == [4]


class _Stream:
    def __init__(self, log: list[str]):
        self.log = log

    def wait_event(self, event) -> None:
        self.log.append("side waits ready")

    def synchronize(self) -> None:
        self.log.append("side synchronized")


class _Event:
    def record(self, stream) -> None:
        pass


class _Cuda:
    """The torch.cuda surface the finisher uses, recording what it does to its side stream."""

    def __init__(self, log: list[str]):
        self.log = log

    def Stream(self, device):
        return _Stream(self.log)

    def Event(self):
        return _Event()

    def current_stream(self, device):
        return None

    def set_device(self, device) -> None:
        pass

    def stream(self, stream):
        return contextlib.nullcontext()


class _FailingJob:
    def decode(self):
        raise RuntimeError("out of memory in the VAE")


class _FineJob:
    def decode(self):
        return "result"


def test_a_failed_decode_waits_for_its_side_stream_before_reporting():
    log: list[str] = []

    def report(job, result, error):
        log.append(f"report {error or result}")

    finisher = Finisher(report, torch.device("cuda", 0), cuda=_Cuda(log))
    finisher.submit(_FailingJob())
    finisher.submit(_FineJob())
    finisher.close()
    assert log == [
        "side waits ready",
        "side synchronized",  # before the job (and its latents) is let go
        "report RuntimeError: out of memory in the VAE",
        "side waits ready",
        "report result",  # a good decode ends in host copies: no extra wait
    ]


class _LostPeerJob:
    def decode(self):
        raise torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1")


def test_a_decode_that_meets_a_lost_peer_ends_the_job_instead_of_failing_its_request():
    log: list[str] = []
    finisher = Finisher(lambda job, result, error: log.append(error or result), torch.device("cpu"))
    finisher.submit(_LostPeerJob())
    finisher.submit(_FineJob())
    finisher.close()
    assert log == ["result"]  # no failure reported for the lost peer's request: the rerun redoes it
    with pytest.raises(torch.distributed.DistBackendError, match="aborted on rank 1"):
        finisher.check()  # the pass loop's next pass ends the job (exit 69)
    assert finisher.mark.state is None  # the decode's wait mark was cleared on the way out


def _lines(rows: list[str]):
    requests, errors = parse_lines([row.encode() for row in rows])
    assert errors == []
    return requests


def test_a_blocked_write_does_not_hold_the_loop(tiny_ckpt):
    """The writer takes no lock the loop takes: while the first request's files are being written (held
    here on an event), the loop keeps running passes for the others (counted, not timed)."""
    requests = _lines(
        [
            '{"id": "first", "prompt": "a", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}',
            '{"id": "other", "prompt": "b", "num_frames": 1, "size": "32x32", "num_inference_steps": 40}',
        ]
    )
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    released = threading.Event()
    held_since: list[int] = []  # the pass count when the write began to be held
    passes_while_held = []

    def on_finished(job, result, error):
        if job.request.id == "first":
            held_since.append(runner.passes)
            assert released.wait(timeout=60), "the loop stopped while a write was held"
            passes_while_held.append(runner.passes - held_since[0])

    runner = PassRunner(ctx, ResidentWeights(ctx.layers), 2, on_finished)
    original_pass = runner._pass

    def counting_pass(active, und, prefill, *rest):
        original_pass(active, und, prefill, *rest)
        # Released only once the loop has run 5 passes past the start of the held write ("other" has 40
        # steps, so they exist); with a write that held the loop, this would never happen.
        if held_since and runner.passes >= held_since[0] + 5:
            released.set()

    runner._pass = counting_pass
    runner.run(requests)
    assert passes_while_held and passes_while_held[0] >= 5, passes_while_held


def test_an_image_encode_does_not_wait_for_a_decode(tiny_ckpt, cond_image):
    """I2V admissions encode on the VAE's encoder view, not under the decode lock: a decode held open
    until an I2V request has been admitted and prepared would deadlock with one shared lock."""
    requests = _lines(
        [
            '{"id": "t2i", "prompt": "a", "num_frames": 1, "size": "32x32", "num_inference_steps": 1}',
            f'{{"id": "i2v", "prompt": "b", "num_frames": 5, "size": "32x32", "num_inference_steps": 2, '
            f'"image": "{cond_image}"}}',
        ]
    )
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    assert ctx.encode_helper.vae is not ctx.vae
    assert ctx.encode_helper.vae.decoder.conv_in.weight is ctx.vae.decoder.conv_in.weight  # shared weights
    decoding, prepared = threading.Event(), threading.Event()
    real_decode, real_prepare = ctx.vae.decode, RequestJob.prepare

    def held_decode(*args, **kwargs):  # runs under the decode lock
        decoding.set()
        assert prepared.wait(timeout=60), "the I2V encode waited for the decode lock"
        return real_decode(*args, **kwargs)

    def prepare(job):
        if job.request.id == "i2v":
            assert decoding.wait(timeout=60)  # the decode holds its lock before this encode starts
        real_prepare(job)
        if job.request.id == "i2v":
            prepared.set()

    ctx.vae.decode = held_decode
    done = {}
    RequestJob.prepare = prepare
    try:
        # One slot and no look-ahead: the I2V request is admitted only once t2i is decoding.
        runner = PassRunner(
            ctx,
            ResidentWeights(ctx.layers),
            1,
            lambda job, result, error: done.update({job.request.id: error}),
            rule=PrefillRule(lookahead=0),
        )
        runner.run(requests)
    finally:
        RequestJob.prepare = real_prepare
    assert done == {"t2i": None, "i2v": None}
