"""What `plan` says about a job's reasoner requests (DESIGN.md §21), torch-free: tokens planned (each
request's `max_new_tokens`: EOS may end one sooner), the passes they decode on, and the UND weight bytes
moved per generated token: every decode pass fetches each layer's UND part once for all the sequences
active on it, so the bytes per token fall as more sequences share the passes (`--max-active`)."""

from __future__ import annotations

from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.plan.branches import chain_tokens
from cosmos3_batch.plan.hardware import Hardware
from cosmos3_batch.plan.simulator import Simulation

UND_BYTES_PER_PARAM = (
    2  # bf16 as stored: the reasoner does not run FP8 checkpoints (checkpoint/reasoner_parts.py)
)


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


def und_resident_fit(est, device_gib: float, held: bool) -> dict:
    """`est`: the estimate with --und-resident (plan/planner.py `estimate(und_resident=True)`): the UND half's
    bytes per rank, the device bytes per rank with it, and whether they fit `device_gib` (--device-gib).
    `held`: the UND half stays on the device (the flag, or plan/reason_memory.py's default)."""
    total = est.device_bytes_per_rank
    return {
        "held": held,
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


def decode_rates(und_bytes: int, mode: OffloadMode, world: tuple[int, int], hw: Hardware, work: dict) -> dict:
    """A decode pass's roofline both ways, and the job's generated tokens per second from it. `und_bytes`: the
    UND half (planner.und_half_bytes); `world`: (ranks, nodes). Decode is bandwidth-bound: a pass reads
    each layer's UND part once for every sequence on the rank, so it lasts as long as its slowest stream
    (the copy of this rank's shards, the gather of the rest, the compute's HBM read of the gathered part)
    or its GEMMs (2 flops per parameter per token), whichever is longer. Resident, only the HBM read and
    the GEMMs remain. GEN parts move only on passes with GEN work: none here."""
    ranks, nodes = world
    tokens = work["tokens_per_decode_pass"]  # all ranks
    compute = 2 * und_bytes / UND_BYTES_PER_PARAM * tokens / ranks / (hw.tflops * 1e12)
    hbm = und_bytes / (hw.hbm_gbps * 1e9)
    gather_gbps = hw.gather_gbps if nodes == 1 else hw.inter_node_gbps
    streams = {
        OffloadMode.ALLGATHER: (
            und_bytes / ranks / (hw.h2d_gbps * 1e9),
            und_bytes * (ranks - 1) / ranks / (gather_gbps * 1e9),
        ),
        OffloadMode.LOCAL: (und_bytes / (hw.h2d_gbps * 1e9), 0.0),
        OffloadMode.SHARDED: (0.0, und_bytes * (ranks - 1) / ranks / (gather_gbps * 1e9)),
        OffloadMode.RESIDENT: (0.0, 0.0),
    }[mode]
    streamed = max(*streams, hbm, compute)
    resident = max(hbm, compute)
    return {
        "pass_s_streamed": streamed,
        "pass_s_und_resident": resident,
        "tokens_per_s_streamed": tokens / streamed if streamed else 0.0,
        "tokens_per_s_und_resident": tokens / resident if resident else 0.0,
    }


def describe_rates(rates: dict, mode: OffloadMode) -> str:
    streamed = (
        f"{rates['pass_s_streamed'] * 1e3:.1f} ms streaming the UND parts (--offload {mode.value}), "
        f"{rates['tokens_per_s_streamed']:,.0f} tokens/s; "
        if mode is not OffloadMode.RESIDENT
        else ""
    )
    resident = rates["pass_s_und_resident"] * 1e3
    return (
        f"reasoner decode pass (roofline): {streamed}{resident:.1f} ms with the UND half on the device, "
        f"{rates['tokens_per_s_und_resident']:,.0f} tokens/s (the whole job)"
    )
