"""Run configuration: frozen, validated on construction so a bad flag fails before anything loads."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cosmos3_batch.checkpoint.hub import ModelSource, resolve_model
from cosmos3_batch.engine.transport import OffloadMode, parse_offload
from cosmos3_batch.io.dataset import FORMATS, LAYOUTS, parse_shard_size, read_record
from cosmos3_batch.plan.cache import CacheFlags, SeaSettings, parse_cache
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.row_budget import MAX_BATCH_ROWS
from cosmos3_batch.requests.chain import ChainDefaults, chain_defaults
from cosmos3_batch.requests.cosmos_read import FORMATS as INPUT_FORMATS
from cosmos3_batch.requests.fields import MAX_SAMPLES

DEVICES = ("auto", "cpu", "cuda")
FP8_COMPUTE = ("checkpoint", "a16")  # model/fp8.py COMPUTE_MODES (not imported: config stays torch-light)
DTYPES = ("checkpoint", "bfloat16", "float32")  # model/dtypes.py DTYPE_CHOICES, likewise


class ConfigError(ValueError):
    """A flag is wrong: reported with exit code 2 before anything loads."""


@dataclass(frozen=True)
class RunConfig:
    prompts: tuple[str, ...]  # files, globs, "-" (JSONL on standard input)
    out: Path
    model: Path | None = None  # None: the embedded tiny model, built on first use
    model_source: ModelSource | None = None  # where --model came from (a folder or a Hugging Face repo id)
    max_active: int = 4
    # Reasoner requests in slots of their own (plan/prefill.py RankSlots); None: sized at the run's start from
    # device memory (plan/reason_memory.py; the CPU device: 8).
    max_reason_active: int | None = None
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
    # Every layer's UND half kept on the device, only GEN parts streamed (reasoner decoding); None: decided at
    # the run's start from device memory (plan/reason_memory.py; the CPU device: off).
    und_resident: bool | None = None
    collective_timeout_s: float = 600.0  # long enough for a slow layer fetch, short enough to not burn a node
    load_timeout_s: float = 3600.0  # ranks wait this long for each other to finish loading (cold shard reads)
    fp8_compute: str = "checkpoint"  # FP8 checkpoints: its step policy (W8A8 where possible) or W8A16 always
    dtype: str = "checkpoint"  # the transformer's compute dtype (model/dtypes.py): as stored, or a cast
    vae_dtype: str = "checkpoint"  # the VAE's, likewise
    # When the world fetches the UND halves (DESIGN.md §4, plan/prefill.py).
    prefill: PrefillRule = field(default_factory=PrefillRule)
    batch_branches: bool | None = None  # None: batched off CPU, per branch on CPU (the bit-exact path)
    max_batch_rows: int = MAX_BATCH_ROWS  # rows per batched group (a longer sequence still runs whole)
    sp: int = 1  # sequence-parallel group size (DESIGN.md §11): each request's GEN tokens over S ranks
    vae_patch_parallel_size: int = (
        1  # P | S ranks of a group decode/encode a request together (DESIGN.md §15)
    )
    samples_per_prompt: int = 1  # requests naming no "samples" fan out into this many (DESIGN.md §13)
    prompt_column: str | None = None  # table inputs: the column holding the prompt / the id
    id_column: str | None = None
    input_format: str = "auto"  # auto | cosmos3-batch | cosmos-framework (requests/cosmos_load.py)
    format: str = "files"  # files | webdataset (DESIGN.md §12, io/dataset.py); make_config: --format or OUT's
    layout: str | None = None  # files: flat | nested; None: what OUT holds, else nested above 10k requests
    shard_bytes: int = 10**9  # webdataset: a shard is finalized at this many bytes (0: no byte limit) ...
    shard_samples: int = 0  # ... or at this many samples (0: no sample limit)
    metrics_textfile: Path | None = None  # rank 0 keeps the job's live figures here (Prometheus text format)
    metrics_interval_s: float = 15.0  # ... rewritten this often, and at the end
    cache: SeaSettings | None = None  # --cache sea (DESIGN.md §19, plan/cache.py); None: every forward runs
    # NVIDIA's guardrails (docs/guardrails.md): --guardrails / --no-guardrails; None: on for real checkpoints,
    # off for the ones make-tiny writes (the built-in tiny and demo models).
    guardrails: bool | None = None
    chain: ChainDefaults = field(default_factory=ChainDefaults)  # --upsample*, --caption* (requests/chain.py)

    @property
    def tag(self) -> str:
        """Distinguishes files of array tasks that share one --out."""
        return "" if self.shard is None else f"shard{self.shard[0]}of{self.shard[1]}"

    def __post_init__(self) -> None:
        if self.max_active < 1:
            raise ValueError(f"--max-active must be >= 1, got {self.max_active}")
        if self.max_reason_active is not None and self.max_reason_active < 1:
            raise ValueError(f"--max-reason-active must be >= 1, got {self.max_reason_active}")
        if self.sp < 1:
            raise ValueError(f"--sp must be >= 1, got {self.sp}")
        if self.vae_patch_parallel_size < 1 or self.sp % self.vae_patch_parallel_size:
            raise ValueError(
                f"--vae-patch-parallel-size {self.vae_patch_parallel_size} must divide --sp {self.sp}: the "
                "ranks that decode a request together are ranks of its --sp group"
            )
        if self.vae_patch_parallel_size > 1 and self.vae_tiling:
            raise ValueError("--vae-tiling decodes in tiles on one rank: use it or --vae-patch-parallel-size")
        if self.max_batch_rows < 1:
            raise ValueError(f"--max-batch-rows must be >= 1, got {self.max_batch_rows}")
        if self.max_vision_tokens < 1:
            raise ValueError(f"--max-vision-tokens must be >= 1, got {self.max_vision_tokens}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"--collective-timeout-s must be > 0, got {self.collective_timeout_s}")
        if self.metrics_interval_s <= 0:
            raise ValueError(f"--metrics-interval-s must be > 0, got {self.metrics_interval_s}")
        if self.load_timeout_s <= 0:
            raise ValueError(f"--load-timeout-s must be > 0, got {self.load_timeout_s}")
        if self.device not in DEVICES and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"--device must be one of {', '.join(DEVICES)} or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda:") and (self.sp > 1 or self.offload is OffloadMode.SHARDED):
            # cuda:N puts every rank on one GPU, talking through gloo: no all-to-all or gather of device
            # tensors there.
            raise ValueError(f"--device {self.device} (ranks sharing one GPU) runs neither --sp nor sharded")
        if self.fp8_compute not in FP8_COMPUTE:
            raise ValueError(
                f"--fp8-compute must be one of {', '.join(FP8_COMPUTE)}, got {self.fp8_compute!r}"
            )
        for flag, value in (("--dtype", self.dtype), ("--vae-dtype", self.vae_dtype)):
            if value not in DTYPES:
                raise ValueError(f"{flag} must be one of {', '.join(DTYPES)}, got {value!r}")
        if self.format not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.layout is not None and (self.layout not in LAYOUTS or self.format != "files"):
            raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, and only with --format files")
        if self.input_format not in INPUT_FORMATS:
            raise ValueError(
                f"--input-format must be one of {', '.join(INPUT_FORMATS)}, got {self.input_format!r}"
            )
        if not self.prompts:
            raise ValueError("PROMPTS: name at least one request file (or - for standard input)")
        if not 1 <= self.samples_per_prompt <= MAX_SAMPLES:
            raise ValueError(
                f"--samples-per-prompt must be >= 1 and <= {MAX_SAMPLES}, got {self.samples_per_prompt}"
            )


def held_format(out: Path | None, fmt: str | None, layout: str | None) -> str:
    """--format as given, else what OUT holds (its dataset.json), else `files`. ValueError for --layout
    without --format where OUT holds shards (--layout is a files setting)."""
    if fmt is not None or out is None:
        return fmt or "files"
    held = read_record(Path(out))
    if held is not None and held.format != "files" and layout is not None:
        raise ValueError(f"--layout applies to --format files only: --out {out} holds {held.format}")
    return held.format if held is not None else "files"


def make_config(
    offload: str,
    shard: str | None,
    prefill: tuple[float, int, int, int] | None = None,
    model: str | Path | None = None,
    prompts: str | Path | tuple[str, ...] = (),
    shard_size: str | None = None,
    cache: CacheFlags | None = None,
    chain: tuple | None = None,
    **flags,
) -> RunConfig:
    """RunConfig from the CLI's values; any bad flag becomes a ConfigError (exit code 2).
    `prefill` = (--prefill-free-share, --prefill-max-wait, --prefill-lookahead, --chunk-gap-passes); `model`
    a folder or a Hugging Face repo id (resolved here, before anything loads); `shard_size` as --shard-size;
    `cache` the --cache flags (plan/cache.py CacheFlags)."""
    from cosmos3_batch.plan.schedule import parse_shard

    try:
        parsed = None if shard is None else parse_shard(shard)
        rule = PrefillRule() if prefill is None else PrefillRule(*prefill)
        source = None if model is None else resolve_model(str(model))
        flags["format"] = held_format(flags.get("out"), flags.get("format"), flags.get("layout"))
        if shard_size is not None:
            if flags["format"] != "webdataset":
                raise ValueError("--shard-size applies to --format webdataset only")
            flags["shard_bytes"], flags["shard_samples"] = parse_shard_size(shard_size)
        if chain is not None:
            flags["chain"] = _chain(*chain)
        return RunConfig(
            offload=parse_offload(offload),
            shard=parsed,
            prefill=rule,
            cache=parse_cache(cache),
            model=None if source is None else source.path,
            model_source=source,
            prompts=(str(prompts),) if isinstance(prompts, str | Path) else tuple(map(str, prompts)),
            **flags,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _chain(upsample, template: Path | None, *rest) -> ChainDefaults:
    """The --upsample* / --caption* flags; the template file read now (a bad one is a ConfigError)."""
    text = None
    if template is not None:
        try:
            text = Path(template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--upsample-template {template}: cannot read it: {exc}") from None
    return chain_defaults(upsample, text, *rest)
