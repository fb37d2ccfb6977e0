"""What `cosmos3-batch plan` prints for a request file: the schedule, the pass simulation, and with --model
the weights' format and the estimate (plan/planner.py)."""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.checkpoint.guardrail_cache import written_by_make_tiny
from cosmos3_batch.checkpoint.hub import resolve_model
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.model.vae_shards import check_patchable
from cosmos3_batch.parallel.sequence import check_model, check_world
from cosmos3_batch.plan import text as plan_text
from cosmos3_batch.plan.branches import transfer_work
from cosmos3_batch.plan.cache import SeaSettings, check_cache, check_reuse
from cosmos3_batch.plan.guardrail_cost import describe as describe_guardrails
from cosmos3_batch.plan.guardrail_cost import guardrail_cost
from cosmos3_batch.plan.hardware import Hardware
from cosmos3_batch.plan.model_shape import ModelShape, model_shape
from cosmos3_batch.plan.planner import estimate, idle_warning, prompt_tokens, simulate_job, und_half_bytes
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.reason_memory import (
    ReasonerSizing,
    sequence_kv,
    size_reasoner,
    vision_counter,
)
from cosmos3_batch.plan.reason_plan import (
    decode_rates,
    describe_rates,
    describe_reason,
    reason_work,
    und_resident_fit,
)
from cosmos3_batch.plan.row_budget import MAX_BATCH_ROWS
from cosmos3_batch.plan.schedule import Assignment, assign
from cosmos3_batch.requests.parse import Request, no_cycle_collection
from cosmos3_batch.requests.sources import ALL_NAMED, Columns


@no_cycle_collection()  # a million requests, schedules and queues: no cycles among them (requests/parse.py)
def plan_job(
    prompts: str | list[str],
    model: str | None,
    nproc: int,
    nnodes: int,
    offload: str,
    max_active: int,
    hw: Hardware,
    shard: str | None = None,
    max_vision_tokens: int = 65536,
    rule: PrefillRule | None = None,
    sp: int = 1,
    samples: int = 1,
    columns: Columns = ALL_NAMED,
    stdin: bytes | None = None,
    dtype: str = "checkpoint",
    vae_dtype: str = "checkpoint",
    max_batch_rows: int | None = MAX_BATCH_ROWS,
    vae_tiling: bool = False,
    vae_parts: int = 1,
    cache: tuple[SeaSettings, float] | None = None,
    input_format: str = "auto",
    und_resident: bool | None = None,
    guardrails: bool | None = None,
    chain=None,
    max_reason_active: int | None = None,
) -> tuple[dict, str]:
    """What `plan` prints, as a JSON-able document and as text. ValueError for bad flags or requests.
    `prompts`, `samples`, `columns` and `stdin` are read as `run` reads them; `model` a folder or repo id.
    `cache`: --cache sea's settings and the share of branch forwards taken to reuse (--cache-reuse).
    `guardrails`: as `run --guardrails`; None: on for a real checkpoint, off for make-tiny's (and none).
    `chain`: requests/chain.py ChainDefaults of `--upsample` / `--caption` (None: off). `und_resident`,
    `max_reason_active`: the flags (None: decided as `run` decides them, plan/reason_memory.py)."""
    from cosmos3_batch.engine.transport import parse_offload
    from cosmos3_batch.plan.validate import checked_requests

    rule = rule if rule is not None else PrefillRule()
    _check_flags(nproc, nnodes, samples, sp, vae_parts, vae_tiling, max_reason_active)
    mode = parse_offload(offload)
    groups = check_world(sp, nproc)  # --sp: the groups are the schedule's ranks
    source = resolve_model(model) if model is not None else None
    checkpoint = Checkpoint.open(source.path) if source is not None else None
    if checkpoint is not None:
        check_model(sp, checkpoint.config("transformer"))
        check_patchable(checkpoint.config("vae"), vae_parts)
    limits = _limits(checkpoint, max_vision_tokens)
    if chain is not None:
        limits = replace(limits, chain=chain)
    # What run refuses before loading, plan refuses in the same words (with --model: the token counts too).
    requests = checked_requests(
        prompts, checkpoint, limits, samples=samples, columns=columns, stdin=stdin, input_format=input_format
    )
    requests = _in_shard(requests, shard)
    if cache is not None:
        check_cache(cache[0], requests)  # what run refuses with --cache sea, plan refuses too
        check_reuse(cache[1])
    assignment = assign(requests, groups)
    doc, text = _schedule_section(source, requests, assignment, nproc, sp)
    if samples_doc := _cosmos_samples(prompts, limits, input_format):
        doc["cosmos_framework_samples"] = samples_doc
    shape = (
        model_shape(checkpoint, nproc, torch.bfloat16, dtype, vae_dtype) if checkpoint is not None else None
    )
    job = (nproc, nnodes, mode, max_active, hw, rule.lookahead, sp)
    context = (job, (max_batch_rows, vae_tiling, vae_parts), assignment, cache, max_vision_tokens)
    estimates, sizing = _sizing(checkpoint, shape, requests, context, (und_resident, max_reason_active))
    doc["reasoner_sizing"] = sizing.record()
    sim = simulate_job(assignment.queues, max_active, rule, shape, mode, nproc, *sizing.values)
    doc["simulation"] = sim.to_dict()
    text += ["", plan_text.describe_simulation(sim, rule, max_active, shape is not None)]
    if (chains := transfer_work(requests)) is not None:
        doc["transfer"] = chains
        text.append(plan_text.describe_transfer(chains, rule.chunk_gap))
    if (work := reason_work(requests, sim)) is not None:
        doc["reason"] = work
        text += [describe_reason(work), plan_text.describe_sizing(doc["reasoner_sizing"])]
    if shape is not None:
        text += _model_section(doc, checkpoint, shape, job, estimates, sizing)
    else:
        text.append(
            "add --model CKPT for memory per rank, bytes moved per pass and a roofline time "
            "(reads only the checkpoint's configs and headers)"
        )
    if guardrails if guardrails is not None else checkpoint is not None and _real(source.path):
        doc["guardrails"] = (cost := guardrail_cost(requests, hw)).to_dict()
        text.append(describe_guardrails(cost))
    if cache is not None:
        doc["cache"] = {**cache[0].record(), "reuse": cache[1]}
        text.append(plan_text.describe_cache(cache[1], doc.get("estimate")))
    if warning := idle_warning(assignment.idle_share):
        doc.setdefault("warnings", []).append(warning)
        text.append(f"WARNING: {warning}")
    return doc, "\n".join(text)


