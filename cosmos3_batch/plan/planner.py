"""Sizing a job before submitting it: memory per rank, bytes per pass and a throughput roofline.

Reads config.json and safetensors headers only (no weights). Memory figures follow the engine's own
layout rules (engine/layout.py), so "device slot" here is the exact slot the engine will allocate.
The roofline: every pass walks the GEN parts; a part costs max(compute, fetch) because fetch k+1
overlaps compute k; compute is 2 x params x tokens plus attention; fetch is the H2D copy of a
rank's shard plus the AllGather of the rest.
"""

from __future__ import annotations

import statistics

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.engine.layout import PartLayout
from cosmos3_batch.engine.offload import slot_sizes
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.model.cosmos3 import GEN, LANE_SLOTS, UND
from cosmos3_batch.parallel.sequence import SpCost, sp_cost, spans_nodes
from cosmos3_batch.plan.branches import most_branches, sim_requests
from cosmos3_batch.plan.cache import skip_share
from cosmos3_batch.plan.device_memory import (
    activation_bytes,
    decode_bytes,
    decode_seconds,
    runtime_overhead_bytes,
)
from cosmos3_batch.plan.estimate import Estimate
from cosmos3_batch.plan.hardware import Hardware
from cosmos3_batch.plan.kept_memory import cache_device_bytes, transfer_host_bytes
from cosmos3_batch.plan.model_shape import ModelShape
from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.row_budget import MAX_BATCH_ROWS
from cosmos3_batch.plan.schedule import Assignment, assign, gen_tokens
from cosmos3_batch.plan.simulator import PartBytes, Simulation, simulate
from cosmos3_batch.requests.parse import Request

GB = 1e9
IDLE_WARN_SHARE = 0.25  # a quarter of the GPU-time idle: worth changing --nproc or the file


