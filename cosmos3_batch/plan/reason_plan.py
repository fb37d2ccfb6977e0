"""What `plan` says about a job's reasoner requests (DESIGN.md §21), torch-free: tokens planned (each
request's `max_new_tokens`: EOS may end one sooner), the passes they decode on, and the UND weight bytes
moved per generated token: every decode pass fetches each layer's UND part once for all the sequences
active on it, so the bytes per token fall as more sequences share the passes (`--max-active`)."""

from __future__ import annotations

from cosmos3_batch.plan.simulator import Simulation


def reason_work(requests, sim: Simulation) -> dict | None:
    reasoners = [r for r in requests if getattr(r, "reason", None) is not None]
    if not reasoners:
        return None
    tokens = sum(r.reason.max_new_tokens for r in reasoners)
    return {
        "requests": len(reasoners),
        "tokens_planned": tokens,
        "decode_passes": sim.decode_passes,
        "tokens_per_decode_pass": tokens / sim.decode_passes if sim.decode_passes else 0.0,
        "und_bytes_per_token": sim.decode_und_bytes / tokens,
    }


def describe_reason(work: dict) -> str:
    return (
        f"reasoner: {work['requests']} request(s), up to {work['tokens_planned']:,} tokens on "
        f"{work['decode_passes']:,} decode passes ({work['tokens_per_decode_pass']:.1f} tokens a pass); "
        f"UND weight bytes moved per generated token: {work['und_bytes_per_token']:,.0f} (all ranks)"
    )
