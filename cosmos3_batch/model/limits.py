"""What requests a checkpoint can take: latent factors, the vision-token cap, its generation modes and the
reference's defaults for it (requests/defaults.py, chosen by what the checkpoint declares)."""

from __future__ import annotations

from cosmos3_batch.checkpoint.declared import family
from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.checkpoint.reasoner_parts import missing_parts
from cosmos3_batch.requests import defaults
from cosmos3_batch.requests.fields import ModelLimits


def limits_for(checkpoint: Checkpoint, max_vision_tokens: int) -> ModelLimits:
    """CheckpointError (exit 2, nothing loaded) for a sampler the tool does not run."""
    from cosmos3_batch.requests.modes import checkpoint_modes

    vae = checkpoint.config("vae")
    return ModelLimits(
        spatial_factor=int(vae.get("scale_factor_spatial", 16)),
        temporal_factor=int(vae.get("scale_factor_temporal", 4)),
        max_vision_tokens=max_vision_tokens,
        # Sound / action requests on a checkpoint without sound_tokenizer / action_gen: exit 2 up front.
        **checkpoint_modes(checkpoint.model_index, checkpoint.config("transformer")),
        defaults=defaults_for(checkpoint),
        # A reasoner request on a folder without the reasoner's files: exit 2 up front, naming them.
        reasoner_missing=missing_parts(checkpoint.root),
    )


def defaults_for(checkpoint: Checkpoint) -> defaults.RequestDefaults:
    sampler = checkpoint.sampler
    if sampler.distilled:
        return defaults.distilled(sampler.steps)
    return defaults.EDGE if family(checkpoint.config("transformer")) == "edge" else defaults.COSMOS3