def estimate(
    shape: ModelShape,
    requests: list[Request],
    und_tokens: dict[str, int],
    world_size: int,
    nnodes: int,
    mode: OffloadMode,
    max_active: int,
    hw: Hardware,
    lookahead: int = 0,
    sp: int = 1,
    max_batch_rows: int | None = MAX_BATCH_ROWS,
    vae_tiling: bool = False,
    vae_parts: int = 1,
    assignment: Assignment | None = None,
    reuse: float = 0.0,
    cache_order: int | None = None,
    und_resident: bool = False,
) -> Estimate:
    """`max_batch_rows`: the row budget of batched calls (batched is the GPU default); None: no budget.
    `vae_parts`: --vae-patch-parallel-size. `assignment`: the schedule of `requests` over the groups, when
    the caller has it already. `reuse`: --cache sea's share of branch forwards reused (plan/cache.py);
    `cache_order`: its residual_order (None: no cache), for the residuals it keeps. `und_resident`:
    --und-resident, every layer's UND part on the device and no UND slot."""
    gen_parts = [p for p in shape.parts if p.key.endswith(GEN)]
    layer_bytes = sum(p.nbytes for p in shape.parts)
    shards = sum(p.shard_bytes for p in shape.parts)
    slot = max(p.nbytes for p in shape.parts)
    per_node = max(1, world_size // nnodes)
    # A typical pass: K copies of the median request (by GEN tokens: vision + sound + action; Transfer: a
    # chunk's, its controls included) on every rank.
    typical = sorted(requests, key=gen_tokens)[len(requests) // 2] if requests else None
    branches = most_branches(typical) if typical is not None else 1  # Transfer: up to 3
    gen_len = gen_tokens(typical) if typical else 0
    und = int(statistics.median(und_tokens.values())) if und_tokens else 0
    active = [(branches, und, gen_len)] * (max_active if typical else 0)
    # Requests prefilled ahead hold their UND K/V (no GEN stream yet) until a slot frees.
    ahead = [(branches, und, 0)] * (lookahead if typical else 0)
    kept, transient = activation_bytes(shape, active + ahead, max_batch_rows)
    activations = kept + transient
    h2d, gathered = _bytes_per_pass(gen_parts, mode, world_size)
    sequences = branches * max_active if typical else 0
    work = (sequences * (1 - reuse), gen_len, und)  # a reusing branch runs no layer
    pass_s = _seconds_per_pass(shape, gen_parts, mode, (world_size, nnodes), hw, work, sp)
    groups = world_size // sp
    skipped = skip_share(reuse, groups * max_active)
    pass_s *= 1 - skipped  # a pass no branch computes fetches nothing and costs next to nothing
    a2a = SpCost(activations, 0, 0.0)
    if sp > 1:  # a group of S holds K requests; each rank 1/S of their GEN rows, all of their UND K/V
        a2a = _sp_share(shape, sp, work, branches * (len(active) + len(ahead)), hw, spans_nodes(sp, per_node))
        # The group's own model of a rank's share (its transient per branch): kept whole below.
        activations, pass_s = a2a.activation_bytes, pass_s + a2a.all_to_all_s
        kept, transient = activations, 0
    host_private = {OffloadMode.ALLGATHER: shards}.get(mode, 0) + shape.host_resident_bytes
    und_resident = und_resident and mode is not OffloadMode.RESIDENT  # resident: every part is there already
    slots = _slot_bytes(shape, und_resident)
    breakdown = _device_breakdown(shape, mode, slots, (kept, transient), (world_size, sp), und_resident)
    breakdown["vae_decode"] = decode_bytes(shape, requests, vae_tiling, vae_parts)
    if cache_order is not None:
        breakdown["cache_residuals"] = cache_device_bytes(
            requests, max_active, cache_order, shape.hidden, shape.act_bytes
        )
    device = sum(breakdown.values())
    assignment = assignment if assignment is not None else assign(requests, groups)
    token_steps_per_s = (branches * max_active * gen_len / pass_s) if pass_s > 0 else 0.0
    busiest = max(assignment.costs, default=0.0)
    job_hours = busiest / token_steps_per_s / 3600 if token_steps_per_s else 0.0
    steps = typical.num_inference_steps if typical else 1
    outputs_per_hour = groups * max_active * 3600 / (steps * pass_s) if pass_s > 0 else 0.0
    est = Estimate(
        world_size, nnodes, mode.value, max_active, slot, slots, layer_bytes, host_private,
        layer_bytes if mode is OffloadMode.LOCAL else 0,
        device, activations, h2d, gathered, pass_s, outputs_per_hour, job_hours, assignment.idle_share, [],
        sp, a2a.all_to_all_bytes, a2a.all_to_all_s, breakdown, vae_tiling, vae_parts,
    )  # fmt: skip
    if not vae_tiling:  # the roofline of the decode, and the unsplit figures beside a group's
        est.decode_s = decode_seconds(shape, requests, vae_parts, hw.tflops, hw.gather_gbps)
        est.decode_s_unsplit = decode_seconds(shape, requests, 1, hw.tflops, hw.gather_gbps)
        est.decode_bytes_unsplit = decode_bytes(shape, requests, False)
    est.cache_reuse, est.skipped_share = reuse, skipped
    est.transfer_host_bytes_per_rank = transfer_host_bytes(requests, max_active, shape.act_bytes)
    est.warnings = _warnings(est, per_node, hw)
    return est


def _sp_share(shape: ModelShape, sp: int, work: tuple, held: int, hw: Hardware, cross_node: bool) -> SpCost:
    """A rank's share of an --sp group's work: its activations and the all-to-alls' bytes and time."""
    a2a_gbps = hw.inter_node_gbps if cross_node else hw.gather_gbps
    dims = dict(
        hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate=shape.intermediate,
    )  # fmt: skip
    return sp_cost(dims, sp, (*work, held), shape.layers, shape.act_bytes, a2a_gbps)


def _slot_bytes(shape: ModelShape, und_resident: bool) -> int:
    """The engine's fetch slots: 2 GEN and 1 UND, or with --und-resident the GEN slots alone (the engine
    streams only GEN parts then: pipeline/passes/weights.py)."""
    lanes = [GEN if p.key.endswith(GEN) else UND for p in shape.parts]
    if not und_resident:
        return sum(slot_sizes(shape.parts, lanes, dict(LANE_SLOTS)))
    gen = [p for p, lane in zip(shape.parts, lanes, strict=True) if lane == GEN]
    return sum(slot_sizes(gen, [GEN] * len(gen), dict(LANE_SLOTS)))


def und_half_bytes(shape: ModelShape) -> int:
    """Every layer's UND part as --und-resident places it on each rank's device: whole (not a shard), each
    tensor read alone (no slot padding)."""
    return sum(p.payload_bytes for p in shape.parts if not p.key.endswith(GEN))


def _device_breakdown(
    shape: ModelShape,
    mode: OffloadMode,
    slots: int,
    activations: tuple[int, int],
    world: tuple[int, int],
    und_resident: bool = False,
) -> dict[str, int]:
    """Device bytes per rank by what holds them (the VAE decode's added by the caller). `activations`: (kept,
    batched transient); `world`: (world size, --sp); `und_resident`: the UND half placed whole, its parts
    out of the engine (sharded keeps only the GEN parts' shards)."""
    engine_parts = [p for p in shape.parts if not (und_resident and not p.key.endswith(GEN))]
    layer_bytes = sum(p.nbytes for p in shape.parts)
    shards = sum(p.shard_bytes for p in engine_parts)
    und = {"und_resident": und_half_bytes(shape)} if und_resident else {}
    return {
        "slots": 0 if mode is OffloadMode.RESIDENT else slots,
        "layer_weights": {OffloadMode.RESIDENT: layer_bytes, OffloadMode.SHARDED: shards}.get(mode, 0),
        **und,
        "resident_weights": shape.device_resident_bytes + shape.vae_bytes,
        "activations": activations[0],
        "batched_transient": activations[1],
        "vae_decode": 0,
        "runtime_overhead": runtime_overhead_bytes(*world),
    }


def _bytes_per_pass(gen_parts: list[PartLayout], mode: OffloadMode, world: int) -> tuple[int, int]:
    shard = sum(p.shard_bytes for p in gen_parts)
    full = sum(p.nbytes for p in gen_parts)
    gathered = full - shard if world > 1 else 0
    return {
        OffloadMode.ALLGATHER: (shard, gathered),
        OffloadMode.LOCAL: (sum(p.payload_bytes for p in gen_parts), 0),
        OffloadMode.SHARDED: (0, gathered),
        OffloadMode.RESIDENT: (0, 0),
    }[mode]


def _seconds_per_pass(
    shape: ModelShape,
    gen_parts: list[PartLayout],
    mode: OffloadMode,
    job: tuple[int, int],
    hw: Hardware,
    work: tuple[int, int, int],
    sp: int = 1,
) -> float:
    """job = (world size, nodes); work = (sequences per rank, GEN tokens each, UND tokens each); under --sp
    each rank of a group computes 1/S of it (its rows for the token-wise ops, its heads in attention)."""
    (world, nnodes), (sequences, gen, und) = job, work
    gather_bw = hw.gather_gbps if nnodes == 1 else min(hw.gather_gbps, hw.inter_node_gbps)
    # Per sequence: QK^T and PV over UND+GEN keys, 2 FLOPs per multiply-add each.
    attn_flops = sequences * 4 * gen * (gen + und) * shape.heads * shape.head_dim
    total = 0.0
    for part in gen_parts:
        params = sum(p.spec.nbytes // p.spec.dtype.itemsize for p in part.params)  # FP8: 1 byte each
        flops_s = (2 * params * sequences * gen + attn_flops) / (hw.tflops * 1e12) / sp
        # Each linear reads its weights once and its input and output rows once from HBM: at few tokens
        # (images, small K) the pass is bound by that, not by the FLOPs.
        rows = sequences * gen / sp
        traffic = part.nbytes + rows * (12 * shape.hidden + 4 * shape.intermediate) * shape.act_bytes
        compute = max(flops_s, traffic / (hw.hbm_gbps * GB))
        h2d, gathered = _bytes_per_pass([part], mode, world)
        fetch = h2d / (hw.h2d_gbps * GB) + gathered / (gather_bw * GB)
        total += max(compute, fetch)
    return total


def _warnings(est: Estimate, per_node: int, hw: Hardware) -> list[str]:
    notes = []
    if est.device_bytes_per_rank > hw.device_gib * 2**30:
        decode = est.device_breakdown.get("vae_decode", 0)
        fix = (
            "lower --max-active or --max-batch-rows, or use --offload allgather "
            "(resident/sharded keep weights on the device)"
        )
        if not est.vae_tiling and decode > est.device_bytes_per_rank / 4:
            fix = (
                f"the VAE decode alone needs {decode / 2**30:.1f} GiB: --vae-patch-parallel-size splits it "
                f"over an --sp group (bit-exact), --vae-tiling decodes in tiles (not bit-exact), or {fix}"
            )
        total = est.device_bytes_per_rank / 2**30
        notes.append(f"device memory {total:.1f} GiB > --device-gib {hw.device_gib:g}: {fix}")
    host_rank = est.host_private_bytes_per_rank + est.transfer_host_bytes_per_rank
    host_node = host_rank * per_node + est.page_cache_bytes_per_node
    if host_node > hw.host_gib_per_node * 2**30:
        notes.append(
            f"host memory {host_node / 2**30:.1f} GiB per node > --host-gib {hw.host_gib_per_node:g}: "
            "use more nodes (--nnodes) so each rank keeps a smaller shard"
        )
    return notes


def idle_warning(idle_share: float) -> str | None:
    """Shown with or without --model: the schedule alone predicts it."""
    if idle_share > IDLE_WARN_SHARE:
        return f"predicted idle share {idle_share:.0%}: fewer ranks, or more requests per rank"
    return None


TOKEN_SAMPLE = 20_000  # requests tokenized at most: the estimate reads the median UND length only


def prompt_tokens(checkpoint: Checkpoint, requests: list[Request]) -> dict[str, int]:
    """Cond-branch UND length of the requests, templated exactly as generation will do it: each distinct
    templating once, and of a file with more than TOKEN_SAMPLE requests, an evenly spaced sample of that many
    (the median it feeds moves by a token or two; tokenizing a million prompts took minutes)."""
    from cosmos3_batch.model.prompts import build_helper, load_tokenizer, tokenize

    helper = build_helper(checkpoint, load_tokenizer(checkpoint))
    step = max(1, -(-len(requests) // TOKEN_SAMPLE))
    tokens, seen = {}, {}
    for r in requests[::step]:
        key = (r.prompt, r.action, r.num_frames, r.height, r.width, r.fps, r.system_prompt,
               r.use_resolution_template, r.use_duration_template)  # fmt: skip
        if key not in seen:
            seen[key] = len(tokenize(helper, r)[0])
        tokens[r.id] = seen[key]
    return tokens


def simulate_job(
    queues: list[list[Request]],
    max_active: int,
    rule: PrefillRule,
    shape: ModelShape | None,
    mode: OffloadMode,
    world: int,
    und_resident: bool = False,
    max_reason_active: int | None = None,
) -> Simulation:
    """The pass simulator on this job's schedule, with the engine's part sizes when the model is known
    (`und_resident`: --und-resident, the UND parts on the device move nothing; `max_reason_active`: the
    reasoner slots per rank, None: as many as `max_active`)."""
    parts = PartBytes()
    if shape is not None:
        gen = [p for p in shape.parts if p.key.endswith(GEN)]
        und = [p for p in shape.parts if not p.key.endswith(GEN)]
        und_bytes = 0 if und_resident else sum(_bytes_per_pass(und, mode, world))
        parts = PartBytes(sum(_bytes_per_pass(gen, mode, world)), und_bytes)
    sim_queues = [[s for r in queue for s in sim_requests(r, rule.chunk_gap)] for queue in queues]
    per_queue = world // max(len(queues), 1)
    return simulate(sim_queues, max_active, rule, parts, True, per_queue, max_reason_active)
