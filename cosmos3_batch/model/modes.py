"""Sound and action tokens in the GEN stream: their embed and head, from the transformer's own submodules.

The reference packs `[text | vision | sound | action]` into one sequence; sound and action rows follow the
vision rows in the GEN half, attend exactly as vision rows do, and leave the layers unchanged. So only the
embed (before layer 0) and the head (after the final GEN norm) know about them: the ops below are those of
`Cosmos3OmniTransformer.forward` for these rows, in the same order and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SOUND, ACTION = "sound", "action"


@dataclass
class StreamLayout:
    """Where one extra modality sits in a branch's GEN stream; the rows are the same in every branch."""

    kind: str  # SOUND or ACTION
    token_shapes: list[tuple[int, int, int]]
    noisy_frame_indexes: list[torch.Tensor]
    rows: torch.Tensor  # GEN-stream rows the head reads: the reference's mse indexes - und_len
    domain_id: torch.Tensor | None = None  # ACTION: the embodiment's id, selecting the projection weights

    @property
    def num_noisy(self) -> int:
        return int(self.rows.numel())


def _timestep_embeds(
    transformer: torch.nn.Module, timesteps: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    time_dtype = next(transformer.time_embedder.parameters()).dtype
    scaled = timesteps * transformer.config.timestep_scale
    return transformer.time_embedder(transformer.time_proj(scaled).to(time_dtype)).to(dtype)


def embed_stream(
    transformer: torch.nn.Module,
    tokens: torch.Tensor,
    timestep: float,
    layout: StreamLayout,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows of one extra modality entering layer 0: projection, modality embed, per-token timestep embeds."""
    t = transformer
    if layout.kind == SOUND:
        packed = t._pack_sound_latents([tokens], layout.token_shapes).to(dtype)
        packed = t.audio_proj_in(packed) + t.audio_modality_embed
    else:
        packed, domains = t._pack_action_latents([tokens], layout.token_shapes, [layout.domain_id])
        packed = t.action_proj_in(packed.to(dtype), domains.to(device=packed.device))
        packed = packed + t.action_modality_embed
    # The reference embeds timesteps only where some token is noisy (all-clean actions get none).
    if layout.kind == SOUND or layout.num_noisy > 0:
        timesteps = torch.full((layout.num_noisy,), timestep, device=packed.device)
        packed = t._apply_timestep_embeds_to_noisy_tokens(
            packed_tokens=packed,
            packed_timestep_embeds=_timestep_embeds(t, timesteps, dtype),
            noisy_frame_indexes=layout.noisy_frame_indexes,
            token_shapes=layout.token_shapes,
        )
    # The reference writes these rows into a buffer of the text embeddings' dtype: the same cast here.
    return packed.to(dtype)


def head_stream(transformer: torch.nn.Module, normed: torch.Tensor, layout: StreamLayout) -> torch.Tensor:
    """One extra modality's velocity prediction from the normed GEN stream: sound [C, T], action [T, D]."""
    t = transformer
    rows = normed[layout.rows]
    if layout.kind == SOUND:
        preds = t.audio_proj_out(rows)
        return t._unpack_sound_latents(preds, layout.token_shapes, layout.noisy_frame_indexes)[0]
    domains = layout.domain_id.reshape(1).expand(len(layout.noisy_frame_indexes[0])).to(device=rows.device)
    preds = t.action_proj_out(rows, domains)
    return t._unpack_action_latents(preds, layout.token_shapes, layout.noisy_frame_indexes)[0]
