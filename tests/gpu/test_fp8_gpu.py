"""W8A8 (FP8 GEMM) against W8A16 on a GPU that has FP8 GEMMs; prints per-layer-shaped times. Skipped on CPU.

Run where a GPU is lent: `pytest -s tests/gpu/test_fp8_gpu.py`. Timings are printed, never asserted."""

from __future__ import annotations

import pytest
import torch

from cosmos3_batch.checkpoint.fp8_format import quantize_per_tensor
from cosmos3_batch.model.fp8 import fp8_gemm_available, w8a8_linear, w8a16_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and fp8_gemm_available(torch.device("cuda"))),
        reason="needs a CUDA device with FP8 GEMMs (sm89+)",
    ),
]
HIDDEN, INTERMEDIATE = 4096, 12288  # Cosmos3-Nano's GEN MLP widths (config.json)


def _time(fn, repeat: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


@pytest.mark.parametrize("tokens", [3120, 44160])
def test_w8a8_close_to_w8a16(tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(INTERMEDIATE, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q, _, scale = quantize_per_tensor(weight)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    a16 = w8a16_linear(x, q, scale, None)
    a8 = w8a8_linear(x, q, scale, None)
    rel = ((a8.float() - a16.float()).abs().max() / a16.float().abs().max()).item()
    t16 = _time(lambda: w8a16_linear(x, q, scale, None))
    t8 = _time(lambda: w8a8_linear(x, q, scale, None))
    print(f"tokens {tokens}: up_proj W8A16 {t16:.3f} ms, W8A8 {t8:.3f} ms, max|diff|/max|a16| {rel:.4f}")
    assert rel < 0.1  # e4m3 activations: a few percent, never garbage
