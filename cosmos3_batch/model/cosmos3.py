"""Split forward over diffusers' `Cosmos3OmniTransformer`: embed -> per-layer UND / GEN halves -> head.

The reference forward runs the whole joint sequence through every layer at every step. Two facts let
us cut it into parts that one gathered layer can serve for many sequences:

* The UND (text, causal) stream never reads GEN tokens, so a branch's per-layer UND keys/values are the
  same at every denoising step: we run the UND half once per request-branch and cache (K, V).
* The GEN (vision) stream reads UND only through those keys/values.

Every op below is the op the reference runs, on the same tensors, in the same dtype: outputs are
bit-identical to `Cosmos3OmniTransformer.forward` in float32 on CPU (tests hold this). Nothing here
knows about ranks or offload: a layer is whatever module the caller hands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

if TYPE_CHECKING:
    from cosmos3_batch.model.ulysses import SeqShard

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [tokens, head_dim], already unsqueezed per head


@dataclass
class BranchSeq:
    """One prompt branch (cond or uncond) of one request, as the layers see it."""

    und_hidden: torch.Tensor | None  # [und_len, hidden] while the UND half still has to run
    text_hidden: torch.Tensor  # the branch's token embeddings: where the UND stream starts
    rot_und: Rotary
    rot_gen: Rotary
    mse_rows: torch.Tensor  # rows of the GEN stream whose predictions the head reads
    und_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer (K for GEN, V)
    gen_hidden: torch.Tensor | None = None  # [gen_len, hidden] during a pass (this rank's rows under --sp)
    shard: SeqShard | None = None  # --sp: the GEN rows this rank holds (rot_gen is cut to them too)

    @property
    def needs_und(self) -> bool:
        return self.und_hidden is not None

    def reset_und(self) -> None:
        """Drop the cached UND K/V so the next pass recomputes them (the no-cache ablation)."""
        self.und_hidden, self.und_kv = self.text_hidden, []


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rotary(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
    cos, sin = rot
    return x * cos + _rotate_half(x) * sin


def _attention(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    # Same dispatcher and backend the reference processor uses, so the kernel (and its rounding) matches.
    processor = attn.processor
    out = dispatch_attention_fn(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        is_causal=causal,
        enable_gqa=True,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    return out.squeeze(0).flatten(-2, -1)


def gen_attention(attn, seq: BranchSeq, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int):
    """A branch's GEN tokens attending to its cached UND K/V of this layer and to each other; under --sp
    the rows are this rank's and Ulysses (model/ulysses.py) brings it the whole sequence for its heads."""
    k_und, v_und = seq.und_kv[layer_index]
    if seq.shard is not None:
        return seq.shard.attend(partial(_attention, attn, causal=False), q, k, v, k_und, v_und)
    return _attention(attn, q, torch.cat([k_und, k], dim=0), torch.cat([v_und, v], dim=0), causal=False)


