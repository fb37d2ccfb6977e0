"""The scheduler steps wait for nothing on a device (kinds/sync_free.py), and equal the reference's bits.

On the meta device every op runs without data, so an op that would make the host wait for a GPU shows
itself: a copy from the CPU, a scalar read (`.item()`), a data-dependent shape (`nonzero`), linalg's host
check. Counted over every step of a schedule: 0 with `prepare` + `step`, and the reference's own way of
calling the scheduler is counted too, so the count can fail."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from diffusers import UniPCMultistepScheduler
from torch.utils._python_dispatch import TorchDispatchMode

from cosmos3_batch.pipeline.kinds import sync_free

WAITS = ("aten._local_scalar_dense", "aten.nonzero", "aten._linalg_check_errors")


class Waits(TorchDispatchMode):
    """Counts the ops that would make the host wait for the device."""

    def __init__(self, non_blocking_ok: bool = False) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()
        # A non-blocking copy waits for nothing when its source is pinned, which the code under test pins on a
        # GPU (the meta device has no pinned memory to show it).
        self.non_blocking_ok = non_blocking_ok

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func).rsplit(".", 1)[0]
        if name == "aten._to_copy":  # (src, device=...)
            source, target = args[0].device, kwargs.get("device") or args[0].device
        elif name == "aten.copy_":  # (dst, src)
            source, target = args[1].device, args[0].device
        else:
            source = target = None
        blocking = not (self.non_blocking_ok and kwargs.get("non_blocking", False))
        if source is not None and source.type == "cpu" and target.type != "cpu" and blocking:
            self.seen["copy from the host"] += 1
        if name in WAITS:
            self.seen[name] += 1
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def config(tiny_ckpt) -> dict:
    return json.loads((tiny_ckpt / "scheduler" / "scheduler_config.json").read_text())


@pytest.mark.parametrize("steps", [2, 6])
def test_no_step_waits_for_the_device(config, steps):
    scheduler = UniPCMultistepScheduler.from_config(config)
    scheduler.set_timesteps(steps, device="meta")
    sync_free.prepare(scheduler, torch.device("meta"))
    x = torch.empty(1, 16, 3, 4, 4, device="meta")
    with Waits() as waits:
        for t in scheduler.timesteps:
            x = sync_free.step(scheduler, torch.empty_like(x), t, x)
    assert waits.seen == {}, waits.seen


def test_the_reference_way_waits(config):
    """What `prepare` removes: sigmas read from the CPU every step (and, unprepared, the index search)."""
    scheduler = UniPCMultistepScheduler.from_config(config)
    scheduler.set_timesteps(6, device="meta")
    scheduler.set_begin_index(0)  # else the first step's nonzero cannot even run on meta
    x = torch.empty(1, 16, 3, 4, 4, device="meta")
    with Waits() as waits:
        for t in scheduler.timesteps:
            x = scheduler.step(torch.empty_like(x), t, x, return_dict=False)[0]
    assert waits.seen["copy from the host"] >= 2 * 6 and waits.seen["aten._linalg_check_errors"] > 0


@pytest.mark.parametrize("shift", [None, 2.0])
def test_prepared_steps_equal_the_reference_bit_for_bit(config, shift):
    overrides = {} if shift is None else {"flow_shift": shift}
    ours, ref = (UniPCMultistepScheduler.from_config(config, **overrides) for _ in range(2))
    for scheduler in (ours, ref):
        scheduler.set_timesteps(7, device="cpu")
    sync_free.prepare(ours, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    x = y = torch.randn(1, 16, 3, 4, 4, generator=g)
    for t_ours, t_ref in zip(ours.timesteps, ref.timesteps, strict=True):
        velocity = torch.randn(x.shape, generator=g)
        x = sync_free.step(ours, velocity, t_ours, x)
        y = ref.step(velocity, t_ref, y, return_dict=False)[0]
        assert torch.equal(x, y)
