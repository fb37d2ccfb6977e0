"""The model as the planner sees it: dimensions, layer parts at the job's world size, resident bytes, the VAE.

Read from config.json and the safetensors headers only (no weight is read); a config-only folder plans a
download in `fallback_dtype`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.checkpoint.reader import CheckpointFileError
from cosmos3_batch.engine.layout import ParamSpec, PartLayout, build_part_layout
from cosmos3_batch.model.cosmos3 import layer_parts
from cosmos3_batch.model.dtypes import resolve_dtype
from cosmos3_batch.model.loading import build_transformer_on_meta, transformer_rule, vae_rule


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    act_bytes: int  # bytes per activation element (the unquantized weights' dtype: FP8 computes in it)
    parts: tuple[PartLayout, ...]  # at the job's world size
    host_resident_bytes: int  # embed_tokens: looked up on the host
    device_resident_bytes: int  # every other non-layer weight (lm_head excluded: never read)
    vae_bytes: int
    vae_config_json: str = ""  # for the decode's peak (plan/decode_memory.py); "" where there is no VAE
    vae_dtype: torch.dtype = torch.float32  # --vae-dtype as resolved


def model_shape(
    checkpoint: Checkpoint,
    world_size: int,
    fallback_dtype: torch.dtype,
    dtype: str = "checkpoint",
    vae_dtype: str = "checkpoint",
) -> ModelShape:
    """From config.json, with each tensor's dtype from the safetensors headers when the files exist, cast by
    `dtype` (`--dtype`, model/dtypes.py) as the run casts it."""
    cfg = checkpoint.config("transformer")
    try:
        store = checkpoint.store("transformer")
        rule = transformer_rule(checkpoint, dtype)
        dtype_of = lambda name: rule(name, store.info(name)[0])  # noqa: E731
    except (ValueError, CheckpointFileError):
        store = None
        cast = resolve_dtype(dtype, fallback_dtype)
        dtype_of = lambda name: cast  # noqa: E731 (a config-only folder: plan a download)
    model = build_transformer_on_meta(
        cfg, store
    )  # FP8: e4m3 weights and their scales, as the engine lays out
    parts = tuple(
        build_part_layout(
            key,
            [ParamSpec(name, dtype_of(name), tuple(getattr(m, leaf).shape)) for m, leaf, name in params],
            world_size,
        )
        for key, params in layer_parts(model.layers)
    )
    resident = {n: p for n, p in model.named_parameters() if not n.startswith("layers.")}
    nbytes = {n: p.numel() * dtype_of(n).itemsize for n, p in resident.items()}
    host = sum(v for n, v in nbytes.items() if n.startswith("embed_tokens."))
    vae_params = _vae_param_count(checkpoint)
    try:
        vae_compute = vae_rule(checkpoint, vae_dtype).compute or torch.float32
    except (ValueError, CheckpointFileError):  # no VAE weights: its config's default, float32
        vae_compute = resolve_dtype(vae_dtype, torch.float32)
    return ModelShape(
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        act_bytes=dtype_of("embed_tokens.weight").itemsize,  # the compute dtype (Cosmos3Split.dtype)
        parts=parts,
        host_resident_bytes=host,
        device_resident_bytes=sum(nbytes.values()) - host,
        vae_bytes=vae_params * vae_compute.itemsize,
        vae_config_json=json.dumps(checkpoint.config("vae"), sort_keys=True),
        vae_dtype=vae_compute,
    )


def _vae_param_count(checkpoint: Checkpoint) -> int:
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(checkpoint.config("vae"))
    return sum(p.numel() for p in vae.parameters())
