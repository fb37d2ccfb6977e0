"""`--cache sea` for one request (DESIGN.md §19): each step, per branch, run the decoder stack or reuse.

diffusers' SeaCache hooks Cosmos3's `_run_decoder_stack`: its input is the embedded GEN stream, its output
the stream after the final GEN norm. A full step records `output - input` (the residual); a reusing step
returns `input + residual` (extrapolated at order 1) without running a layer. Here the same boundary: the
stack input is `inputs[name]` (the embedded stream of the step: cond and uncond share one, Transfer's
cond_no_control has its own, over the target alone), the output the branch's `final_norm`; the head reads
either.

The gate reads the raw vision latents before any layer runs, so the runner evaluates every active
request's gates before the pass's exchange (`gate_rank`), and a branch that reuses takes no part in the
layer walk. The indicator is diffusers' own (`_build_indicator`: the SEA spectral filter over the latents
the transformer would be given); the decision is diffusers' resolve_gate (pipeline/kinds/step_cache/gate.py).

Per branch means per cache-context name, as the reference enters them: `Cosmos3OmniPipeline` "cond" and
"uncond" every step; the modular Transfer loop "cond", "cond_no_control" and "uncond", each only on the
steps its guidance interval turns it on (a branch off at a step leaves its state untouched, and is "-" in
its decision string), and every context reset at each chunk after the first (`_reset_stateful_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from diffusers.hooks.sea_cache import (
    SeaCacheContextState,
    _build_indicator,
    _prepare_cosmos3_raw_vision_metadata,
    _SeaCacheForwardMetadata,
)

from cosmos3_batch.pipeline.kinds.step_cache import gate as sea_gate
from cosmos3_batch.pipeline.kinds.step_cache.indicator import device_indicator

if TYPE_CHECKING:
    from cosmos3_batch.model.cosmos3 import BranchSeq
    from cosmos3_batch.plan.cache import SeaSettings


class RequestJob(Protocol):
    """What the cache reads of pipeline/kinds/denoise.py's RequestJob and transfer/chain.py's TransferJob
    (which import this module): `GateView`'s names below."""

    ctx: Any
    latents: torch.Tensor
    step_index: int
    timesteps: torch.Tensor
    scheduler: Any
    chunk_id: int
    modular: bool
    cache_names: tuple[str, ...]

    def gen_branches(self) -> list[BranchSeq]: ...

    def step_names(self) -> tuple[str, ...]: ...

    def gate_vision(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...

    cache: StepCache | None


BRANCH_NAMES = ("cond", "uncond")  # the reference's cache_context names, in job.branches order
COMPUTED, REUSED, OFF = "C", "R", "-"  # one letter per step in a branch's decision string (OFF: not run)


class GateView:
    """What the gate asks of a job, answered for a one-segment job (RequestJob's base): its branches are cond
    and uncond (under CFG) on every step, the reference `Cosmos3OmniPipeline` (its step count len(timesteps)),
    its gate reads the request's own latents. TransferJob answers for its chain."""

    chunk_id = 0  # the segment the steps belong to: a modular Transfer reference resets its cache at each
    modular = False  # a modular pipeline's reference passes scheduler.num_inference_steps as the step count

    @property
    def cache_names(self) -> tuple[str, ...]:
        """Every GEN branch's cache-context name in the reference, in `gen_branches` order."""
        return BRANCH_NAMES[: len(self.branches)]

    def step_names(self) -> tuple[str, ...]:
        """The names of this step's GEN branches, in `gen_branches` order."""
        return self.cache_names

    def gate_vision(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The vision items and their noisy frame indexes as the reference hands them to the transformer."""
        return [self.latents], self.layout.noisy_frame_indexes


class StepCache:
    """One request's SeaCache state: per branch diffusers' context state and its decisions so far."""

    def __init__(self, settings: SeaSettings, job: RequestJob, distilled: bool):
        self.config = settings.diffusers_config()
        self.modular = distilled or job.modular
        self.names = tuple(job.cache_names)
        self.decisions = ["" for _ in self.names]
        self.computes = [True for _ in self.names]  # this step's decision per branch (True when not run)
        self.inputs: dict[str, torch.Tensor] = {}  # the step's stack input per branch (whole under --sp)
        self.gated_step = -1  # the step whose decisions `computes` holds
        self._indicator: torch.Tensor | None = None
        self._asks: list[int] = []  # branches waiting for their distance this step
        self._running: list[int] = []  # the branches this step runs, by index in `names`
        self._start(job)

    def _start(self, job: RequestJob) -> None:
        """A segment's fresh states (diffusers' SeaCacheContextState per name): at admission, and at each
        chunk of a Transfer chain after the first, where the reference calls `_reset_stateful_cache`."""
        scheduler = job.scheduler
        # The step count and sigma each reference passes to cache_context: Cosmos3OmniPipeline
        # len(timesteps), a modular pipeline (distilled, Transfer) scheduler.num_inference_steps; both
        # float(scheduler.sigmas[i]) (kept on the host by the scheduler: no device read).
        self.steps = int(scheduler.num_inference_steps) if self.modular else len(job.timesteps)
        self.sigmas = [float(s) for s in scheduler.sigmas.tolist()]
        self.states = [SeaCacheContextState() for _ in self.names]
        self.chunk = job.chunk_id
        self.uses_vision = _selects_vision(job)

    # ---- the gate, in two halves around the rank's one read --------------------------------------

    def begin_gate(self, job: RequestJob) -> list[torch.Tensor]:
        """The distances this step's gates need, as device scalars (none when every branch is forced)."""
        step = job.step_index
        self.gated_step, self._asks, self._indicator = step, [], None
        self._running = [self.names.index(name) for name in job.step_names()]
        if not self._running:  # no step of this job on this pass (a chain at a chunk boundary)
            self._open = True
            return []
        if job.chunk_id != self.chunk:
            self._start(job)
        sigma = self.sigmas[step]
        self._open = not (self.uses_vision and sea_gate.metadata_valid(step, sigma, self.steps))
        if self._open:  # diffusers runs such a forward full and leaves the state as it was
            return []
        self._indicator = self._build(job, step, sigma)
        asks = []
        for index in self._running:
            state = self.states[index]
            if sea_gate.needs_distance(state, step, self.steps, self._indicator is not None, self.config):
                self._asks.append(index)
                asks.append(sea_gate.distance_of(self._indicator, state.previous_indicator[0]))
        return asks

    def end_gate(self, step: int, distances: list[float]) -> None:
        """Resolve this step's gates with the distances `begin_gate` asked for, in its order."""
        assert step == self.gated_step and len(distances) == len(self._asks)
        given = dict(zip(self._asks, distances, strict=True))
        self.computes = [True for _ in self.names]
        if self._running:  # a step of this job: a branch off at it (its interval) is not entered there
            for index in range(len(self.names)):
                self.decisions[index] += "" if index in self._running else OFF
        for index in [] if self._open else self._running:
            state = self.states[index]
            value = given.get(index)
            gate = sea_gate.resolve(
                state,
                step,
                self.sigmas[step],
                self.steps,
                self._indicator,
                None if value is None else [value],
                self.config,
            )
            self.computes[index] = sea_gate.reuse_or_compute(state, gate)
        self._indicator = None

    def _build(self, job: RequestJob, step: int, sigma: float) -> torch.Tensor | None:
        """The SEA indicator of the latents the transformer would be given at this step (vision_tokens)."""
        split = job.ctx.split
        raw = job.latents.to(device=job.ctx.device, dtype=split.dtype).squeeze(0)
        metadata = _SeaCacheForwardMetadata(step, sigma, self.steps, raw_vision=[raw])
        try:
            if raw.device.type == "cpu":
                return _build_indicator(self.config, metadata)[0]
            return device_indicator(raw, sigma, self.config.power_exp)  # its one host read removed
        except (TypeError, ValueError, RuntimeError):
            return None  # diffusers fails open: the gate is forced to compute

    # ---- after the gate ---------------------------------------------------------------------------

    def output(self, index: int, step: int, normed: torch.Tensor | None) -> torch.Tensor:
        """The branch's stack output: `normed` recorded when it computed, else the reused residual added."""
        state, stack_input = self.states[index], self.inputs[self.names[index]]
        if self.computes[index]:
            assert normed is not None
            if not self._open:
                sea_gate.record(state, step, normed - stack_input, self.config)
            self.decisions[index] += COMPUTED
            return normed
        self.decisions[index] += REUSED
        return stack_input + sea_gate.cached_residual(state, step, self.config)

    def counts(self) -> dict[str, dict[str, int]]:
        """Forwards computed and reused per branch so far (sidecar, metrics, manifest)."""
        return {
            name: {"computed": d.count(COMPUTED), "reused": d.count(REUSED)}
            for name, d in zip(self.names, self.decisions, strict=True)
        }


def _selects_vision(job: RequestJob) -> bool:
    """Whether diffusers' Cosmos3 adapter hands the gate any latents: only a request with noisy vision
    frames does (inverse dynamics, all frames given, runs full at every step). Asked once per segment, on the
    host: the adapter reads only the items' shapes, so each is given as a CPU stand-in of its shape (no copy),
    and the frame indexes (a few integers) are read. Of a Transfer chain's items it keeps the target alone
    (its controls are all clean frames), the latents the indicator is built from (`_build`)."""
    items, indexes = job.gate_vision()
    stand_ins = [torch.zeros(()).expand(item.shape) for item in items]
    kwargs = {"vision_tokens": stand_ins, "vision_noisy_frame_indexes": [idx.cpu() for idx in indexes]}
    selected = _prepare_cosmos3_raw_vision_metadata(job.ctx.split.transformer, (), kwargs)
    if selected is not None and len(selected) != 1:
        raise RuntimeError(f"the step cache gates on one latent; the reference would read {len(selected)}")
    return selected is not None


def gate_rank(jobs: list[RequestJob], share: Callable[[list[float]], list[float]] | None = None) -> int:
    """Resolve every job's gates for its current step; the branches that will compute, summed.

    Sync point: the rank's one device-to-host read per pass, all of its gates' distances in one `.tolist()`
    (diffusers reads each branch's with its own `float(...)`). Nothing is read on CPU, or when every gate is
    forced (the first and last steps, a capped run of reuses). `share` (an `--sp` group's `share_lead`,
    called on every member every time): every member resolves its gates with its lead's distances, so the
    group's decisions, and so its collectives, are the same on every member."""
    pending = [(job, job.cache.begin_gate(job)) for job in jobs if job.cache is not None]
    asked = [tensor for _, asks in pending for tensor in asks]
    values = torch.stack(asked).tolist() if asked else []
    if share is not None:
        lead = share(values)
        if len(lead) != len(values):
            raise RuntimeError(
                f"--sp group: the lead's gates asked {len(lead)} distances, this rank's {len(values)}"
            )
        values = lead
    at = 0
    for job, asks in pending:
        job.cache.end_gate(job.step_index, values[at : at + len(asks)])
        at += len(asks)
    return sum(len(computing(job)) for job in jobs)


def computing(job: RequestJob) -> list[BranchSeq]:
    """The branches of a job that run the decoder stack at this step: the one place that answers it."""
    branches = job.gen_branches()
    cache = job.cache
    if cache is None:
        return list(branches)
    names = job.step_names()
    return [b for b, name in zip(branches, names, strict=True) if cache.computes[cache.names.index(name)]]


def stack_output(job: RequestJob, at: int, branch: BranchSeq) -> torch.Tensor:
    """The GEN stream after the decoder stack and the final norm of this step's branch `at` (in
    `gen_branches` order), as the heads read it: run (gathered first under --sp: the heads read rows by
    their index in the whole stream), or reused."""
    cache = job.cache
    index = None if cache is None else cache.names.index(job.step_names()[at])
    if cache is not None and not cache.computes[index]:
        branch.gen_hidden = None  # a reusing branch ran no layer: no gather (its whole group reuses alike)
        return cache.output(index, job.step_index, None)
    if branch.shard is not None:
        branch.gen_hidden = branch.shard.gather(branch.gen_hidden)
    normed = job.ctx.split.final_norm(branch)
    return normed if cache is None else cache.output(index, job.step_index, normed)


def forward_counts(cache: StepCache | None) -> dict[str, int | None]:
    """The metrics row's two columns: forwards that ran the layers and that reused, over all branches."""
    if cache is None:
        return {"forwards_computed": None, "forwards_reused": None}
    counts = cache.counts().values()
    return {
        "forwards_computed": sum(c["computed"] for c in counts),
        "forwards_reused": sum(c["reused"] for c in counts),
    }


def cache_report(settings: SeaSettings, cache: StepCache) -> dict:
    """The sidecar's `cache`: the settings (what SeaCacheConfig a comparison run takes), the forwards per
    branch, and each branch's decisions by step ("C" computed, "R" reused), as the reference made them."""
    return {
        **settings.record(),
        "forwards": cache.counts(),
        "decisions": dict(zip(cache.names, cache.decisions, strict=True)),
    }


def tally(jobs: list[RequestJob]) -> list[int]:
    """[branch forwards that ran the layers, that reused] for this pass's jobs still without error."""
    ran = reused = 0
    for job in jobs:
        if getattr(job, "error", None) is None:
            computed = len(computing(job))
            ran, reused = ran + computed, reused + len(job.gen_branches()) - computed
    return [ran, reused]
