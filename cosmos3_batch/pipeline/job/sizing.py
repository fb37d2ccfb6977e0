"""The reasoner's device memory for this run, where the flags leave it to the job: --max-reason-active and
--und-resident decided by the function `plan` calls (plan/reason_memory.py `size_reasoner`), from what every
rank holds alike: the flags, this run's requests (the same list on every rank: `run._check_same_plan`), the
checkpoint's configs and headers, and one device memory figure, the smallest over the ranks, gathered with
the plan check (no collective of its own). So every rank takes the same decision, and the UND half's
residency, which changes the engine's layout, gives every rank the same layout digest."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.config import RunConfig
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.job.run_plan import Plan
from cosmos3_batch.plan.hardware import Hardware
from cosmos3_batch.plan.model_shape import model_shape
from cosmos3_batch.plan.planner import estimate, prompt_tokens
from cosmos3_batch.plan.reason_memory import decodes, sequence_kv, size_reasoner, vision_counter
from cosmos3_batch.plan.text import describe_sizing

log = logging.getLogger("cosmos3_batch")


def device_memory(device: torch.device) -> int | None:
    """The device's total memory on CUDA; None on the CPU device (plan/reason_memory.py's fixed defaults)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def smallest(figures: list[int | None]) -> int | None:
    """Every rank's device memory -> the one the job sizes from: the smallest (None if a rank has none)."""
    return None if None in figures else min(figures, default=None)


def size_run(cfg: RunConfig, world: World, plan: Plan, device_bytes: int | None) -> tuple[RunConfig, dict]:
    """(the config with both values taken, what summary.json's config records: each value, who chose it and
    why). The checkpoint's shape and the prompts' tokens are read only if a decision needs them (never on the
    CPU device)."""
    checkpoint = Checkpoint.open(plan.model_dir)
    shape = functools.cache(
        lambda: model_shape(checkpoint, world.world_size, torch.bfloat16, cfg.dtype, cfg.vae_dtype)
    )
    tokens = functools.cache(lambda: prompt_tokens(checkpoint, plan.requests))

    @functools.cache
    def device_estimate(und_resident: bool) -> int:
        """plan's device bytes per rank for this run's flags (`plan` with the same flags says the same)."""
        nodes = max(world.world_size // max(world.local_world_size, 1), 1)
        hw = Hardware(device_gib=device_bytes / 2**30)
        order = cfg.cache.residual_order if cfg.cache is not None else None
        est = estimate(
            shape(), plan.requests, tokens(), world.world_size, nodes, cfg.offload, cfg.max_active, hw,
            cfg.prefill.lookahead, cfg.sp, cfg.max_batch_rows, cfg.vae_tiling, cfg.vae_patch_parallel_size,
            cache_order=order, und_resident=und_resident,
        )  # fmt: skip
        return est.device_bytes_per_rank

    vision = vision_counter(plan.model_dir, cfg.max_vision_tokens)
    sizing = size_reasoner(
        plan.requests,
        cfg.offload,
        (cfg.und_resident, cfg.max_reason_active),
        device_bytes,
        device_estimate,
        lambda: sequence_kv(shape(), plan.requests, tokens(), vision),
        lookahead=cfg.prefill.lookahead,
    )
    if world.is_main and decodes(plan.requests):
        log.info(describe_sizing(sizing.record()))
    und_resident, slots = sizing.values
    return replace(cfg, und_resident=und_resident, max_reason_active=slots), sizing.record()
