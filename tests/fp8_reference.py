"""The reference for FP8 runs: diffusers' `Cosmos3OmniPipeline` with diffusers' own W8A16 linear.

nvidia-modelopt 0.47 cannot be restored by diffusers 0.42.1's `from_pretrained` (see model/fp8.py and the
FP8 tests' notes), so the pipeline is loaded from the unquantized source and every linear that the FP8
checkpoint stores in e4m3 gets that checkpoint's weight and scale and diffusers'
`mixed_precision._w8a16_linear` as its forward: exactly what diffusers runs on a restored ModelOpt FP8
transformer when every step is W8A16 (`mixed_precision_format="fp8"`, first steps = all steps, reasoner
`high_precision`).
"""

from __future__ import annotations

from pathlib import Path
from types import MethodType, SimpleNamespace

import torch
from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
from diffusers.pipelines.cosmos.mixed_precision import _w8a16_linear
from safetensors.torch import load_file

from cosmos3_batch.requests.parse import Request
from tests.reference import reference_kwargs

FP8 = torch.float8_e4m3fn


def patch_w8a16(transformer: torch.nn.Module, fp8_weights: dict[str, torch.Tensor]) -> int:
    count = 0
    for name, module in transformer.named_modules():
        weight = fp8_weights.get(f"{name}.weight")
        if not isinstance(module, torch.nn.Linear) or weight is None or weight.dtype != FP8:
            continue
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        module.weight_quantizer = SimpleNamespace(_scale=fp8_weights[f"{name}.weight_quantizer._scale"])
        module.forward = MethodType(lambda self, x, _n=name: _w8a16_linear(self, x, _n), module)
        count += 1
    return count


def reference_latents(src: Path, fp8: Path | None, requests: list[Request]) -> dict[str, torch.Tensor]:
    """Latents per request id, computed with one thread (as torchrun's workers run); `fp8=None`: the
    unquantized source (to show that FP8 changes the numbers at all)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = Cosmos3OmniPipeline.from_pretrained(src)
        pipe.set_progress_bar_config(disable=True)
        if fp8 is not None:
            weights = load_file(fp8 / "transformer" / "diffusion_pytorch_model.safetensors")
            assert patch_w8a16(pipe.transformer, weights) > 0
        base = dict(pipe.scheduler.config)
        out = {}
        for r in requests:
            overrides = {} if r.flow_shift is None else {"flow_shift": r.flow_shift}
            pipe.scheduler = UniPCMultistepScheduler.from_config(base, **overrides)
            out[r.id] = pipe(
                **reference_kwargs(r),
                generator=torch.Generator("cpu").manual_seed(r.seed),
                output_type="latent",
            ).video
        return out
    finally:
        torch.set_num_threads(threads)