def _real(folder) -> bool:
    """Not a folder make-tiny wrote: guardrails default to on (pipeline/job/screen.py)."""
    return not written_by_make_tiny(folder)


def _cosmos_samples(prompts: str | list[str], limits, input_format: str) -> list[dict]:
    """NVIDIA samples: how each maps, to check before a long job (requests/cosmos_load.py); else []."""
    from cosmos3_batch.requests.cosmos_load import mappings
    from cosmos3_batch.requests.sources import expand

    inputs = [prompts] if isinstance(prompts, str | os.PathLike) else prompts
    return mappings(expand([str(p) for p in inputs])[0], limits, input_format)


def _check_flags(
    nproc: int, nnodes: int, samples: int, sp: int, vae_parts: int, vae_tiling: bool, reason_slots: int | None
) -> None:
    from cosmos3_batch.requests.fields import MAX_SAMPLES

    if reason_slots is not None and reason_slots < 1:
        raise ValueError(f"--max-reason-active must be >= 1, got {reason_slots}")
    if nproc < 1 or nnodes < 1 or nproc % nnodes:
        raise ValueError(f"--nproc ({nproc}) must be a positive multiple of --nnodes ({nnodes})")
    if not 1 <= samples <= MAX_SAMPLES:
        raise ValueError(f"--samples-per-prompt must be >= 1 and <= {MAX_SAMPLES}, got {samples}")
    if vae_parts < 1 or sp % vae_parts or (vae_parts > 1 and vae_tiling):
        raise ValueError(
            f"--vae-patch-parallel-size {vae_parts} must divide --sp {sp} (and excludes --vae-tiling)"
        )


def _limits(checkpoint: Checkpoint | None, max_vision_tokens: int):
    from cosmos3_batch.model.limits import limits_for
    from cosmos3_batch.requests.parse import ModelLimits

    if checkpoint is None:
        return ModelLimits(max_vision_tokens=max_vision_tokens)
    return limits_for(checkpoint, max_vision_tokens)


def _in_shard(requests: list[Request], shard: str | None) -> list[Request]:
    from cosmos3_batch.plan.schedule import in_shard, parse_shard

    if shard is None:
        return requests
    index, count = parse_shard(shard)
    return [r for r in requests if in_shard(r.id, index, count)]


