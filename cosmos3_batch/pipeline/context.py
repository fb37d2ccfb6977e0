"""Everything a rank needs to turn requests into frames, loaded once per process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cosmos3_batch.model.cosmos3 import Cosmos3Split
from cosmos3_batch.model.loading import Checkpoint, load_transformer, load_vae


@dataclass
class ModelContext:
    split: Cosmos3Split
    vae: torch.nn.Module
    helper: object  # a Cosmos3OmniPipeline instance: we reuse its prompt templating, packing and latent prep
    scheduler_config: dict
    device: torch.device
    use_native_flow_schedule: bool

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.split.transformer.layers


def load_tokenizer(checkpoint: Checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint.root / "text_tokenizer")


def load_context(
    model_dir: str | Path,
    device: torch.device,
    with_layers: bool = True,
    vae_tiling: bool = False,
    tokenizer=None,
) -> ModelContext:
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

    checkpoint = Checkpoint.open(model_dir)
    transformer = load_transformer(checkpoint, device, with_layers=with_layers)
    vae = load_vae(checkpoint, device)
    if vae_tiling:
        vae.enable_tiling()
    scheduler_config = dict(UniPCMultistepScheduler.load_config(checkpoint.root / "scheduler"))
    index = checkpoint.model_index
    helper = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer if tokenizer is not None else load_tokenizer(checkpoint),
        vae=vae,
        scheduler=UniPCMultistepScheduler.from_config(scheduler_config),
        enable_safety_checker=False,  # guardrail requests are rejected up front (no safety models offline)
        default_use_system_prompt=index.get("default_use_system_prompt", True),
        use_native_flow_schedule=index.get("use_native_flow_schedule", False),
    )
    helper.set_progress_bar_config(disable=True)
    return ModelContext(
        split=Cosmos3Split(transformer),
        vae=vae,
        helper=helper,
        scheduler_config=scheduler_config,
        device=device,
        use_native_flow_schedule=bool(index.get("use_native_flow_schedule", False)),
    )
