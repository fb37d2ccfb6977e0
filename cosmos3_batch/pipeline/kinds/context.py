"""Everything a rank needs to turn requests into frames, loaded once per process."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cosmos3_batch.checkpoint.declared import Sampler
from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.model.cosmos3 import Cosmos3Split
from cosmos3_batch.model.loading import load_transformer, load_vae
from cosmos3_batch.model.prompts import build_helper, load_tokenizer
from cosmos3_batch.model.sound import load_sound_tokenizer


@dataclass
class ModelContext:
    split: Cosmos3Split
    vae: torch.nn.Module
    helper: object  # a Cosmos3OmniPipeline instance: we reuse its prompt templating, packing and latent prep
    scheduler_config: dict
    device: torch.device
    use_native_flow_schedule: bool
    sound_tokenizer: torch.nn.Module | None = None  # joint audio; None when the checkpoint has none
    sampler: Sampler = field(default_factory=lambda: Sampler("unipc"))  # what the checkpoint declares
    # The Wan VAE keeps its per-call feature caches as attributes of the module object. Decodes (finisher
    # thread) use `vae`; encodes at admission (the loop) use `encode_helper`, whose VAE is a shallow copy:
    # the same weights, its own cache attributes, so an I2V admission never waits behind a decode.
    encode_helper: object = None
    vae_lock: threading.Lock = field(default_factory=threading.Lock)  # decodes, one at a time
    vae_team: object = None  # finish/vae_team.py VaeTeam under --vae-patch-parallel-size > 1
    encode_lock: threading.Lock = field(default_factory=threading.Lock)  # encodes, one at a time
    reasoner: object = None  # model/reasoner.py Reasoner, for a job with reasoner requests (job/load.py)

    def __post_init__(self) -> None:
        if self.encode_helper is None:
            self.encode_helper = encoder_view(self.helper, self.vae)

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.split.transformer.layers


def encoder_view(helper, vae: torch.nn.Module):
    """A copy of the helper pipeline whose VAE shares every parameter with `vae` but not its caches."""
    view = copy.copy(helper)
    # Plain attribute writes on the copies: the originals (and their registered configs) stay untouched.
    object.__setattr__(view, "vae", copy.copy(vae))
    return view


def load_context(
    model_dir: str | Path,
    device: torch.device,
    with_layers: bool = True,
    vae_tiling: bool = False,
    tokenizer=None,
    fp8_compute: str = "checkpoint",
    dtype: str = "checkpoint",
    vae_dtype: str = "checkpoint",
) -> ModelContext:
    """`dtype`/`vae_dtype`: `--dtype`/`--vae-dtype` (model/dtypes.py)."""
    checkpoint = Checkpoint.open(model_dir)
    transformer = load_transformer(
        checkpoint, device, with_layers=with_layers, fp8_compute=fp8_compute, dtype=dtype
    )
    vae = load_vae(checkpoint, device, vae_dtype)
    if vae_tiling:
        vae.enable_tiling()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(checkpoint)
    sound_tokenizer = load_sound_tokenizer(checkpoint, device)
    return ModelContext(
        split=Cosmos3Split(transformer),
        vae=vae,
        helper=build_helper(checkpoint, tokenizer, transformer, vae, sound_tokenizer),
        scheduler_config=dict(checkpoint.config("scheduler")),
        device=device,
        use_native_flow_schedule=bool(checkpoint.model_index.get("use_native_flow_schedule", False)),
        sound_tokenizer=sound_tokenizer,
        sampler=checkpoint.sampler,
    )
