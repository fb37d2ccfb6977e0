"""What gpu/check.py and gpu/check_engine.py share: Nano-shaped layer geometry, random layers and
branches on a device, the time budget, and the markdown table (importable without a GPU)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerShape:
    """One Cosmos3 MoT decoder layer. Defaults: Cosmos3-Nano (Qwen3-8B-shaped streams)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288


NANO = LayerShape()


@dataclass(frozen=True)
class Video:
    name: str
    width: int
    height: int
    frames: int


VIDEOS = (
    Video("480p, 29 frames", 832, 480, 29),
    Video("720p, 29 frames", 1280, 720, 29),
    Video("720p, 189 frames", 1280, 720, 189),
)


def vision_tokens(
    width: int, height: int, frames: int, spatial: int = 16, temporal: int = 4, patch: int = 2
) -> int:
    """GEN tokens of one video: latent frames x patch rows x patch columns (the Wan2.2 VAE compresses 16x in
    space and 4x in time; the transformer patchifies 2x2, padding a partial patch), as plan/schedule.py."""
    latent_frames = (frames - 1) // temporal + 1
    return latent_frames * math.ceil(height / spatial / patch) * math.ceil(width / spatial / patch)


def gen_flops(tokens: int, und_len: int, shape: LayerShape = NANO) -> float:
    """FLOPs of one GEN half for one branch: projections, MLP and attention over UND prefix + GEN tokens."""
    q_out = shape.heads * shape.head_dim
    kv_out = shape.kv_heads * shape.head_dim
    projections = 2 * tokens * shape.hidden * (2 * q_out + 2 * kv_out)
    mlp = 2 * tokens * 3 * shape.hidden * shape.intermediate
    attention = 4 * tokens * (tokens + und_len) * q_out  # Q K^T and P V
    return float(projections + mlp + attention)


def build_layer(shape: LayerShape = NANO, device: str = "meta"):
    import torch
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3VLTextMoTDecoderLayer

    with torch.device(device):
        return Cosmos3VLTextMoTDecoderLayer(
            hidden_size=shape.hidden,
            head_dim=shape.head_dim,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            intermediate_size=shape.intermediate,
            attention_bias=False,
            rms_norm_eps=1e-6,
        )


def part_bytes(shape: LayerShape = NANO, itemsize: int = 2) -> dict[str, int]:
    """Bytes of a layer's UND and GEN parts, split exactly as the engine splits them (on the meta device)."""
    from cosmos3_batch.model.cosmos3 import part_of

    sizes: dict[str, int] = {}
    for name, param in build_layer(shape).named_parameters():
        sizes[part_of(name)] = sizes.get(part_of(name), 0) + param.numel() * itemsize
    return sizes


def markdown(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class Budget:
    """Seconds left of the run's budget: sections that would not fit are reported as skipped, not cut off."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self._clock = clock
        self._end = clock() + seconds

    def left(self) -> float:
        return self._end - self._clock()

    def allows(self, estimate_s: float) -> bool:
        return self.left() > estimate_s


def sync(device) -> None:
    """Timing only: wait for the device (a no-op on CPU, where the helpers also run in the unit tests)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def random_layer(device, shape: LayerShape = NANO):
    """A layer with torch's default random init, in bf16 on the device (no checkpoint)."""
    import torch

    return build_layer(shape, device=str(device)).to(torch.bfloat16).eval().requires_grad_(False)


def branch(tokens: int, und_len: int, layers: int, device, shape: LayerShape = NANO):
    """A GEN branch with random activations, rotary tables and a cached UND K/V per layer; and its input."""
    import torch

    from cosmos3_batch.model.cosmos3 import BranchSeq

    def rotary(n: int):
        angle = torch.rand(n, 1, shape.head_dim, device=device)
        return angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)

    k = torch.randn(und_len, shape.kv_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
    seq = BranchSeq(
        und_hidden=None,
        text_hidden=torch.empty(0, device=device),
        rot_und=rotary(und_len),
        rot_gen=rotary(tokens),
        mse_rows=torch.arange(tokens, device=device),
        und_kv=[(k, torch.randn_like(k))] * layers,  # the same cached K/V serves every layer: timing only
    )
    return seq, torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16)


def split_for(layers: int):
    from types import SimpleNamespace

    from cosmos3_batch.model.cosmos3 import Cosmos3Split

    # gen_layer reads only the layer it is given: a stand-in transformer carries the layer count.
    return Cosmos3Split(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=layers)))
