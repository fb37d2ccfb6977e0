"""SeaCache's gate for one branch, split in two halves so a rank reads all its distances in one go.

diffusers decides inside `SeaCacheSharedState.resolve_gate` and `SeaCacheRootHook.prepare_decoder_stack`
(hooks/sea_cache.py, pinned 0.42), reading each branch's distance with its own `float(... .cpu())`: one
device-to-host read per forward. Here the decision is the same code path cut at that read:

1. `needs_distance` (host only, no state change): is the step forced to compute (retention, cache end,
   first observation, non-adjacent steps, the consecutive cap), or must the indicator distance decide?
2. the caller computes every distance a rank needs as device tensors and reads them all at once;
3. `resolve` replays resolve_gate with that distance, then `reuse_or_compute` the stack boundary's rule
   (a hit without residual history computes).

The state is diffusers' own `SeaCacheContextState` (history, gate key, previous indicator, accumulated
distance, consecutive count), so the fields mean what they mean there. tests/unit/test_sea_cache.py replays
random indicator sequences through diffusers' resolve_gate and through this, and pins the sources mirrored.
"""

from __future__ import annotations

import math

import torch
from diffusers.hooks.sea_cache import SeaCacheConfig, SeaCacheContextState


def metadata_valid(step: int, sigma: float, steps: int) -> bool:
    """SeaCacheRootHook.pre_forward's check: outside it the forward runs full and the state is untouched."""
    return 0 <= step < steps and steps > 0 and math.isfinite(sigma) and 0.0 <= sigma <= 1.0


def _non_adjacent(state: SeaCacheContextState, step: int) -> bool:
    return state.gate_key is not None and step != state.gate_key[0] + 1


def _at_cap(state: SeaCacheContextState, config: SeaCacheConfig) -> bool:
    return bool(config.max_consecutive_cached and state.consecutive_cached >= config.max_consecutive_cached)


def needs_distance(
    state: SeaCacheContextState, step: int, steps: int, has_indicator: bool, config: SeaCacheConfig
) -> bool:
    """Whether resolve_gate would read the indicator distance at this step (it is not forced to compute)."""
    if _non_adjacent(state, step) or not has_indicator:
        return False  # a non-adjacent step resets the trajectory: the next is a first observation
    retained = step < config.retention_steps
    in_cache_end = step >= steps - config.cache_end_steps
    first = state.previous_indicator is None
    return not (retained or in_cache_end or first or _at_cap(state, config))


def distance_of(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """resolve_gate's relative L1 of one indicator pair, as a device scalar (float32, not read yet)."""
    numerator = (current.float() - previous.float()).abs().mean()
    denominator = previous.float().abs().mean() + 1e-16
    return (numerator / denominator).detach()


def resolve(
    state: SeaCacheContextState,
    step: int,
    sigma: float,
    steps: int,
    indicator: torch.Tensor | None,
    distances: list[float] | None,
    config: SeaCacheConfig,
) -> bool:
    """resolve_gate, given the distances (one per indicator tensor) it would have read itself."""
    gate_key = (step, sigma)
    if state.gate_key == gate_key:
        return state.gate_should_compute
    non_adjacent = _non_adjacent(state, step)
    if non_adjacent:
        state.reset_trajectory()
    is_max_consecutive = _at_cap(state, config)
    forced = (
        non_adjacent
        or indicator is None
        or step < config.retention_steps
        or step >= steps - config.cache_end_steps
        or state.previous_indicator is None
        or is_max_consecutive
    )
    candidate = 0.0
    if forced:
        should_compute = True
    else:
        assert distances, "a gate that reads its distance was given none"
        distance = 0.0
        for value in distances:  # the same float additions, in the same order, as resolve_gate
            distance += value
        distance /= len(distances)
        candidate = state.accumulated_distance + distance
        should_compute = not math.isfinite(distance) or candidate >= config.threshold
    should_compute = should_compute or is_max_consecutive
    state.accumulated_distance = 0.0 if should_compute else candidate
    state.gate_key = gate_key
    state.gate_should_compute = should_compute
    state.previous_indicator = None if indicator is None else [indicator]
    return should_compute


def reuse_or_compute(state: SeaCacheContextState, gate_should_compute: bool) -> bool:
    """prepare_decoder_stack after the gate: a hit without residual history computes (and forgets the
    distance it accumulated). True: compute; False: reuse (the consecutive count grows)."""
    if gate_should_compute:
        return True
    if not state.history:
        state.accumulated_distance = 0.0
        state.gate_should_compute = True
        return True
    state.consecutive_cached += 1
    return False


def cached_residual(state: SeaCacheContextState, step: int, config: SeaCacheConfig) -> torch.Tensor:
    """The residual a reusing step adds to its stack input: the last one, or (order 1) extrapolated."""
    history = state.history[-(config.residual_order + 1) :]
    _, _, residual = history[-1]
    if config.residual_order == 1 and len(history) >= 2:
        previous_step, _, previous_residual = history[-2]
        latest_step, _, latest_residual = history[-1]
        if latest_step != previous_step:
            step_scale = (step - latest_step) / (latest_step - previous_step)
            residual = latest_residual + (latest_residual - previous_residual) * step_scale
    return residual


def record(state: SeaCacheContextState, step: int, residual: torch.Tensor, config: SeaCacheConfig) -> None:
    """_record_full_execution after a computed stack: the residual joins the history; the cap restarts."""
    state.consecutive_cached = 0
    state.history.append((step, None, residual.detach()))  # a fresh tensor: no clone needed
    state.history = state.history[-(config.residual_order + 1) :]
