"""Builds a small, real, diffusers-layout Cosmos3 checkpoint on this machine: nothing is downloaded.

The folder it writes loads with `Cosmos3OmniPipeline.from_pretrained(DIR)` offline, so the reference
pipeline and our runner read the very same files. Weights come from torch's default initialisation
under a fixed seed, so the same flags give the same bytes on the same torch version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cosmos3_batch.model.tiny_kinds import edge_transformer_config, write_distilled
from cosmos3_batch.model.tiny_reasoner import REASONER_TOKENS, write_reasoner

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>")

# Qwen-style chat template: the reference pipeline renders prompts through `apply_chat_template`.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Written into every folder make-tiny creates: only such a folder (or an empty one) may be replaced, so a
# mistyped path never wipes a real checkpoint or anything else.
MARKER = ".written-by-cosmos3-batch-make-tiny"


class FolderNotOurs(ValueError):
    """make-tiny was pointed at a non-empty folder it did not write."""


def check_replaceable(out_dir: Path) -> None:
    """Raise FolderNotOurs unless `out_dir` is missing, empty, or an earlier make-tiny output."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise FolderNotOurs(f"{out_dir} exists and is not a folder make-tiny wrote; nothing was changed")
    if any(out_dir.iterdir()) and not (out_dir / MARKER).is_file():
        raise FolderNotOurs(
            f"{out_dir} is not empty and was not written by make-tiny (no {MARKER}); nothing was changed. "
            "Use --force to replace it anyway."
        )


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model. Defaults keep CPU tests fast; the flags scale it to 2 GB for benchmarks."""

    seed: int = 0
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    dtype: str = "float32"
    latent_channels: int = 16
    vae_dim: int = 8
    flow_shift: float = 5.0
    # Rows of the embedding table (and LM head); None = the tokenizer's size. Rows past the tokenizer's are
    # padding that no prompt ever reads: a large-vocabulary model (Nano: 1.2 GB of table) for memory tests.
    vocab: int | None = None
    sound: bool = False  # joint audio: a small Cosmos3AVAEAudioTokenizer and a transformer with sound_gen
    action: bool = False  # action_gen: domain-aware action projections for every embodiment domain
    distilled: bool = False  # a 4-step distilled folder (model/tiny_kinds.py): FlowMatchEuler, modular index
    edge: bool = False  # the Cosmos3-Edge backbone: relu2 MLP, Nemotron norms, UND k-norm for GEN
    reasoner: bool = False  # the reasoner's files (model/tiny_reasoner.py): root config, ViT, processor

    def __post_init__(self) -> None:
        if self.distilled and (self.sound or self.action):
            raise ValueError(
                "--distilled: distilled checkpoints generate images and videos only (no --sound/--action)"
            )
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "latent_channels", "vae_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden ({self.hidden}) must be a multiple of --heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})")
        if (self.hidden // self.heads) % 8:
            raise ValueError(f"head dim hidden/heads = {self.hidden // self.heads} must be a multiple of 8")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.vocab is not None and self.vocab < (have := len(build_tokenizer())):
            raise ValueError(f"--vocab must be at least the tokenizer's {have} tokens, got {self.vocab}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# The mode flags enter the spec's record only when set, so the embedded default (no flags) keeps the bytes
# and the cache folder name it had before they existed.
_MODE_FLAGS = ("sound", "action", "distilled", "edge", "reasoner")
SOUND_DIM = 8  # latent channels of the tiny sound tokenizer (the released model: 64)


def spec_record(spec: TinySpec) -> dict:
    """The spec as written to tiny_spec.json and hashed into the default model's folder name: options
    only when set (sound, action, vocab), so the default model's files and folder stay what they were."""
    record = asdict(spec)
    for flag in _MODE_FLAGS:
        if not record[flag]:
            del record[flag]
    if record["vocab"] is None:
        del record["vocab"]
    return record


def _rope_axes(head_dim: int) -> list[int]:
    # Same proportions as the released model (24/20/20 of 64 rotary frequencies for T/H/W).
    half = head_dim // 2
    spatial = (half * 20) // 64
    return [half - 2 * spatial, spatial, spatial]


