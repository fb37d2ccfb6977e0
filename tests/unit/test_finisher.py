"""Decoding happens off the pass loop: passes go on while a finished request is being decoded."""

from __future__ import annotations

import threading

import torch

from cosmos3_batch.pipeline.context import load_context
from cosmos3_batch.pipeline.denoise import RequestJob
from cosmos3_batch.pipeline.runner import PassRunner
from cosmos3_batch.pipeline.weights import ResidentWeights
from cosmos3_batch.requests import parse_lines


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

    def counting_pass(active, und, prefill):
        original_pass(active, und, prefill)
        if runner.passes >= 4:
            reached.set()

    runner._pass = counting_pass
    runner.run(requests)
    assert done == {"short": None, "long": None}
    assert passes_seen_by_decode == [4]
