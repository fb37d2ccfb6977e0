"""Which forwards a request runs at each denoising step: the one place the engine, `plan` and the tests ask.

- T2I/T2V/I2V/V2V, sound, actions: cond, plus uncond when `guidance_scale != 1` (the same every step).
- Transfer (DESIGN.md §17, `Cosmos3TransferLoopDenoiser`): cond over [controls..., target] always; cond over
  [target] alone while control guidance is active and not 1; uncond over [controls..., target] while text
  guidance is active and above 1. A guidance interval `[lo, hi]` (timesteps, inclusive) switches its axis;
  outside it the scale is 1, which turns the branch off.

Branch names are the reference's cache-context names. Torch-free: the simulator counts with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cosmos3_batch.plan.simulator import SimRequest

COND, UNCOND = "cond", "uncond"
COND_NO_CONTROL = "cond_no_control"  # Transfer: the target without its controls (the control axis)


@dataclass(frozen=True, slots=True)
class StepBranches:
    """One step's forwards and the scales that combine them."""

    names: tuple[str, ...]  # in the reference's forward order
    text_scale: float  # guidance_scale inside its interval, else 1.0
    control_scale: float  # control_guidance inside its interval, else 1.0 (Transfer only)

    @property
    def count(self) -> int:
        return len(self.names)


def _active(interval: tuple[float, float] | None, t: float) -> bool:
    return interval is None or float(interval[0]) <= float(t) <= float(interval[1])


def transfer_step(
    t: float,
    guidance_scale: float,
    control_guidance: float,
    guidance_interval: tuple[float, float] | None,
    control_interval: tuple[float, float] | None,
) -> StepBranches:
    """The Transfer forwards at timestep `t`, decided exactly as Cosmos3TransferLoopDenoiser decides."""
    text = guidance_scale if _active(guidance_interval, t) else 1.0
    control = control_guidance if _active(control_interval, t) else 1.0
    names = [COND]
    if control != 1.0:
        names.append(COND_NO_CONTROL)
    if text > 1.0:
        names.append(UNCOND)
    return StepBranches(tuple(names), text, control)


def cfg_step(guidance_scale: float) -> StepBranches:
    names = (COND, UNCOND) if guidance_scale != 1.0 else (COND,)
    return StepBranches(names, guidance_scale, 1.0)


def transfer_plan(
    timesteps: Sequence[float],
    guidance_scale: float,
    control_guidance: float,
    guidance_interval: tuple[float, float] | None,
    control_interval: tuple[float, float] | None,
) -> list[StepBranches]:
    return [
        transfer_step(t, guidance_scale, control_guidance, guidance_interval, control_interval)
        for t in timesteps
    ]


def texts_needed(plan: Sequence[StepBranches]) -> tuple[str, ...]:
    """The prompt texts whose UND K/V some step reads: cond (and its no-control twin) share one prefill."""
    return (COND, UNCOND) if any(UNCOND in step.names for step in plan) else (COND,)


def steps_and_texts(request) -> tuple[int, int]:
    """(passes a request rides, UND prefills it needs) for the simulator: a Transfer chain rides its steps
    once per chunk and prefills its texts once (the chain keeps them); uncond's text is counted whenever
    text guidance is above 1 (an interval that no timestep falls in is not seen here)."""
    if getattr(request, "reason", None) is not None:  # one token a pass; one sequence through the UND half
        return request.reason.max_new_tokens, 1
    texts = 2 if request.guidance_scale > 1.0 else 1
    if request.transfer is None:
        return request.num_inference_steps, 1 if request.guidance_scale == 1.0 else 2
    return request.num_inference_steps * request.transfer.num_chunks, texts


def sim_request(request, chunk_gap: int, decisions: str = "") -> SimRequest:
    """The simulator's stand-in for a request. A Transfer chain holds its slot from its first step to its
    last: its chunks' steps, and `chunk_gap` passes between chunks on which it computes nothing (replayed
    as reusing steps, "R": a pass on which nothing anywhere computes walks no layer, as in the runner).
    `decisions`: a --cache sea run's, one letter per step over every chunk (plan/cache.step_decisions of
    its sidecar's `cache.decisions`), the gaps not in it."""
    steps, texts = steps_and_texts(request)
    assert not decisions or len(decisions) == steps, (request.id, decisions)
    transfer = request.transfer
    if getattr(request, "reason", None) is not None:
        return SimRequest(request.id, steps, texts, decodes=True)
    if transfer is None or transfer.num_chunks == 1 or chunk_gap == 0:
        return SimRequest(request.id, steps, texts, decisions)
    per = request.num_inference_steps
    chunks = [decisions[k * per : (k + 1) * per] or "C" * per for k in range(transfer.num_chunks)]
    joined = ("R" * chunk_gap).join(chunks)
    return SimRequest(request.id, len(joined), texts, joined)


def chain_tokens(request) -> tuple[int, int]:
    """(tokens planned for its upsampling, for its captions and score): each stage's max_new_tokens."""
    upsample = getattr(request, "upsample", None)
    captions = getattr(request, "captions", None)
    up = upsample.max_new_tokens if upsample is not None else 0
    return up, captions.max_new_tokens * len(captions.tasks()) if captions is not None else 0


def sim_requests(request, chunk_gap: int) -> list[SimRequest]:
    """The stand-ins of a request and of the reasoner stages chained to it (DESIGN.md §22), in the order the
    rank runs them: its upsampling decode, its generation, its captions' decodes. Replayed as requests queued
    one after another on its rank, where the runner puts the generation at the head of the queue and a
    caption in the generation's own slot: the passes planned for a chained job are close to the run's, not
    equal (the tokens, and so the UND bytes per token, are the same planned bounds)."""
    up, after = chain_tokens(request)
    # Its upsampling is admitted as the generation request queued: GEN parts on that pass (runner.py).
    upsampling = SimRequest(f"{request.id}:upsample", up, 1, decodes=True, gen_at_admission=True)
    stand_ins = [upsampling] if up else []
    stand_ins.append(sim_request(request, chunk_gap))
    captions = SimRequest(f"{request.id}:captions", after, 1, decodes=True, chained=True)  # in its slot
    return stand_ins + ([captions] if after else [])


def transfer_work(requests) -> dict | None:
    """A job's Transfer chains, counted as the runner does them (None without any): chunks, and the VAE calls
    between them, each chunk decoded once and encoded once per control and once for its target."""
    chains = [r for r in requests if getattr(r, "transfer", None) is not None]
    if not chains:
        return None
    chunks = sum(r.transfer.num_chunks for r in chains)
    encodes = sum(r.transfer.num_chunks * (len(r.transfer.controls) + 1) for r in chains)
    return {"requests": len(chains), "chunks": chunks, "vae_decodes": chunks, "vae_encodes": encodes}


def most_branches(request) -> int:
    """The most GEN forwards a step of this request runs: what plan sizes a pass by (an interval may turn a
    Transfer axis off on some steps; the memory a step needs is its largest)."""
    transfer = getattr(request, "transfer", None)
    if transfer is None:
        return 1 if request.guidance_scale == 1.0 else 2
    return 1 + (transfer.control_guidance != 1.0) + (request.guidance_scale > 1.0)
