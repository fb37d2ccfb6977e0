"""How attention heads split over the ranks of a sequence-parallel group (Ulysses): a property of the
model's head counts, torch-free, so the planner and the pre-load checks use it too."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSplit:
    """How one rank of an S-group takes its heads: `q` query heads, `kv` key/value heads, and whether the
    KV heads had to be repeated (S > KV heads) to give every rank one."""

    q: int
    kv: int
    repeat: int  # each KV head sent to this many ranks (1: KV heads divide by S)


def head_split(heads: int, kv_heads: int, sp: int) -> HeadSplit:
    """ValueError (naming --sp and the head counts) when Ulysses cannot split these heads over `sp` ranks.

    Query heads must divide by S. KV heads either divide by S, or S is a multiple of them: then (the usual
    Ulysses answer to grouped-query attention) each KV head is repeated S / KV times, one copy per rank
    whose query heads read it (a rank's H/S query heads then all share one KV head, so the repeat changes
    which bytes travel, never what any head attends over)."""
    if sp < 1:
        raise ValueError(f"--sp must be >= 1, got {sp}")
    problem = None
    if heads % sp:
        problem = f"the {heads} query heads do not divide by {sp}"
    elif kv_heads % sp and sp % kv_heads:
        problem = f"the {kv_heads} key/value heads neither divide by {sp} nor divide {sp}"
    if problem:
        raise ValueError(
            f"--sp {sp}: {problem} (the model has {heads} attention heads and {kv_heads} key/value heads; "
            f"--sp must divide the attention heads, and divide or be a multiple of the key/value heads)"
        )
    if kv_heads % sp == 0:
        return HeadSplit(heads // sp, kv_heads // sp, 1)
    return HeadSplit(heads // sp, 1, sp // kv_heads)
