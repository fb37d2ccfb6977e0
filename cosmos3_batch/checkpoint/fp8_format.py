"""FP8 weights in NVIDIA ModelOpt's per-tensor layout, as stored: tensor names, the config check and the
quantization math that `convert` writes with and the model reads back (model/fp8.py computes with them)."""

from __future__ import annotations

import torch

from cosmos3_batch.checkpoint.reader import CheckpointFileError

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: ModelOpt's per-tensor scale is amax / this


FP8 = torch.float8_e4m3fn


SCALE = "weight_quantizer._scale"


AMAX = "weight_quantizer._amax"


QUANT_METHOD = "modelopt"


class QuantizationError(CheckpointFileError):
    """The checkpoint's quantization is not one we can compute exactly as the reference does."""


def quantization_config(config: dict, where: str) -> dict | None:
    """The transformer's `quantization_config` if it is ModelOpt FP8, None if unquantized; else an error
    naming the file and key (another method would silently compute something else)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"{where}: 'quantization_config' must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method != QUANT_METHOD:
        raise QuantizationError(
            f"{where}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
            f"(only {QUANT_METHOD!r} FP8 checkpoints)"
        )
    algo = str(qc.get("quant_algo") or qc.get("quant_type") or "").upper()
    if "FP8" not in algo:
        raise QuantizationError(
            f"{where}: quantization_config quant_type/quant_algo {algo or None!r} is not FP8 "
            "(only per-tensor FP8 e4m3 is supported)"
        )
    return qc


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, amax, scale) with ModelOpt's per-tensor max calibration: scale = amax / 448.

    In the weight's own dtype, as ModelOpt computes it (measured: for a bf16 weight its amax and scale
    are bf16 and the division runs in bf16; doing it in float32 changes some e4m3 bytes)."""
    w = weight.detach()
    amax = w.abs().amax()
    # An all-zero tensor would divide by zero; any scale represents it exactly, so use 1.
    scale = amax / E4M3_MAX if float(amax) > 0 else torch.ones((), dtype=w.dtype)
    # w / scale is within +-448 up to rounding; saturate so a rounding overshoot cannot become NaN.
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, amax, scale
