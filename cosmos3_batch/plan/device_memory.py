"""Device bytes per rank beyond the weights: activations kept and the largest layer call's transient, the
VAE decode, and the CUDA runtime's own (docs/scale.md, "Device memory")."""

from __future__ import annotations

import json

from cosmos3_batch.plan.decode_memory import cut_for, decode_flops, decode_peak_bytes
from cosmos3_batch.plan.model_shape import ModelShape
from cosmos3_batch.plan.row_budget import largest_group
from cosmos3_batch.requests.parse import Request


def activation_bytes(
    shape: ModelShape, active: list[tuple[int, int, int]], max_rows: int | None
) -> tuple[int, int]:
    """(branches, und tokens, gen tokens) per active request -> (bytes kept, the largest layer call's
    transient). `max_rows`: the batched row budget (plan/row_budget.py, the GPU default); None: no budget."""
    kv = shape.kv_heads * shape.head_dim
    kept, transient = 0, 0
    for branches, und, gen in active:
        und_cache = shape.layers * und * kv * 2  # K and V per layer, kept for the request's life
        kept += branches * (und_cache + gen * shape.hidden) * shape.act_bytes
        mlp = gen * shape.intermediate * 3  # gate, up, and their product
        qkv = gen * (shape.heads * shape.head_dim + 2 * kv)
        attn = qkv + (und + gen) * 2 * kv  # plus the UND+GEN keys/values concatenated for attention
        one = (mlp + attn + 2 * gen * shape.hidden) * shape.act_bytes
        # Batched, the rank's branches (all alike here: the typical request) share calls of up to max_rows.
        seqs = sum(b for b, _, g in active if g)
        transient = max(transient, one * largest_group(gen, seqs, max_rows) if gen else 0)
    return kept, transient


# The CUDA runtime's own device memory, which no tensor shows: documented constants, not measured here (no
# GPU has run this code; scripts/gpu/check.sh measures them where one is lent). A CUDA context with torch's
# kernels loaded: ~0.5-1 GB on Hopper; cuBLAS/cuBLASLt: a 32 MiB workspace per stream that runs GEMMs
# (compute, finisher); NCCL: per communicator its channel buffers (NCCL_BUFFSIZE 4 MiB x channels x peers),
# and on NVSwitch systems NVLS buffers: ~0.5 GB to 1.5 GB.
CUDA_CONTEXT_BYTES = 1 << 30
CUBLAS_WORKSPACE_BYTES = 2 * (32 << 20)
NCCL_COMMUNICATOR_BYTES = 1 << 30


def runtime_overhead_bytes(world_size: int, sp: int) -> int:
    """The context, GEMM workspaces and one NCCL communicator per process group this rank is in: the
    exchange and the gather group, and its --sp group."""
    communicators = 0 if world_size == 1 else 2 + (sp > 1)
    return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + communicators * NCCL_COMMUNICATOR_BYTES


def decoded_frames(r: Request) -> int:
    """Frames one decode of the request makes: a Transfer chain decodes chunk by chunk."""
    transfer = getattr(r, "transfer", None)
    return r.num_frames if transfer is None else transfer.chunk_frames


def _largest(requests: list[Request]) -> Request | None:
    """The largest output the VAE decodes; None when none is decoded (a reasoner request writes text)."""
    decoded = [r for r in requests if getattr(r, "reason", None) is None]
    return max(decoded, key=lambda r: (r.width * r.height * decoded_frames(r), r.id), default=None)


def decode_bytes(shape: ModelShape, requests: list[Request], tiled: bool, parts: int = 1) -> int:
    """The finisher's peak for the largest output (one decode at a time, on the compute device), on the
    busiest rank of a --vae-patch-parallel-size group of `parts`."""
    if not shape.vae_config_json or (big := _largest(requests)) is None:
        return 0
    return decode_peak_bytes(
        shape.vae_config_json, big.width, big.height, decoded_frames(big), shape.vae_dtype, tiled, parts
    )


def decode_seconds(
    shape: ModelShape, requests: list[Request], parts: int, tflops: float, gbps: float
) -> float:
    """Roofline seconds of the largest output's decode on the busiest rank of a group of `parts`: its FLOPs
    at `tflops`, plus the decoded frames of the other shards gathered at `gbps` (the halos are rows)."""
    if not shape.vae_config_json or tflops <= 0 or (big := _largest(requests)) is None:
        return 0.0
    frames = decoded_frames(big)
    flops = decode_flops(shape.vae_config_json, big.width, big.height, frames, shape.vae_dtype, parts)
    output = 3 * frames * big.width * big.height * shape.vae_dtype.itemsize
    spatial = int(json.loads(shape.vae_config_json).get("scale_factor_spatial", 16))
    cut = cut_for(big.height // spatial, big.width // spatial, parts)
    gathered = output * (1 - cut.sizes[0] / sum(cut.sizes))
    return flops / (tflops * 1e12) + (gathered / (gbps * 1e9) if gbps > 0 else 0.0)
