"""A request's scheduler steps without a host-device synchronization (DESIGN.md §5: never a sync in the
steady state): the GPU runs the next pass's layers while the host schedules, only if no step waits for it.

diffusers' UniPC step (0.42), run as the reference runs it, synchronizes three ways on a GPU:
- `set_timesteps` keeps `sigmas` on the CPU, and every step reads two to four of them with `.to(device)`:
  each a copy from pageable memory, which waits for the device. `prepare` moves them once per request.
- The first step finds its index by searching the timesteps (`nonzero` + `.item()`); a fresh schedule
  starts at index 0, which `prepare` says (`set_begin_index(0)`, the value the search returns).
- The corrector's `torch.linalg.solve` checks for a singular matrix on the host (`_linalg_check_errors`).
  `step` skips that check on devices (never on the CPU): the solution is the same tensor, and R is a
  Vandermonde matrix of distinct log-SNR ratios, never singular.
Nothing else is left: at order 1 (a request's first corrector step, and its last with `lower_order_final`)
diffusers 0.42.1 builds the corrector's 0.5 on the device (`torch.ones(1, device=...) * 0.5`), no copy.
`tests/unit/test_sync_free.py` counts every wait on the meta device (none, order-1 steps included) and
checks the steps bit for bit against the reference scheduler on the CPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def prepare(scheduler, device: torch.device):
    """After `set_timesteps`: the schedule's sigmas on the device and the first index given, not searched."""
    scheduler.sigmas = scheduler.sigmas.to(device)
    scheduler.set_begin_index(0)
    return scheduler


class _NoErrorChecks(TorchDispatchMode):
    """Skips `torch.linalg`'s host-side singularity check; every other op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._linalg_check_errors.default:
            return None
        return func(*args, **(kwargs or {}))


def step(scheduler, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """`scheduler.step(...)[0]`, with nothing in it waiting for the device."""
    checks = contextlib.nullcontext() if sample.device.type == "cpu" else _NoErrorChecks()
    with checks:
        return scheduler.step(model_output, timestep, sample, return_dict=False)[0]
