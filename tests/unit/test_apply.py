"""The runner's two ways of applying a layer part: per branch (the CPU default, bit-exact) and batched."""

from __future__ import annotations

import torch

from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.requests.parse import parse_lines

ROWS = [
    '{"id": "img", "prompt": "a", "num_frames": 1, "size": "128x128", "num_inference_steps": 3}',
    '{"id": "vid", "prompt": "b c", "num_frames": 5, "size": "64x32", "num_inference_steps": 2}',
    '{"id": "nocfg", "prompt": "d", "num_frames": 1, "size": "32x64", "num_inference_steps": 3, '
    '"guidance_scale": 1.0}',
]


def run(ctx, batch: bool | None, fail: str | None = None) -> tuple[dict, int]:
    requests, errors = parse_lines([row.encode() for row in ROWS])
    assert errors == []
    latents, errors_seen = {}, {}

    def done(job, result, error):
        errors_seen[job.request.id] = error
        if result is not None:
            latents[job.request.id] = result.latents

    runner = PassRunner(ctx, ResidentWeights(ctx.layers), 3, done, batch_branches=batch)
    if fail is not None:  # one request's compute breaks in the second layer's GEN half
        original = ctx.split.gen_layer

        def gen_layer(layer, seq, index, _original=original):
            if index == 1 and seq.gen_hidden.shape[0] == 16:  # the 128x128 image: 4x4 tokens
                raise RuntimeError("simulated out of memory")
            return _original(layer, seq, index)

        ctx.split.gen_layer = gen_layer
        if batch:
            import cosmos3_batch.pipeline.passes.apply as apply

            real = apply.gen_layer_batched

            def batched(split, layer, seqs, index):
                if index == 1 and any(s.gen_hidden.shape[0] == 16 for s in seqs):
                    raise RuntimeError("simulated out of memory")
                return real(split, layer, seqs, index)

            apply.gen_layer_batched = batched
    try:
        runner.run(requests)
    finally:
        if fail is not None:
            del ctx.split.gen_layer
            if batch:
                apply.gen_layer_batched = real
    return latents, errors_seen, runner.apply.und_runs


def test_cpu_default_is_per_branch_and_batching_agrees_to_rounding(tiny_ckpt):
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    default, errors, und_default = run(ctx, None)
    per_branch, _, und_per_branch = run(ctx, False)
    batched, errors_b, und_batched = run(ctx, True)
    assert set(errors.values()) == set(errors_b.values()) == {None}
    for rid in default:
        assert torch.equal(default[rid], per_branch[rid]), rid  # the default on CPU is the exact path
        assert torch.allclose(batched[rid], per_branch[rid], atol=1e-4, rtol=1e-4), rid
    assert und_default == und_per_branch == und_batched == (2 + 2 + 1) * 2  # branches x layers, once


def test_a_failing_request_in_a_batch_fails_alone(tiny_ckpt):
    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    reference, _, _ = run(ctx, False)
    for batch in (False, True):
        latents, errors, _ = run(ctx, batch, fail="img")
        assert errors["img"] == "RuntimeError: simulated out of memory", errors
        assert errors["vid"] is None and errors["nocfg"] is None
        for rid in ("vid", "nocfg"):
            assert torch.allclose(latents[rid], reference[rid], atol=1e-4, rtol=1e-4), (batch, rid)


def test_the_row_budget_bounds_every_batched_call(tiny_ckpt, monkeypatch):
    import cosmos3_batch.pipeline.passes.apply as apply

    ctx = load_context(tiny_ckpt, torch.device("cpu"))
    requests, _ = parse_lines([row.encode() for row in ROWS])
    real, calls = apply.gen_layer_batched, []

    def batched(split, layer, seqs, index):
        calls.append([int(s.gen_hidden.shape[0]) for s in seqs])
        return real(split, layer, seqs, index)

    monkeypatch.setattr(apply, "gen_layer_batched", batched)
    for budget in (None, 16, 1):
        calls.clear()
        runner = PassRunner(ctx, ResidentWeights(ctx.layers), 3, lambda *a: None, batch_branches=True,
                            max_batch_rows=budget)  # fmt: skip
        runner.run(requests)
        assert calls
        if budget is None:  # every branch of the rank in one call
            assert max(len(c) for c in calls) == 5  # img and vid with CFG, nocfg without
        else:  # a group over the budget is a single sequence longer than it
            assert all(sum(c) <= budget or len(c) == 1 for c in calls), calls
            assert any(len(c) > 1 for c in calls) == (budget == 16)
