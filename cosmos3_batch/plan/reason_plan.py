"""What `plan` says about a job's reasoner requests (DESIGN.md §21), torch-free: tokens planned (each
request's `max_new_tokens`: EOS may end one sooner), the passes they decode on, and the UND weight bytes
moved per generated token: every decode pass fetches each layer's UND part once for all the sequences
active on it, so the bytes per token fall as more sequences share the passes (`--max-active`)."""

from __future__ import annotations

from cosmos3_batch.plan.branches import chain_tokens
from cosmos3_batch.plan.simulator import Simulation


def reason_work(requests, sim: Simulation) -> dict | None:
    """Reasoner requests and the reasoner stages chained to generation requests (upsample, caption, score:
    DESIGN.md §22), their tokens planned apart and together."""
    reasoners = [r for r in requests if getattr(r, "reason", None) is not None]
    chained = [chain_tokens(r) for r in requests]
    upsample, captions = sum(up for up, _ in chained), sum(after for _, after in chained)
    if not reasoners and not upsample and not captions:
        return None
    tokens = sum(r.reason.max_new_tokens for r in reasoners) + upsample + captions
    return {
        "requests": len(reasoners),
        "upsample_tokens_planned": upsample,
        "caption_tokens_planned": captions,
        "tokens_planned": tokens,
        "decode_passes": sim.decode_passes,
        "tokens_per_decode_pass": tokens / sim.decode_passes if sim.decode_passes else 0.0,
        "und_bytes_per_token": sim.decode_und_bytes / tokens,
    }


def und_resident_fit(est, device_gib: float, requested: bool) -> dict:
    """`est`: the estimate with --und-resident (plan/planner.py `estimate(und_resident=True)`): the UND half's
    bytes per rank, the device bytes per rank with it, and whether they fit `device_gib` (--device-gib)."""
    total = est.device_bytes_per_rank
    return {
        "requested": requested,
        "und_bytes_per_rank": est.device_breakdown.get("und_resident", 0),
        "device_bytes_per_rank": total,
        "device_gib": device_gib,
        "fits": total <= device_gib * 2**30,
    }


def describe_reason(work: dict) -> str:
    chained = ""
    if work["upsample_tokens_planned"] or work["caption_tokens_planned"]:
        chained = (
            f" (of which {work['upsample_tokens_planned']:,} upsampling prompts and "
            f"{work['caption_tokens_planned']:,} captioning and scoring outputs)"
        )
    return (
        f"reasoner: {work['requests']} request(s){chained}, up to {work['tokens_planned']:,} tokens on "
        f"{work['decode_passes']:,} decode passes ({work['tokens_per_decode_pass']:.1f} tokens a pass); "
        f"UND weight bytes moved per generated token: {work['und_bytes_per_token']:,.0f} (all ranks)"
    )