class Cosmos3Split:
    """Embed, per-layer halves and head of one `Cosmos3OmniTransformer` (whose layers may be offloaded)."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.config = transformer.config
        self.num_layers = self.config.num_hidden_layers
        # FP8 checkpoints (model/fp8.py): which math the linears run, chosen per request by the caller
        # (pipeline/passes/apply.py), since requests sharing a pass may be at different steps; None otherwise.
        self.fp8 = getattr(transformer, "fp8_compute", None)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (`--dtype`, set by model/loading.py); the token table keeps the stored one."""
        return getattr(self.transformer, "compute_dtype", self.transformer.embed_tokens.weight.dtype)

    # ---- embed -------------------------------------------------------------------------------------

    def embed_text(self, input_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        # The table can stay on the host: a lookup of a few hundred ids, then one small copy.
        table = self.transformer.embed_tokens
        rows = getattr(table, "row_reader", None)  # set by loading: pread, never loads from the map
        if rows is not None:
            return rows(input_ids.cpu()).to(device=device, dtype=self.dtype)
        return table(input_ids.to(table.weight.device)).to(device=device, dtype=self.dtype)

    def rotary(self, position_ids: torch.Tensor, und_len: int, device: torch.device) -> tuple[Rotary, Rotary]:
        """cos/sin for the UND prefix and the GEN tokens; fixed per branch, so computed once."""
        cos, sin = self.transformer.rotary_emb(
            position_ids=position_ids.unsqueeze(1), device=device, dtype=self.dtype
        )
        cos, sin = cos.squeeze(0), sin.squeeze(0)
        return (
            (cos[:und_len].unsqueeze(1), sin[:und_len].unsqueeze(1)),
            (cos[und_len:].unsqueeze(1), sin[und_len:].unsqueeze(1)),
        )

    def embed_vision(
        self,
        latents: torch.Tensor | list[torch.Tensor],
        timesteps: torch.Tensor,
        token_shapes: list[tuple[int, int, int]],
        noisy_frame_indexes: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Patchify + proj_in + timestep embedding: the GEN stream input, shared by a request's branches.
        A list packs several vision items in order (Transfer: [controls..., target])."""
        t = self.transformer
        items = latents if isinstance(latents, list) else [latents]
        packed, original_shapes = t._patchify_and_pack_latents(items)
        packed = t.proj_in(packed)
        time_dtype = next(t.time_embedder.parameters()).dtype
        embeds = t.time_embedder(t.time_proj(timesteps * self.config.timestep_scale).to(time_dtype))
        packed = t._apply_timestep_embeds_to_noisy_tokens(
            packed_tokens=packed,
            packed_timestep_embeds=embeds.to(self.dtype),
            noisy_frame_indexes=noisy_frame_indexes,
            token_shapes=token_shapes,
        )
        # The reference writes these rows into a buffer of the text embeddings' dtype: the same cast here.
        return packed.to(self.dtype), original_shapes

    # ---- layer halves ------------------------------------------------------------------------------

    def und_layer(self, layer: torch.nn.Module, seq: BranchSeq, is_last: bool) -> None:
        """UND half of one layer for one branch: caches this layer's (K, V) and advances the UND stream."""
        attn = layer.self_attn
        x = layer.input_layernorm(seq.und_hidden)
        q = attn.to_q(x).view(-1, attn.num_attention_heads, attn.head_dim)
        k = attn.to_k(x).view(-1, attn.num_key_value_heads, attn.head_dim)
        v = attn.to_v(x).view(-1, attn.num_key_value_heads, attn.head_dim)
        k = attn.norm_k(k)
        k_rot = _apply_rotary(k, seq.rot_und)
        k_gen = (
            k_rot
            if attn.k_norm_und_for_gen is None
            else _apply_rotary(attn.k_norm_und_for_gen(k), seq.rot_und)
        )
        # --sp: the cache keeps only this rank's KV heads (model/ulysses.py); the UND stream stays whole.
        seq.und_kv.append((k_gen, v) if seq.shard is None else seq.shard.own_kv(k_gen, v))
        if is_last:
            # The last layer's UND output feeds nothing the vision head reads: only its K/V matter.
            seq.und_hidden = None
            return
        q = _apply_rotary(attn.norm_q(q), seq.rot_und)
        out = attn.to_out(_attention(attn, q, k_rot, v, causal=True))
        residual = seq.und_hidden + out
        seq.und_hidden = residual + layer.mlp(layer.post_attention_layernorm(residual))

    def gen_layer(self, layer: torch.nn.Module, seq: BranchSeq, layer_index: int) -> None:
        """GEN half of one layer for one branch, attending to the cached UND (K, V) of that layer."""
        attn = layer.self_attn
        hidden = seq.gen_hidden
        x = layer.input_layernorm_moe_gen(hidden)
        q = attn.add_q_proj(x).view(-1, attn.num_attention_heads, attn.head_dim)
        k = attn.add_k_proj(x).view(-1, attn.num_key_value_heads, attn.head_dim)
        v = attn.add_v_proj(x).view(-1, attn.num_key_value_heads, attn.head_dim)
        q = _apply_rotary(attn.norm_added_q(q), seq.rot_gen)
        k = _apply_rotary(attn.norm_added_k(k), seq.rot_gen)
        out = gen_attention(attn, seq, q, k, v, layer_index)
        residual = hidden + attn.to_add_out(out)
        seq.gen_hidden = residual + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(residual))

    # ---- head --------------------------------------------------------------------------------------

    def head(
        self,
        seq: BranchSeq,
        token_shapes: list[tuple[int, int, int]],
        noisy_frame_indexes: list[torch.Tensor],
        original_shapes: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """Final GEN norm, proj_out and unpatchify: the branch's velocity prediction [1, C, T, H, W]."""
        return self.vision_head(self.final_norm(seq), seq, token_shapes, noisy_frame_indexes, original_shapes)

    def final_norm(self, seq: BranchSeq) -> torch.Tensor:
        """The GEN stream after the final norm; frees the branch's hidden state. Sound and action heads
        (model/modes.py) read their rows of it too."""
        hidden = self.transformer.norm_moe_gen(seq.gen_hidden)
        seq.gen_hidden = None
        return hidden

    def vision_head(
        self,
        normed: torch.Tensor,
        seq: BranchSeq,
        token_shapes: list[tuple[int, int, int]],
        noisy_frame_indexes: list[torch.Tensor],
        original_shapes: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        t = self.transformer
        preds = t._unpatchify_and_unpack_latents(
            t.proj_out(normed[seq.mse_rows]),
            token_shapes_vision=token_shapes,
            noisy_frame_indexes_vision=noisy_frame_indexes,
            original_latent_shapes=original_shapes,
        )
        return preds[-1]  # the last item: the target (Transfer packs its clean controls before it)


# ---- how a layer splits into the two parts the engine fetches separately ----------------------------

UND, GEN = "und", "gen"
# Parameters a layer's GEN (vision) half reads; everything else in the layer belongs to the UND half.
GEN_PREFIXES = (
    "input_layernorm_moe_gen.",
    "post_attention_layernorm_moe_gen.",
    "mlp_moe_gen.",
    "self_attn.add_q_proj.",
    "self_attn.add_k_proj.",
    "self_attn.add_v_proj.",
    "self_attn.to_add_out.",
    "self_attn.norm_added_q.",
    "self_attn.norm_added_k.",
)


def part_of(param_name: str) -> str:
    """UND or GEN for a parameter name relative to its decoder layer."""
    return GEN if param_name.startswith(GEN_PREFIXES) else UND


def part_index(layer: int, part: str) -> int:
    """Parts are ordered layer by layer, UND before GEN: [0.und, 0.gen, 1.und, 1.gen, ...]."""
    return 2 * layer + (1 if part == GEN else 0)


def layer_parts(layers: torch.nn.ModuleList) -> list[tuple[str, list[tuple[torch.nn.Module, str, str]]]]:
    """(key, [(owning module, leaf name, checkpoint name)]) per part, in `part_index` order."""
    parts = []
    for index, layer in enumerate(layers):
        halves: dict[str, list] = {UND: [], GEN: []}
        for name, _ in layer.named_parameters():
            path, _, leaf = name.rpartition(".")
            halves[part_of(name)].append((layer.get_submodule(path), leaf, f"layers.{index}.{name}"))
        parts += [(f"{index}.{UND}", halves[UND]), (f"{index}.{GEN}", halves[GEN])]
    return parts


# Two GEN slots and one UND slot (see engine/slots.py). Device memory for weights is
# sum(engine.offload.slot_sizes(layouts, lanes, dict(LANE_SLOTS))): plan/planner.py should count the same.
LANE_SLOTS = ((GEN, 2), (UND, 1))