def transformer_config(spec: TinySpec, vocab_size: int) -> dict:
    return {
        "hidden_size": spec.hidden,
        "head_dim": spec.head_dim,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "latent_channel": spec.latent_channels,
        "latent_patch_size": 2,
        "patch_latent_dim": 4 * spec.latent_channels,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rope_axes_dim": _rope_axes(spec.head_dim),
        "rope_theta": 5000000.0,
        **({"sound_gen": True, "sound_dim": SOUND_DIM, "sound_latent_fps": 25.0} if spec.sound else {}),
        **({"action_gen": True, "action_dim": action_dim()} if spec.action else {}),
        **(edge_transformer_config() if spec.edge else {}),
    }


def action_dim() -> int:
    """Wide enough for every embodiment whose width the reference knows (hand_pose: 57)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_RAW_ACTION_DIM

    return max(_EMBODIMENT_TO_RAW_ACTION_DIM.values())


def sound_tokenizer_config() -> dict:
    # The released tokenizer's rate (48 kHz stereo) and hop (2*4*5*6*8 = 1920 samples, 25 latents per second),
    # with a few channels instead of hundreds and no encoder (generation only decodes).
    return {
        "sampling_rate": 48000,
        "vocoder_input_dim": SOUND_DIM,
        "dec_dim": 4,
        "dec_c_mults": [1, 2, 2, 2, 2],
        "dec_strides": [2, 4, 5, 6, 8],
        "dec_out_channels": 2,
        "encoder_enabled": False,
    }


def vae_config(spec: TinySpec, generator: torch.Generator) -> dict:
    # Wan2.2-style residual VAE: 2x2 pixel patching then three 2x downsamplings = 16x spatial, 4x temporal.
    mean = (torch.rand(spec.latent_channels, generator=generator) - 0.5).tolist()
    std = (torch.rand(spec.latent_channels, generator=generator) + 0.5).tolist()
    return {
        "base_dim": spec.vae_dim,
        "decoder_base_dim": spec.vae_dim,
        "z_dim": spec.latent_channels,
        "dim_mult": [1, 2, 2, 2],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "is_residual": True,
        "in_channels": 12,
        "out_channels": 12,
        "patch_size": 2,
        "scale_factor_temporal": 4,
        "scale_factor_spatial": 16,
        "latents_mean": [round(x, 4) for x in mean],
        "latents_std": [round(x, 4) for x in std],
    }


def scheduler_config(spec: TinySpec) -> dict:
    # Flow matching as the released model: the network predicts velocity on shifted flow sigmas.
    return {
        "num_train_timesteps": 1000,
        "solver_order": 2,
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "flow_shift": spec.flow_shift,
        "final_sigmas_type": "zero",
    }


def build_tokenizer(corpus: Iterable[str] = (), extra_special: Iterable[str] = ()):
    """Byte-level tokenizer with a chat template and the special tokens the pipeline looks up.

    With a `corpus`, BPE merges are learned until every word in it is one token (the demo model's words:
    a tiny transformer binds "red" to a colour far sooner than it composes r-e-d); any other text still
    tokenizes, byte by byte. Without one there are no merges: the random tiny model's 260 tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    corpus = list(corpus)
    if corpus:
        # No size limit: merging stops when no pair is left inside any word.
        trainer = trainers.BpeTrainer(vocab_size=1 << 20, initial_alphabet=alphabet, show_progress=False)
        core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")]
        + list(extra_special),
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tiny(out_dir: str | Path, spec: TinySpec, overwrite: bool = True) -> Path:
    """Write the checkpoint to `out_dir` atomically (a temporary sibling folder, then a rename).

    With overwrite=False an existing `out_dir` is kept and OSError is raised (the rename fails). Callers
    that take a user's path check it with `check_replaceable` first.
    """
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer, UniPCMultistepScheduler

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        # --reasoner: the vision special tokens after the base ones (the base model's ids stay as they are).
        tokenizer = build_tokenizer(extra_special=REASONER_TOKENS if spec.reasoner else ())
        tokenizer.save_pretrained(tmp / "text_tokenizer")

        generator = torch.Generator().manual_seed(spec.seed)
        torch_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(spec.seed)
            vocab = len(tokenizer) if spec.vocab is None else spec.vocab
            transformer = Cosmos3OmniTransformer(**transformer_config(spec, vocab_size=vocab))
            vae = AutoencoderKLWan(**vae_config(spec, generator))
            if spec.sound:
                _write_sound_tokenizer(tmp / "sound_tokenizer", spec.seed)
        finally:
            torch.random.set_rng_state(torch_state)
        # Random init gives norm weights of exactly 1; perturb them so that a wrong norm is caught by tests.
        with torch.no_grad():
            for name, param in transformer.named_parameters():
                # The sound/action modality embeds start at zero too: a missing add would go unnoticed.
                if name.endswith(("norm.weight", "modality_embed")) or "layernorm" in name or "norm_" in name:
                    param.add_(0.1 * torch.randn(param.shape, generator=generator))
        for name, child in transformer.named_children():
            if name != "time_embedder":  # diffusers keeps it in float32 (`_keep_in_fp32_modules`)
                child.to(DTYPES[spec.dtype])
        transformer.save_pretrained(tmp / "transformer", safe_serialization=True, max_shard_size="500MB")
        vae.save_pretrained(tmp / "vae", safe_serialization=True)
        if spec.reasoner:
            write_reasoner(tmp, tokenizer, spec.seed, DTYPES[spec.dtype])
        if spec.distilled:  # a modular folder, as NVIDIA's 4-step checkpoints: no model_index.json
            write_distilled(tmp, _diffusers_version(), type(tokenizer).__name__)
        else:
            UniPCMultistepScheduler(**scheduler_config(spec)).save_pretrained(tmp / "scheduler")
            (tmp / "model_index.json").write_text(json.dumps(model_index(spec), indent=2) + "\n")
        (tmp / "tiny_spec.json").write_text(json.dumps(spec_record(spec), indent=2) + "\n")
        (tmp / MARKER).write_text(
            "This folder was written by `cosmos3-batch make-tiny`; it may replace it.\n"
        )
        publish_folder(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def model_index(spec: TinySpec) -> dict:
    return {
        "_class_name": "Cosmos3OmniPipeline",
        "_diffusers_version": _diffusers_version(),
        "transformer": ["diffusers", "Cosmos3OmniTransformer"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "sound_tokenizer": ["diffusers", "Cosmos3AVAEAudioTokenizer"] if spec.sound else [None, None],
        "safety_checker": [None, None],
        # The tiny model has no guardrail models (guardrail requests are rejected up front anyway).
        "enable_safety_checker": False,
        "default_use_system_prompt": True,
        "use_native_flow_schedule": False,
    }


def _write_sound_tokenizer(folder: Path, seed: int) -> None:
    from diffusers import Cosmos3AVAEAudioTokenizer

    torch.manual_seed(seed + 1)
    with warnings.catch_warnings():  # the decoder's weight_norm is torch's deprecated (but exact) one
        warnings.simplefilter("ignore", FutureWarning)
        tokenizer = Cosmos3AVAEAudioTokenizer(**sound_tokenizer_config())
    tokenizer.save_pretrained(folder, safe_serialization=True)


def publish_folder(tmp: Path, out_dir: Path, overwrite: bool = True) -> None:
    """Give the finished temporary folder `tmp` the modes the umask allows and rename it to `out_dir`.

    mkdtemp (and safetensors) make owner-only entries: the modes let other users of a shared cache read the
    model. With overwrite an existing `out_dir` is replaced (a link itself, never what it points to);
    without, the rename fails on it with OSError.
    """
    umask = _umask()
    for entry in [tmp, *tmp.rglob("*")]:
        entry.chmod((0o777 if entry.is_dir() else 0o666) & ~umask)
    if overwrite and out_dir.is_symlink():
        out_dir.unlink()
    elif overwrite and out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def default_tiny_dir() -> Path:
    """Where the embedded default model lives: one folder per spec and library versions."""
    import hashlib

    import diffusers

    root = Path(os.environ.get("COSMOS3_BATCH_CACHE", Path.home() / ".cache" / "cosmos3_batch"))
    key = json.dumps([spec_record(TinySpec()), torch.__version__, diffusers.__version__], sort_keys=True)
    return root / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_default_tiny() -> Path:
    """Create the embedded default model on first use. Ranks (and jobs) starting together take a file
    lock, so one builds it and the others wait and reuse it; the rename keeps it atomic regardless."""
    import fcntl

    path = default_tiny_dir()
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "model_index.json").exists():
            import logging

            logging.getLogger("cosmos3_batch").info(
                "building the built-in tiny model in %s (first use only; a few seconds)", path
            )
            write_tiny(path, TinySpec(), overwrite=False)
    return path
