"""What `plan` prints: the estimate and the simulation as text (plan/planner.py computes them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosmos3_batch.plan.estimate import Estimate
    from cosmos3_batch.plan.prefill import PrefillRule
    from cosmos3_batch.plan.simulator import Simulation

MIN_PASS_S = 1e-3  # the roofline cannot resolve faster passes
BREAKDOWN_NOTES = {
    "slots": ": the engine's weight slots (2 GEN + 1 UND; with --und-resident 2 GEN)",
    "und_resident": ": --und-resident, every layer's UND part, whole on each rank",
    "layer_weights": ": layers kept on the device (resident: all; sharded: this rank's shards)",
    "resident_weights": ": non-layer weights and the VAE's",
    "activations": ": kept (the active requests' GEN rows and UND K/V, and those prefilled ahead)",
    "batched_transient": ": the largest layer call's working set (--max-batch-rows)",
    "vae_decode": ": the finisher's peak for the largest output (one decode at a time)",
    "runtime_overhead": ": CUDA context, GEMM workspaces, NCCL communicators (constants)",
    "cache_residuals": ": --cache sea, each request's residuals and stack input per GEN branch",
}


def resolvable(est: Estimate) -> bool:
    """Below a millisecond per pass the roofline says nothing true (launch and Python overheads dominate):
    print no throughput then rather than billions of outputs per hour."""
    return est.seconds_per_pass >= MIN_PASS_S


def describe(est: Estimate) -> str:
    rows = [
        (
            "ranks x nodes",
            f"{est.world_size} x {est.nnodes}  (--offload {est.mode}, --max-active {est.max_active})",
        ),
        ("layer weights (padded)", _size(est.layer_bytes)),
        *_memory_rows(est),
        (
            "per pass per rank",
            f"{_size(est.bytes_h2d_per_pass)} H2D, {_size(est.bytes_gathered_per_pass)} gathered",
        ),
    ]
    if est.decode_s > 0:
        decode = (
            f"{est.decode_s:.3g} s (roofline), {_size(est.device_breakdown.get('vae_decode', 0))} per rank"
        )
        if est.vae_parts > 1:
            decode += (
                f" at --vae-patch-parallel-size {est.vae_parts} (one rank: {est.decode_s_unsplit:.3g} s, "
                f"{_size(est.decode_bytes_unsplit)})"
            )
        rows.append(("VAE decode, largest output", decode))
    if est.sp > 1:
        rows.append(
            (
                "sequence parallel",
                f"--sp {est.sp}: {est.world_size // est.sp} group(s) of {est.sp}; all-to-alls "
                f"{_size(est.all_to_all_bytes_per_pass)} per pass per rank, "
                f"{est.all_to_all_s_per_pass:.4f} s",
            )
        )
    if resolvable(est):
        rows += [
            ("seconds per pass", f"{est.seconds_per_pass:.3f} (roofline)"),
            ("outputs per hour", f"{est.outputs_per_hour:,.1f} (whole job, typical request)"),
            ("job time", f"{est.job_hours:.2f} h (busiest rank), idle share {est.idle_share:.1%}"),
        ]
    else:
        rows.append(
            (
                "seconds per pass",
                f"below {MIN_PASS_S * 1e3:g} ms: too small a model for the roofline to predict a time",
            )
        )
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"WARNING: {w}" for w in est.warnings]
    return "\n".join(lines)


def describe_simulation(sim: Simulation, rule: PrefillRule, max_active: int, with_bytes: bool) -> str:
    rule_text = (
        f"--prefill-free-share {rule.free_share:g} --prefill-max-wait {rule.max_wait} "
        f"--prefill-lookahead {rule.lookahead}, --max-active {max_active}"
    )
    fetched = f"{sim.und_passes:,} fetching UND parts, {sim.gen_passes:,} GEN parts"
    lines = [
        f"simulated passes        {sim.passes:,} ({fetched}; {rule_text})",
        f"mean slot occupancy     {sim.occupancy:.1%}",
    ]
    if sim.reason_occupancy:  # reasoner requests in their own slots (--max-reason-active)
        lines.append(f"reasoner slots          {sim.reason_occupancy:.1%} occupied")
    if with_bytes:
        lines += [
            f"weight bytes per output {_size(sim.bytes_per_output)} (UND halves: {sim.und_byte_share:.1%})",
            f"weight bytes per rank   {_size(sim.bytes_per_rank)} over the run",
        ]
    return "\n".join(lines)


def _memory_rows(est: Estimate) -> list[tuple[str, str]]:
    """Host memory per rank and node, then device memory per rank by what holds it."""
    rows = [("host private per rank", f"{_size(est.host_private_bytes_per_rank)} (shards + embeddings)")]
    if est.transfer_host_bytes_per_rank:
        rows.append(
            ("  + Transfer per rank", f"{_size(est.transfer_host_bytes_per_rank)} (controls, decoded chunks)")
        )
    rows += [
        ("page cache per node", f"{_size(est.page_cache_bytes_per_node)} kept hot"),
        ("device per rank", f"{_size(est.device_bytes_per_rank)}, of which:"),
    ]
    return rows + [
        (f"  {name}", _size(nbytes) + BREAKDOWN_NOTES.get(name, ""))
        for name, nbytes in est.device_breakdown.items()
    ]


def describe_und_resident(fit: dict, chosen_by: str) -> str:
    """The --und-resident line of a job with reasoner decoding: the UND half's bytes per rank and whether the
    device holds them beside the rest (held: the device line counts them; else what it would be)."""
    und, total = _size(fit["und_bytes_per_rank"]), _size(fit["device_bytes_per_rank"])
    verdict = f"{'fits' if fit['fits'] else 'does not fit'} --device-gib {fit['device_gib']:g}"
    if fit["held"]:
        advice = "" if fit["fits"] else ": drop --und-resident (the UND parts then stream through one slot)"
        return (
            f"--und-resident: the UND half, {und} per rank (counted in the device line), "
            f"{total} per rank in all: {verdict}{advice}"
        )
    advice = ""
    if fit["fits"] and chosen_by == "flag":
        advice = ": drop --no-und-resident to move no UND bytes per generated token"
    held = f"--und-resident would hold the UND half, {und} per rank: {total} per rank in all"
    return f"{held}, {verdict}{advice}"


def describe_sizing(record: dict) -> str:
    """What the reasoner takes of device memory, as taken and why (plan/reason_memory.py): the line `run`'s
    summary.json records in its config too."""
    slots, und = record["max_reason_active"], record["und_resident"]
    return (
        f"reasoner memory: --max-reason-active {slots['value']} ({_source(slots)}), "
        f"--{'' if und['value'] else 'no-'}und-resident ({_source(und)})"
    )


def _source(decision: dict) -> str:
    return "given" if decision["chosen_by"] == "flag" else f"default: {decision['why']}"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def describe_cache(reuse: float, est: dict | None) -> str:
    """The --cache sea line: what the reuse share buys (time) and what it does not (bytes, mostly)."""
    line = (
        f"--cache sea: {reuse:.0%} of branch forwards taken to reuse (--cache-reuse; the default is "
        "vLLM-Omni's published 1.8x on Cosmos3-Nano, docs/scale.md)"
    )
    if est is None:
        return line + "; add --model for its time"
    skipped = est["skipped_share"]
    return (
        f"{line}; seconds per pass above count only the computing branches. A pass fetches every layer "
        f"while any branch anywhere computes: {skipped:.2%} of passes guessed to skip their fetch "
        f"(requests deciding independently), so weight bytes per output x {1 - skipped:.3f}; a fetch-bound "
        "job gains little from the cache"
    )


def describe_transfer(chains: dict, chunk_gap: int) -> str:
    return (
        f"Transfer: {chains['requests']} chain(s), {chains['chunks']} chunks: {chains['vae_decodes']} "
        f"VAE decodes, {chains['vae_encodes']} encodes (controls + target per chunk); a chain sits "
        f"out --chunk-gap-passes {chunk_gap} passes per chunk boundary"
    )
