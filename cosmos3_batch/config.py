"""Run configuration: frozen, validated on construction so a bad flag fails before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cosmos3_batch.engine.transport import OffloadMode, parse_offload
from cosmos3_batch.plan.prefill import PrefillRule

DEVICES = ("auto", "cpu", "cuda")
FP8_COMPUTE = ("checkpoint", "a16")  # model/fp8.py COMPUTE_MODES (not imported: config stays torch-light)


class ConfigError(ValueError):
    """A flag is wrong: reported with exit code 2 before anything loads."""


@dataclass(frozen=True)
class RunConfig:
    prompts: Path
    out: Path
    model: Path | None = None  # None: the embedded tiny model, built on first use
    max_active: int = 4
    save_latents: bool = False
    vae_tiling: bool = False
    skip_invalid: bool = False
    overwrite: bool = False
    device: str = "auto"
    progress: bool = True
    offload: OffloadMode = OffloadMode.ALLGATHER
    max_vision_tokens: int = 65536
    shard: tuple[int, int] | None = None  # (index, count): this job runs one slice of the file
    und_cache: bool = True  # off only as an ablation: UND recomputed (and fetched) every step
    collective_timeout_s: float = 600.0  # long enough for a slow layer fetch, short enough to not burn a node
    fp8_compute: str = "checkpoint"  # FP8 checkpoints: its step policy (W8A8 where possible) or W8A16 always
    # When the world fetches the UND halves (DESIGN.md §4, plan/prefill.py).
    prefill: PrefillRule = field(default_factory=PrefillRule)
    batch_branches: bool | None = None  # None: batched off CPU, per branch on CPU (the bit-exact path)
    sp: int = 1  # sequence-parallel group size (DESIGN.md §11): each request's GEN tokens over S ranks

    @property
    def tag(self) -> str:
        """Distinguishes files of array tasks that share one --out."""
        return "" if self.shard is None else f"shard{self.shard[0]}of{self.shard[1]}"

    def __post_init__(self) -> None:
        if self.max_active < 1:
            raise ValueError(f"--max-active must be >= 1, got {self.max_active}")
        if self.sp < 1:
            raise ValueError(f"--sp must be >= 1, got {self.sp}")
        if self.max_vision_tokens < 1:
            raise ValueError(f"--max-vision-tokens must be >= 1, got {self.max_vision_tokens}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"--collective-timeout-s must be > 0, got {self.collective_timeout_s}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.fp8_compute not in FP8_COMPUTE:
            raise ValueError(
                f"--fp8-compute must be one of {', '.join(FP8_COMPUTE)}, got {self.fp8_compute!r}"
            )
        if not self.prompts.is_file():
            raise ValueError(f"PROMPTS {self.prompts}: no such file")
        if self.model is not None and not (self.model / "model_index.json").is_file():
            raise ValueError(f"--model {self.model}: not a diffusers checkpoint folder (no model_index.json)")


def make_config(
    offload: str, shard: str | None, prefill: tuple[float, int, int] | None = None, **flags
) -> RunConfig:
    """RunConfig from the CLI's values; any bad flag becomes a ConfigError (exit code 2).
    `prefill` = (--prefill-free-share, --prefill-max-wait, --prefill-lookahead)."""
    from cosmos3_batch.plan.schedule import parse_shard

    try:
        parsed = None if shard is None else parse_shard(shard)
        rule = PrefillRule() if prefill is None else PrefillRule(*prefill)
        return RunConfig(offload=parse_offload(offload), shard=parsed, prefill=rule, **flags)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
