"""W8A8 end to end on torch's CPU `_scaled_mm`: a request's output does not depend on what shares its passes,
a calibrated (static) input scale is used as stored, and --sp reduces one amax per shared input."""

from __future__ import annotations

import pytest
import torch

from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.model.fp8 import Fp8Compute, Fp8Linear, w8a8_linear
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.pipeline.kinds.context import load_context
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import ResidentWeights
from cosmos3_batch.requests.parse import parse_lines
from tests.unit.test_fp8_fidelity import _modelopt_checkpoint

ALONE = (
    '{"id": "a", "prompt": "a red cube", "num_frames": 1, "size": "64x64", "num_inference_steps": 3, '
    '"seed": 3}'
)
OTHERS = [  # louder prompts, other sizes and seeds: their activations' amax is not the first request's
    '{"id": "b", "prompt": "a storm over a city at night, lightning", "num_frames": 5, "size": "48x32", '
    '"num_inference_steps": 3, "seed": 11}',
    '{"id": "c", "prompt": "waves", "num_frames": 1, "size": "32x32", "num_inference_steps": 3, "seed": 5, '
    '"guidance_scale": 1.0}',
    '{"id": "d", "prompt": "fire", "num_frames": 1, "size": "96x64", "num_inference_steps": 3, "seed": 9}',
]


@pytest.fixture(scope="module")
def dynamic_ckpt(tiny_ckpt, tmp_path_factory):
    """`convert --fp8`: no calibrated input scales, so W8A8 takes each sequence's own amax."""
    dst = tmp_path_factory.mktemp("w8a8") / "tiny-fp8"
    convert_fp8(tiny_ckpt, dst, decoder_linear_weights)
    return dst


@pytest.fixture(scope="module")
def static_ckpt(tiny_ckpt, tmp_path_factory):
    """nvidia-modelopt's own: every quantized linear has its calibrated `input_quantizer._amax`."""
    return _modelopt_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("w8a8-static") / "modelopt")


def w8a8_everywhere(ctx) -> Fp8Compute:
    """The checkpoint policy with no W8A16 steps at either end: every decoder linear runs W8A8."""
    fp8 = ctx.split.fp8
    assert fp8.w8a8_available  # torch 2.13 has the CPU kernel
    fp8.first_steps = fp8.last_steps = 0
    return fp8


def latents(ctx, rows: list[str], max_active: int, batched: bool) -> dict[str, torch.Tensor]:
    requests, errors = parse_lines([row.encode() for row in rows])
    assert errors == []
    out: dict[str, torch.Tensor] = {}

    def done(job, result, error):
        assert error is None, error
        out[job.request.id] = result.latents

    PassRunner(ctx, ResidentWeights(ctx.layers), max_active, done, batch_branches=batched).run(requests)
    return out


@pytest.mark.parametrize("which", ["dynamic", "static"])
@pytest.mark.exact  # kernel-probing: run again under a lower ISA by scripts/test.sh
def test_a_requests_w8a8_output_does_not_depend_on_what_shares_its_passes(which, request):
    ckpt = request.getfixturevalue(f"{which}_ckpt")
    ctx = load_context(ckpt, torch.device("cpu"), fp8_compute="checkpoint")
    fp8 = w8a8_everywhere(ctx)
    static = [m for m in ctx.layers.modules() if isinstance(m, Fp8Linear) and hasattr(m, "input_quantizer")]
    assert bool(static) == (which == "static")
    alone = latents(ctx, [ALONE], 1, batched=False)["a"]
    calls = fp8.w8a8_calls
    assert calls > 0  # the GEN halves; the UND (reasoner) stream stays W8A16, as the policy says
    for max_active, batched in ((4, False), (4, True), (2, True)):
        shared = latents(ctx, [ALONE, *OTHERS], max_active, batched)
        assert torch.equal(shared["a"], alone), (which, max_active, batched)


@pytest.mark.exact  # kernel-probing: run again under a lower ISA by scripts/test.sh
def test_one_amax_over_a_batched_call_would_make_it_depend_on_the_others():
    """Why the scales are per sequence: quantized with the batch's amax, a quiet sequence loses precision
    to a loud one beside it. The same rows give the same output alone and inside a batch only per sequence."""
    g = torch.Generator().manual_seed(0)
    from cosmos3_batch.checkpoint.fp8_format import quantize_per_tensor

    q, _, scale = quantize_per_tensor(torch.randn(48, 32, generator=g) * 0.05)
    quiet, loud = torch.randn(5, 32, generator=g), 40 * torch.randn(7, 32, generator=g)
    alone = w8a8_linear(quiet, q, scale, None)
    both = torch.cat([quiet, loud])
    assert torch.equal(w8a8_linear(both, q, scale, None, segments=[5, 7])[:5], alone)
    assert not torch.equal(w8a8_linear(both, q, scale, None)[:5], alone)
    # A static (calibrated) scale is the same for every sequence whatever shares the call. Compared with the
    # segments the product passes (one GEMM per sequence): a 12-row GEMM's rows equalling a 5-row one's would
    # be a property of this CPU's BLAS, which no test asserts (docs/numerics.md).
    amax = torch.tensor(3.0)
    static = w8a8_linear(quiet, q, scale, None, input_amax=amax)
    assert torch.equal(w8a8_linear(both, q, scale, None, input_amax=amax, segments=[5, 7])[:5], static)
    louder = torch.cat([quiet, 10 * loud])  # a louder neighbour: the static scale does not move
    assert torch.equal(w8a8_linear(louder, q, scale, None, input_amax=amax, segments=[5, 7])[:5], static)


@pytest.mark.parametrize("which", ["dynamic", "static"])
def test_sp_reduces_one_amax_per_shared_input_and_none_with_static_scales(which, request, monkeypatch):
    """Under --sp every W8A8 activation amax is all-reduced over the group. q/k/v read one tensor and gate/up
    another: 4 reductions per GEN half (q/k/v, out, gate/up, down) instead of 7; static scales need none."""
    ckpt = request.getfixturevalue(f"{which}_ckpt")
    ctx = load_context(ckpt, torch.device("cpu"), fp8_compute="checkpoint")
    fp8 = w8a8_everywhere(ctx)
    reduced: list[int] = []

    def group_max(amaxes: torch.Tensor) -> torch.Tensor:
        reduced.append(amaxes.numel())
        return amaxes  # a group of one

    # The applier sets amax_reduce for --sp GEN halves only: stand in for a group around every call.
    monkeypatch.setattr(Fp8Compute, "amax_reduce", property(lambda self: group_max, lambda self, value: None))
    fp8.w8a8_calls = 0
    layer_calls = []
    real = Fp8Linear.forward

    def counted(self, x):
        layer_calls.append(self.in_layer and not self.compute.high_precision)  # W8A8 in a layer
        return real(self, x)

    monkeypatch.setattr(Fp8Linear, "forward", counted)
    latents(ctx, [ALONE, *OTHERS], 4, batched=True)
    in_layer = sum(layer_calls)
    assert in_layer > 0 and in_layer % 7 == 0  # 7 quantized linears per GEN half
    assert len(reduced) == (0 if which == "static" else in_layer // 7 * 4)
