"""The distilled sampler (kinds/samplers.py): diffusers' stochastic Euler step bit for bit, its noise drawn
from the request's generator in the reference's order, the conditioned frames re-anchored, and no step that
waits for the device (counted on the meta device, as tests/unit/test_sync_free.py counts UniPC's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from cosmos3_batch.model.tiny_kinds import TINY_DISTILLED_SIGMAS, distilled_scheduler_config
from cosmos3_batch.pipeline.kinds.samplers import DistilledSampler, step_noise
from tests.unit.test_sync_free import Waits

SHAPE = (1, 16, 3, 4, 4)  # [1, C, T, H, W]: a request's latents


def sampler(device: str, latents: torch.Tensor, mask: torch.Tensor, conditioned: bool, seed: int = 5):
    ctx = SimpleNamespace(scheduler_config=distilled_scheduler_config(), device=torch.device(device))
    generator = torch.Generator("cpu").manual_seed(seed)
    return DistilledSampler(ctx, TINY_DISTILLED_SIGMAS, generator, latents, mask, conditioned)


@pytest.mark.parametrize("conditioned", [False, True])
def test_steps_equal_flow_match_euler_with_the_requests_generator(conditioned):
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(SHAPE, generator=gen)
    mask = torch.zeros(3, 1, 1)
    mask[0] = float(conditioned)
    velocities = [torch.randn(SHAPE, generator=gen) for _ in TINY_DISTILLED_SIGMAS]
    ours = sampler("cpu", latents, mask, conditioned)
    reference = FlowMatchEulerDiscreteScheduler(**distilled_scheduler_config())
    reference.set_timesteps(sigmas=TINY_DISTILLED_SIGMAS, device="cpu")
    generator = torch.Generator("cpu").manual_seed(5)
    x, y = latents, latents
    for i, t in enumerate(reference.timesteps):
        x = ours.step(velocities[i], t, x, i)
        y = reference.step(
            velocities[i].unsqueeze(0), t, y.unsqueeze(0), generator=generator, return_dict=False
        )
        y = y[0].squeeze(0)
        if conditioned:  # Cosmos3DistilledVisionLoopSchedulerStep's re-anchoring
            y = mask * latents + (1.0 - mask) * y
        assert torch.equal(x, y), i
    assert torch.equal(x[:, :, 0], latents[:, :, 0]) == conditioned  # the conditioned frame stays clean


def test_no_distilled_step_waits_for_the_device():
    """The noise comes from memory drawn at prepare (pinned on a GPU: a non-blocking copy), the sigmas live on
    the device, the step index is given: nothing in a step makes the host wait."""
    latents = torch.empty(SHAPE, device="meta")
    ours = sampler("meta", latents, torch.empty(3, 1, 1, device="meta"), conditioned=True)
    with Waits(non_blocking_ok=True) as waits:
        x = latents
        for i, t in enumerate(ours.scheduler.timesteps):
            x = ours.step(torch.empty_like(x), t, x, i)
    assert waits.seen == {}, waits.seen


def test_the_references_step_on_a_device_waits():
    """What drawing at prepare removes: diffusers draws each step's noise on the CPU and copies it over."""
    reference = FlowMatchEulerDiscreteScheduler(**distilled_scheduler_config())
    reference.set_timesteps(sigmas=TINY_DISTILLED_SIGMAS, device="meta")
    reference.set_begin_index(0)
    x = torch.empty(SHAPE, device="meta")
    generator = torch.Generator("cpu").manual_seed(5)
    with Waits(non_blocking_ok=True) as waits:
        for t in reference.timesteps:
            x = reference.step(torch.empty_like(x), t, x, generator=generator, return_dict=False)[0]
    assert waits.seen["copy from the host"] == len(TINY_DISTILLED_SIGMAS)


class RecordingCudart:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, nbytes, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


@pytest.mark.parametrize("pin", [False, True])
def test_the_step_noise_is_one_buffer_of_the_per_step_draws_pinned_at_its_size(pin):
    shape, steps = (1, 16, 3, 5, 7), 4
    drawn = torch.Generator().manual_seed(11)
    expected = torch.stack([torch.randn(shape, generator=drawn, dtype=torch.float32) for _ in range(steps)])
    cudart = RecordingCudart()
    noise, region = step_noise(steps, shape, torch.Generator().manual_seed(11), pin, cudart)
    assert torch.equal(noise, expected) and noise.is_contiguous()
    if not pin:
        assert region is None and cudart.calls == []
        return
    assert cudart.calls == [("register", noise.data_ptr(), steps * 16 * 3 * 5 * 7 * 4, 0)]
    region.close()
    assert cudart.calls[-1] == ("unregister", noise.data_ptr())
