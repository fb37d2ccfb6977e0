"""Everything a rank needs to turn requests into frames, loaded once per process."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cosmos3_batch.model.cosmos3 import Cosmos3Split
from cosmos3_batch.model.loading import Checkpoint, load_transformer, load_vae
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
    # The Wan VAE keeps per-call state on the module: the finisher's decodes and I2V encodes at admission
    # must not interleave.
    vae_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.split.transformer.layers


def load_tokenizer(checkpoint: Checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint.root / "text_tokenizer")


def build_helper(checkpoint: Checkpoint, tokenizer, transformer=None, vae=None, sound_tokenizer=None):
    """A `Cosmos3OmniPipeline` used only for its helpers (templating, packing, latent prep).

    Without modules it is built over meta-device ones from the configs: enough to tokenize and
    validate prompts before any weight is read.
    """
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler

    from cosmos3_batch.model.loading import build_transformer_on_meta

    if transformer is None:
        transformer = build_transformer_on_meta(checkpoint.config("transformer"))
    if vae is None:
        with torch.device("meta"):
            vae = AutoencoderKLWan.from_config(checkpoint.config("vae"))
    index = checkpoint.model_index
    helper = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=UniPCMultistepScheduler.from_config(checkpoint.config("scheduler")),
        enable_safety_checker=False,  # guardrail requests are rejected up front (no safety models offline)
        default_use_system_prompt=index.get("default_use_system_prompt", True),
        use_native_flow_schedule=index.get("use_native_flow_schedule", False),
        sound_tokenizer=sound_tokenizer,  # read by prepare_latents for sound+action requests
    )
    helper.set_progress_bar_config(disable=True)
    return helper


def load_context(
    model_dir: str | Path,
    device: torch.device,
    with_layers: bool = True,
    vae_tiling: bool = False,
    tokenizer=None,
) -> ModelContext:
    checkpoint = Checkpoint.open(model_dir)
    transformer = load_transformer(checkpoint, device, with_layers=with_layers)
    vae = load_vae(checkpoint, device)
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
    )
