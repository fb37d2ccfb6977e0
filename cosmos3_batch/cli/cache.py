"""`--cache` and the SeaCacheConfig fields as options of `run` and `plan` (their help; no logic).

Defaults are diffusers' `SeaCacheConfig` defaults (plan/cache.py SeaSettings, held equal by a test)."""

from __future__ import annotations

from dataclasses import astuple
from typing import Annotated

import typer

from cosmos3_batch.plan.cache import PUBLISHED_REUSE, SeaSettings, parse_cache

SEA = SeaSettings()

Cache = Annotated[
    str,
    typer.Option(
        help="none (default): every forward runs. sea: diffusers' SeaCache (NVIDIA's recommended Cosmos3 "
        "cache): per request, branch and step, reuse an extrapolated residual instead of running the layers "
        "when the spectral indicator of the latents has moved little; outputs equal Cosmos3OmniPipeline with "
        "transformer.enable_cache(SeaCacheConfig(same fields)) (docs/running.md, Step caching)."
    ),
]
Threshold = Annotated[
    float, typer.Option(help="SeaCacheConfig.threshold: accumulated relative-L1 budget; larger reuses more.")
]
ResidualOrder = Annotated[
    int,
    typer.Option(help="SeaCacheConfig.residual_order: 0 reuses the last residual, 1 extrapolates from two."),
]
RetentionSteps = Annotated[
    int, typer.Option(help="SeaCacheConfig.retention_steps: first steps that always run in full.")
]
EndSteps = Annotated[
    int, typer.Option(help="SeaCacheConfig.cache_end_steps: last steps that always run in full.")
]
MaxConsecutive = Annotated[
    int,
    typer.Option(
        help="SeaCacheConfig.max_consecutive_cached: reuses in a row before a full step (0: no limit)."
    ),
]
PowerExp = Annotated[float, typer.Option(help="SeaCacheConfig.power_exp: exponent of the SEA power prior.")]
Reuse = Annotated[
    float,
    typer.Option(
        help=f"plan --cache sea: the share of branch forwards taken to reuse (default {PUBLISHED_REUSE}: "
        "vLLM-Omni's published 1.80x/1.82x on Cosmos3-Nano 720p, vllm-omni PR #6922, is 1 - 1/1.8 of the "
        "forwards; docs/running.md has this model's measured shares by threshold)."
    ),
]


def plan_cache(kind: str, reuse: float) -> tuple[SeaSettings, float] | None:
    """plan's --cache and --cache-reuse: the settings (diffusers' defaults) and the share, None for none."""
    settings = parse_cache((kind, *astuple(SEA)))
    return None if settings is None else (settings, reuse)
