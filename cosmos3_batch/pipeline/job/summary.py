"""summary.json: the run's counts, failures, per-rank counters and config; and the line the CLI prints."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cosmos3_batch.config import RunConfig
from cosmos3_batch.io.metrics import iso_time
from cosmos3_batch.model.numerics import cpu_numerics
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.finish.results import versions
from cosmos3_batch.plan.cache import cache_record
from cosmos3_batch.requests.parse import RequestError, by_request

if TYPE_CHECKING:
    from cosmos3_batch.pipeline.finish.results import ResultWriter
    from cosmos3_batch.pipeline.job.run_plan import Plan
    from cosmos3_batch.pipeline.passes.runner import PassRunner


def preview(ids, limit: int = 8) -> str:
    """': a, b, c (+5 more)' for a log line; the full list is in summary.json."""
    ids = list(ids)
    if not ids:
        return ""
    more = f" (+{len(ids) - limit} more)" if len(ids) > limit else ""
    return ": " + ", ".join(ids[:limit]) + more


def rank_report(world: World, runner: PassRunner, writer: ResultWriter, gathers: bool) -> dict:
    totals = runner.totals
    return {
        "rank": world.rank,
        "ok": len(writer.ok),
        "failed": writer.failed,
        "blocked": writer.blocked,  # id -> the guardrail's reason (pipeline/finish/blocked.py)
        "passes": runner.passes,
        "und_passes": runner.und_passes,
        "gen_passes": runner.gen_passes,  # passes that fetched GEN parts: some rank had GEN work
        "pass_s": round(runner.pass_s, 6),
        "all_reduces": runner.sync.all_reduces,
        "gathers": totals.fetches if world.distributed and gathers else 0,
        "fetches": totals.fetches,
        "collective_trace": runner.sync.trace_digest,  # with --sp: equal within a group
        "world_trace": runner.sync.world_trace_digest,  # the all-reduce and part fetches: equal everywhere
        "sp_group": runner.sp.index if runner.sp is not None else world.rank,
        "all_to_alls": runner.sp.all_to_alls if runner.sp is not None else 0,
        **_vae_counts(runner.team),
        "abandoned": [job.request.id for job in runner.abandoned],
        "unwritten": writer.unwritten,  # decoded when the job stopped for a full disk: not written
        "not_started": len(runner.not_started),
        "h2d_bytes": totals.h2d_bytes,
        "gathered_bytes": totals.gathered_bytes,
        "stall_s": round(totals.stall_s, 6),
        "collective_s": round(totals.collective_s, 6),
        "compute_s": round(totals.compute_s, 6),
        "h2d_s": round(totals.h2d_s, 6),
        "stall_share": round(totals.stall_share, 6),
        "skipped_passes": runner.skipped_passes,  # --cache sea: no branch anywhere computed, nothing fetched
        "forwards_computed": runner.forwards[0],  # branch forwards that ran the layers (--sp: once)
        "forwards_reused": runner.forwards[1],  # ... and that reused a cached residual
        "und_runs": runner.apply.und_runs,
        "gen_runs": runner.apply.gen_runs,
        # Requests active per pass, summed: those in generation slots / (passes x max_active) is their mean
        # occupancy; those in reasoner slots (of them) / (passes x max_reason_active) the reasoner slots'.
        "active_sum": sum(record.active for record in runner.timeline),
        "reason_active_sum": runner.reason_active_sum,
    }


def build_summary(
    cfg: RunConfig, plan: Plan, ranks: list[dict], failed: dict, wall: float, world: World
) -> dict:
    ok = sum(report["ok"] for report in ranks)
    invalid = by_request(plan.invalid)  # one entry per invalid request, with every error it has
    return {
        "requests_in_file": len(plan.requests) + len(plan.complete) + len(invalid),
        "generated_ok": ok,
        "failed": [{"id": k, "error": v} for k, v in sorted(failed.items())],
        "blocked": [{"id": k, "reason": v} for k, v in sorted(_blocked(ranks).items())],
        "skipped_complete": len(plan.complete),
        "skipped_complete_ids": sorted(r.id for r in plan.complete),
        "invalid": [
            {
                "file": errors[0].source,
                errors[0].unit: errors[0].line,
                "errors": [{"field": e.field, "error": e.message} for e in errors],
            }
            for errors in invalid
        ],
        "started_at": iso_time(time.time() - wall),
        "wall_s": round(wall, 3),
        "outputs_per_minute": round(60 * ok / wall, 3) if wall > 0 else None,
        "ranks": ranks,
        "cache": _cache_shares(ranks),
        "clocks": clocks(world.device),
        "config": {
            "prompts": [p if p == "-" else str(Path(p).resolve()) for p in cfg.prompts],
            **(cfg.model_source.record() if cfg.model_source else {"model": str(plan.model_dir)}),
            "samples_per_prompt": cfg.samples_per_prompt,
            "max_active": cfg.max_active,
            "max_reason_active": cfg.max_reason_active,  # as taken (null: nothing ran): `reasoner_sizing`
            "und_resident": cfg.und_resident,
            "reasoner_sizing": plan.sizing,  # each of the two: its value, "flag" or "default", and why
            "offload": cfg.offload.value,
            "world_size": world.world_size,
            "sp": cfg.sp,
            "vae_patch_parallel_size": cfg.vae_patch_parallel_size,
            "device": str(world.device),
            # What a comparison run must also use (docs/running.md, "Compute dtype").
            "dtype": cfg.dtype,
            "vae_dtype": cfg.vae_dtype,
            "max_batch_rows": cfg.max_batch_rows,
            "prefill": dataclasses.asdict(cfg.prefill),  # with the requests, what `plan` replays exactly
            "cache": cache_record(cfg.cache),  # what SeaCacheConfig a comparison run takes
            "guardrails": plan.guardrails,  # false: --no-guardrails, or a make-tiny model's default
        },
        "versions": versions(),
        # On CPU the bits depend on MKL's reproducibility mode: what a comparison run must also use.
        "cpu_numerics": cpu_numerics() if world.device.type == "cpu" else None,
    }


def clocks(device) -> dict:
    """Which clock each time of `ranks` (and of passes.*.csv) was read from. On CUDA the engine's times are
    device times (CUDA event pairs, every pass's read by the end of the run); the pass loop's own durations
    are host time from when it issued a pass's work to when it had issued all of it, which on a GPU runs
    ahead of the device: an enqueue time, not the pass's device time."""
    cuda = device.type == "cuda"
    engine = "cuda events" if cuda else "host wall clock"
    loop = "host enqueue (the device may run behind)" if cuda else "host wall clock"
    return {
        **dict.fromkeys(("stall_s", "collective_s", "compute_s", "h2d_s"), engine),
        "pass_s": loop,
        "passes_csv": {"duration_s": loop, "stall_s": engine},
    }


def _cache_shares(ranks: list[dict]) -> dict:
    """The share of branch forwards reused and of passes that fetched nothing (every rank has the same
    passes, so rank 0's count is the job's)."""
    computed = sum(r["forwards_computed"] for r in ranks)
    reused = sum(r["forwards_reused"] for r in ranks)
    passes, skipped = (ranks[0]["passes"], ranks[0]["skipped_passes"]) if ranks else (0, 0)
    return {
        "forwards_computed": computed,
        "forwards_reused": reused,
        "reused_share": round(reused / (computed + reused), 6) if computed + reused else 0.0,
        "passes": passes,
        "skipped_passes": skipped,
        "skipped_share": round(skipped / passes, 6) if passes else 0.0,
    }


def _vae_counts(team) -> dict:
    """--vae-patch-parallel-size: split walks this rank took part in, and the tensors it sent in them."""
    groups = [] if team is None else [g for g in (team.decoding, team.encoding) if g is not None]
    return {
        "vae_split_decodes": team.split_decodes if team is not None else 0,
        "vae_split_encodes": team.split_encodes + team.split_boundary_encodes if team is not None else 0,
        "vae_messages": sum(g.messages for g in groups),
    }


def _blocked(ranks: list[dict]) -> dict[str, str]:
    return {k: v for report in ranks for k, v in report["blocked"].items()}


def summary_name(tag: str) -> str:
    return f"summary.{tag}.json" if tag else "summary.json"


def describe_invalid(errors: list[RequestError], limit: int = 10) -> str:
    """The invalid requests --skip-invalid leaves out, each with its errors, for the log: the first `limit`
    requests (the rest are in summary.json), so the terminal shows what was skipped, not only a count."""
    invalid = by_request(errors)
    lines = [f"{e.source}: {e}" for group in invalid[:limit] for e in group]
    if len(invalid) > limit:
        lines.append(f"(+{len(invalid) - limit} more invalid requests: summary.json lists them all)")
    return "\n".join(lines)


STOPPED_BY = {"disk": "a full or read-only output filesystem", "checkpoint": "a changed checkpoint"}


def describe_summary(summary: dict, out: Path) -> str:
    line = (
        f"{summary['generated_ok']} generated, {len(summary['failed'])} failed, "
        + (f"{len(summary['blocked'])} blocked by the guardrails, " if summary.get("blocked") else "")
        + f"{summary['skipped_complete']} already complete, {len(summary['invalid'])} invalid -> {out}"
    )
    if stopped := summary.get("interrupted"):
        left = len(stopped["abandoned"]) + stopped["not_started"]
        cause = stopped["signal"] or STOPPED_BY.get(stopped.get("reason", ""), "a signal")
        line = f"stopped by {cause}: {line}; {left} not generated (rerun the same command to resume)"
    return line