def _schedule_section(source, requests: list[Request], assignment: Assignment, nproc: int, sp: int):
    """The document's head and the schedule's lines: which requests each rank (or --sp group) runs."""
    from cosmos3_batch.plan.schedule import describe as describe_schedule

    doc: dict = {
        **({"model": source.record()} if source is not None else {}),
        "sp": sp,
        "requests": len(requests),
        "ranks": [
            {"rank": rank, "ids": [r.id for r in queue], "predicted_work": cost}
            for rank, (queue, cost) in enumerate(zip(assignment.queues, assignment.costs, strict=True))
        ],
        "predicted_idle_share": assignment.idle_share,
        "total_work": sum(assignment.costs),
    }
    groups = nproc // sp
    where = (
        f"{nproc} rank(s)"
        if sp == 1
        else f"{nproc} ranks in {groups} --sp {sp} groups (a group is a rank below)"
    )
    text = [f"{len(requests)} valid requests on {where}; work in GEN-token x steps x branches"]
    text.append(describe_schedule(assignment))
    return doc, text


def _sizing(checkpoint, shape, requests, context: tuple, flags: tuple) -> tuple:
    """(und_resident -> plan's estimate, computed once each way; --und-resident and --max-reason-active as
    `run` decides them, plan/reason_memory.py, for a device of --device-gib). `context`: (job, vae,
    assignment, cache, max_vision_tokens), job (nproc, nnodes, mode, max_active, hw, lookahead, sp), vae
    (max_batch_rows, tiling, parts). Without --model there is no shape to size from."""
    job, vae, assignment, cache, max_vision_tokens = context
    mode, hw = job[2], job[4]
    if shape is None:
        return None, size_reasoner(requests, mode, flags, None, None, None, "a plan without --model")
    tokens = prompt_tokens(checkpoint, requests)
    reuse, order = (cache[1], cache[0].residual_order) if cache else (0.0, None)
    args = (shape, requests, tokens, *job, *vae, assignment, reuse, order)
    estimates = functools.cache(lambda und: estimate(*args, und_resident=und))
    vision = vision_counter(checkpoint.root, max_vision_tokens)
    return estimates, size_reasoner(
        requests,
        mode,
        flags,
        int(hw.device_gib * 2**30),
        lambda und: estimates(und).device_bytes_per_rank,
        lambda: sequence_kv(shape, requests, tokens, vision),
        lookahead=job[5],
    )


def _model_section(doc: dict, checkpoint, shape, job: tuple, estimates, sizing: ReasonerSizing) -> list[str]:
    """With --model: the weights' format and the estimate (memory, bytes per pass, roofline), into `doc`.
    `job`: (nproc, nnodes, mode, max_active, hw, lookahead, sp). A job with reasoner decoding (doc["reason"])
    and offloaded weights: whether the UND half fits beside the rest, held or not."""
    doc["weights"] = weight_format(checkpoint, shape)
    text = [f"layer weights: {doc['weights']['format']}, {doc['weights']['layer_gib']:.2f} GiB"]
    held = bool(sizing.und_resident.value)
    est = estimates(held)
    doc["estimate"] = est.to_dict()
    if not plan_text.resolvable(est):
        doc["estimate"].update(seconds_per_pass=None, outputs_per_hour=None, job_hours=None)
    text += ["", plan_text.describe(est)]
    mode, hw = job[2], job[4]
    if "reason" in doc:  # decode passes: bandwidth-bound, the UND half streamed or held (both ways)
        doc["reason"]["decode"] = decode_rates(und_half_bytes(shape), mode, job[:2], hw, doc["reason"])
        text.append(describe_rates(doc["reason"]["decode"], mode))
    if "reason" in doc and mode is not OffloadMode.RESIDENT:  # resident: the UND half is there already
        doc["und_resident"] = und_resident_fit(estimates(True), hw.device_gib, held)
        text.append(plan_text.describe_und_resident(doc["und_resident"], sizing.und_resident.chosen_by))
    return text


def weight_format(checkpoint: Checkpoint, shape: ModelShape) -> dict:
    """What the layers are stored as (FP8 halves every byte figure of the plan) and their total size."""
    fp8 = bool(checkpoint.config("transformer").get("quantization_config"))
    dtypes = sorted({str(p.spec.dtype).removeprefix("torch.") for part in shape.parts for p in part.params})
    return {
        "format": "fp8 e4m3 per-tensor (ModelOpt) + scales" if fp8 else "/".join(dtypes),
        "fp8": fp8,
        "layer_gib": sum(part.payload_bytes for part in shape.parts) / 2**30,
    }
