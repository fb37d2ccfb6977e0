"""A Transfer chunk's sequences, as Cosmos3TransferPackSequenceStep packs them: each text's UND branch and the
GEN branches that read its K/V (cond over [controls..., target], cond over [target] alone, uncond over
[controls..., target]), with their rotary and, under --sp, this rank's rows.

`pack` reads only what a chain does not change (the texts' segments and embeddings) and the chunk it is given,
so the finisher thread builds the next chunk's branches at a boundary: diffusers' segment builder reads index
tensors back to the host, which on the pass loop's thread would wait for the device between passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosmos3_batch.model.cosmos3 import BranchSeq
from cosmos3_batch.model.ulysses import SeqShard
from cosmos3_batch.parallel.sequence import check_model, shard_rows
from cosmos3_batch.pipeline.kinds.denoise import VisionLayout


@dataclass
class Text:
    segment: dict  # the reference's text segment (input ids, und_len, mRoPE ids, vision offset)
    seq: BranchSeq  # its UND branch: the K/V every GEN branch of this text reads


@dataclass
class GenBranch:
    seq: BranchSeq
    layout: VisionLayout
    full: bool  # over [controls..., target]; else the target alone


def text_branch(ctx, sp, input_ids: list[int]) -> Text:
    """A text's UND branch; its rotary comes from its first GEN sequence (`pack`)."""
    segment = ctx.helper._prepare_text_segment(input_ids, device=ctx.device)
    hidden = ctx.split.embed_text(segment["input_ids"], ctx.device)
    shard = None
    if sp is not None:  # its UND K/V kept for this rank's KV heads only: what its GEN branches read
        shard = SeqShard(sp, [0] * sp.size, check_model(sp.size, ctx.split.config))
    seq = BranchSeq(hidden, hidden, rot_und=None, rot_gen=None, mse_rows=None, shard=shard)
    return Text(segment, seq)


def pack(ctx, sp, fps: float, text: Text, state, full: bool) -> GenBranch:
    """One GEN branch of a chunk (`state`: transfer_chunks.ChunkState at the chunk's start)."""
    segment = text.segment
    items = [*state.control_latents, state.latents] if full else [state.latents]
    clean = [True] * (len(items) - 1) + [False]
    offset, curr = segment["vision_start_temporal_offset"], segment["und_len"]
    shapes, noisy, mse, mrope, noisy_tokens = [], [], [], [segment["text_mrope_ids"]], 0
    for item, is_clean in zip(items, clean, strict=True):
        frames = list(range(item.shape[2])) if is_clean else state.condition_indexes
        part = ctx.helper._prepare_vision_segment(
            input_vision_tokens=item,
            has_image_condition=False,
            mrope_offset=offset,
            vision_fps=fps,
            curr=curr,
            device=ctx.device,
            condition_frame_indexes=frames,
        )
        shapes += part["vision_token_shapes"]
        noisy += part["vision_noisy_frame_indexes"]
        mse.append(part["vision_mse_loss_indexes"])
        mrope.append(part["vision_mrope_ids"])
        noisy_tokens += part["num_noisy_vision_tokens"]
        curr += part["num_vision_tokens"]
    und_len = segment["und_len"]
    rot_und, rot_gen = ctx.split.rotary(torch.cat(mrope, dim=1), und_len, ctx.device)
    if text.seq.rot_und is None:  # the first chunk's, on the loop's thread (the same for every chunk)
        text.seq.rot_und = rot_und
    shard = None
    if sp is not None:  # this rank's rows of [controls..., target] (or the target alone), as any GEN
        shard = SeqShard(sp, shard_rows(curr - und_len, sp.size), check_model(sp.size, ctx.split.config))
        rot_gen = (rot_gen[0][shard.local], rot_gen[1][shard.local])
    seq = BranchSeq(
        und_hidden=None,
        text_hidden=text.seq.text_hidden,
        rot_und=rot_und,
        rot_gen=rot_gen,
        mse_rows=torch.cat(mse) - und_len,
        und_kv=text.seq.und_kv,  # the same list: filled once by the text's UND prefill (relinked at rejoin)
        shard=shard,
    )
    return GenBranch(seq, VisionLayout(shapes, noisy, noisy_tokens), full)
