"""`--cache sea`: a run's step-cache settings (DESIGN.md §19), torch-free: `plan` and the config read them.

The fields, their defaults and their checks are diffusers' `SeaCacheConfig` (diffusers/hooks/sea_cache.py,
pinned 0.42): a run with these settings equals `pipe.transformer.enable_cache(SeaCacheConfig(**fields))`.
tests/unit/test_sea_cache.py holds the defaults and the checks equal to diffusers' own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

CACHES = ("none", "sea")


@dataclass(frozen=True)
class SeaSettings:
    """diffusers' `SeaCacheConfig` fields (raw_vision_callback aside: Cosmos3's built-in adapter is used)."""

    threshold: float = 0.25  # accumulated relative-L1 budget: larger reuses more often
    residual_order: int = 1  # 0: reuse the last residual; 1: extrapolate from the last two full steps
    retention_steps: int = 1  # first steps that always run in full
    cache_end_steps: int = 1  # last steps that always run in full
    max_consecutive_cached: int = 2  # reuses in a row before a forced full step (0: no limit)
    power_exp: float = 3.0  # exponent of the SEA clean-signal power prior

    def __post_init__(self) -> None:
        # The same checks, in the same order, as SeaCacheConfig.__post_init__; named by flag.
        if not math.isfinite(self.threshold) or self.threshold < 0:
            raise ValueError(f"--cache-threshold must be non-negative, got {self.threshold}")
        if self.residual_order not in (0, 1):
            raise ValueError(f"--cache-residual-order must be 0 or 1, got {self.residual_order}")
        if self.retention_steps < 0:
            raise ValueError(f"--cache-retention-steps must be non-negative, got {self.retention_steps}")
        if self.cache_end_steps < 0:
            raise ValueError(f"--cache-end-steps must be non-negative, got {self.cache_end_steps}")
        if isinstance(self.max_consecutive_cached, bool) or self.max_consecutive_cached < 0:
            raise ValueError(
                f"--cache-max-consecutive must be a non-negative integer, got {self.max_consecutive_cached}"
            )
        if not math.isfinite(self.power_exp) or self.power_exp <= 0:
            raise ValueError(f"--cache-power-exp must be positive, got {self.power_exp}")

    def record(self) -> dict:
        """For the sidecar and summary.json: what a comparison run must pass to SeaCacheConfig."""
        return {"kind": "sea", **asdict(self)}

    def diffusers_config(self):
        """The `SeaCacheConfig` these settings equal (imports diffusers: the pipeline side only)."""
        from diffusers import SeaCacheConfig

        return SeaCacheConfig(**asdict(self))


# (--cache, --cache-threshold, --cache-residual-order, --cache-retention-steps, --cache-end-steps,
#  --cache-max-consecutive, --cache-power-exp), as the CLI passes them.
CacheFlags = tuple[str, float, int, int, int, int, float]


def parse_cache(flags: CacheFlags | None) -> SeaSettings | None:
    """The settings for `--cache sea`, None for `--cache none`; ValueError naming the flag."""
    if flags is None:
        return None
    kind, *fields = flags
    if kind not in CACHES:
        raise ValueError(f"--cache must be one of {', '.join(CACHES)}, got {kind!r}")
    return None if kind == "none" else SeaSettings(*fields)


def cache_record(settings: SeaSettings | None) -> dict:
    return {"kind": "none"} if settings is None else settings.record()


def check_cache(settings: SeaSettings | None, requests: list) -> None:
    """Refuse `--cache sea` for requests diffusers never caches: its Cosmos3 adapter gates on the noisy
    vision latents, and inverse dynamics has none (every frame is given): the reference runs each of its
    forwards full, so a cache there would only pretend. ValueError naming the first such request. Transfer is
    cached as the modular pipeline caches it: per branch (cond, cond_no_control, uncond) while its interval
    has it on, its gate on the target's latents (its clean controls are not in the indicator)."""
    if settings is None:
        return
    for r in requests:
        if r.action is not None and r.action.mode == "inverse_dynamics":
            raise ValueError(
                f"request {r.id!r}: --cache sea does not apply to action mode inverse_dynamics (all of its "
                "video frames are given: diffusers' SeaCache has no noisy vision latents to gate on and "
                "runs every forward full); run it without --cache, or in a job of its own"
            )


def cache_tag(settings: SeaSettings | None) -> str:
    """The part of the output identity resume compares: outputs made with other cache settings (or none)
    are made again, not skipped; no cache keeps the identities outputs were written with."""
    if settings is None:
        return ""
    return "+sea-" + "-".join(f"{v}" for v in asdict(settings).values())


# plan --cache sea: the share of branch forwards that reuse, unless --cache-reuse says otherwise. vLLM-Omni's
# Cosmos3 recipe (vllm-omni PR #6922: Cosmos3-Nano 720p/189 frames on one GB200, SeaCache at its defaults)
# measured I2V 92.66 s -> 51.53 s (1.80x) and T2V 92.91 s -> 51.09 s (1.82x). Its denoise time is the
# transformer's forwards, so 1.8x means about 1 - 1/1.8 = 0.44 of them reused.
PUBLISHED_REUSE = 0.44


def check_reuse(reuse: float) -> float:
    if not 0.0 <= reuse < 1.0:
        raise ValueError(f"--cache-reuse must be in [0, 1), got {reuse}")
    return reuse


def step_decisions(branches: dict[str, str]) -> str:
    """One request's per-step decisions for the simulator from its sidecar's `cache.decisions` (per branch,
    "C" computed, "R" reused, "-" not run at that step: a Transfer axis its interval turns off): "C" where
    some branch ran the decoder stack, "R" where every branch that ran reused. A Transfer chain's steps run
    over all of its chunks (plan/branches.sim_request puts its boundary passes between them)."""
    columns = zip(*branches.values(), strict=True)
    return "".join("C" if "C" in column else "R" for column in columns)


def skip_share(reuse: float, requests_in_flight: float) -> float:
    """plan's guess at the share of passes no branch anywhere computes: a pass skips only when every active
    request reuses (a request's branches decide alike: they read the same latents), taken as independent:
    reuse ** requests. Identical requests admitted together skip up to `reuse` of their passes; the
    simulator given a run's recorded decisions (plan/simulator.py) counts them exactly."""
    return reuse ** max(requests_in_flight, 1.0) if reuse > 0 else 0.0
