"""A request's sampler, as its checkpoint declares it (checkpoint/declared.py, DESIGN.md §18).

- `UniPCSampler` (base checkpoints): `UniPCMultistepScheduler` over the request's steps and flow shift, as
  `Cosmos3OmniPipeline` runs it, its steps free of host-device syncs (pipeline/kinds/sync_free.py).
- `DistilledSampler` (4-step distilled checkpoints): `FlowMatchEulerDiscreteScheduler` on the checkpoint's
  `distilled_sigmas`, stochastic: each step re-noises from the request's own generator, then the conditioned
  latent frames are put back to their clean values, as `Cosmos3DistilledVisionLoopSchedulerStep` does.

The distilled step draws its noise where diffusers does (one CPU `randn` per step from the request's
generator, after the initial noise), but all of a request's steps' draws happen at `prepare`, in step order:
the generator has no other user in between, so the values are the same, and on a GPU a step then copies
its noise from pinned host memory without waiting for the device (a `randn_tensor(..., device=cuda)` per
step copies from pageable memory, which synchronizes). The step itself is diffusers' stochastic Euler
formula on the same tensors; tests/unit/test_samplers.py holds it to `scheduler.step` bit for bit.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from cosmos3_batch.engine.pinning import PinnedRegion
from cosmos3_batch.pipeline.kinds import sync_free


class UniPCSampler:
    def __init__(self, ctx, request, native_schedule: bool | None = None):
        """`native_schedule`: None = the checkpoint's `use_native_flow_schedule` (Transfer's chunks never
        use it: Cosmos3TransferSetTimestepsStep calls plain `set_timesteps`)."""
        from diffusers import UniPCMultistepScheduler

        overrides = {} if request.flow_shift is None else {"flow_shift": request.flow_shift}
        scheduler = UniPCMultistepScheduler.from_config(ctx.scheduler_config, **overrides)
        steps = request.num_inference_steps
        if ctx.use_native_flow_schedule if native_schedule is None else native_schedule:
            train = scheduler.config.num_train_timesteps
            sigmas = np.linspace(1.0 - 1.0 / train, 0.0, steps + 1)[:-1]
            scheduler.set_timesteps(steps, device=ctx.device, sigmas=sigmas)
        else:
            scheduler.set_timesteps(steps, device=ctx.device)
        self.scheduler = sync_free.prepare(scheduler, ctx.device)

    def step(
        self, velocity: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, index: int
    ) -> torch.Tensor:
        return sync_free.step(self.scheduler, velocity.unsqueeze(0), t, latents.unsqueeze(0)).squeeze(0)


def step_noise(
    steps: int, shape: tuple[int, ...], generator: torch.Generator, pin: bool, cudart=None
) -> tuple[torch.Tensor, PinnedRegion | None]:
    """Every step's noise [steps, *shape] float32, drawn from `generator` in step order (the values of one
    `torch.randn(shape)` per step) into one buffer; `pin`: that buffer page-locked at exactly its size
    (`cudaHostRegister`: torch's pinned allocator would round 133 MB up to 256 MB, after a second copy)."""
    noise = torch.empty((steps, *shape), dtype=torch.float32)
    for step in range(steps):
        torch.randn(shape, generator=generator, dtype=torch.float32, out=noise[step])
    return noise, PinnedRegion.of_tensor(noise, cudart) if pin else None


class DistilledSampler:
    def __init__(
        self, ctx, sigmas, generator: torch.Generator, latents: torch.Tensor, mask, conditioned: bool
    ):
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(ctx.scheduler_config)
        if not scheduler.config.stochastic_sampling:
            raise ValueError("a distilled checkpoint's scheduler must have stochastic_sampling (its config)")
        scheduler.set_timesteps(sigmas=list(sigmas), device=ctx.device)
        self.scheduler = scheduler
        self.sigmas = scheduler.sigmas  # on the device already (set_timesteps' device), the last one 0
        shape = (1, *latents.shape)  # the scheduler's sample: the latents with a leading 1, as diffusers has
        self.noise, region = step_noise(len(sigmas), shape, generator, pin=ctx.device.type == "cuda")
        if region is not None:  # unregistered when the sampler goes, before its buffer is freed
            weakref.finalize(self, region.close)
        # Re-anchoring (I2V, V2V): the clean conditioning frames. The initial latents hold them where the mask
        # is 1 (mask * clean + (1 - mask) * noise), and where it is 0 only a zero times them is added.
        self.anchor = (mask, latents.clone()) if conditioned else None

    def step(
        self, velocity: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, index: int
    ) -> torch.Tensor:
        """FlowMatchEulerDiscreteScheduler.step with stochastic_sampling, then the re-anchoring."""
        output = velocity.float().unsqueeze(0)
        sample = latents.float().unsqueeze(0)
        sigma, sigma_next = self.sigmas[index], self.sigmas[index + 1]
        noise = self.noise[index].to(sample.device, non_blocking=True)
        x0 = sample - sigma * output
        stepped = ((1.0 - sigma_next) * x0 + sigma_next * noise).to(output.dtype).squeeze(0)
        if self.anchor is None:
            return stepped
        mask, clean = self.anchor
        return mask * clean.to(stepped.dtype) + (1.0 - mask) * stepped


def make_sampler(ctx, request, generator: torch.Generator, latents: torch.Tensor, mask: torch.Tensor):
    """The sampler the request's checkpoint declares (ctx.sampler). `latents` and `mask`: the initial latents
    and the vision condition mask; an image or a video conditions frames (the reference re-anchors them)."""
    if ctx.sampler.distilled:
        conditioned = request.image is not None or request.video is not None
        return DistilledSampler(ctx, ctx.sampler.sigmas, generator, latents, mask, conditioned)
    return UniPCSampler(ctx, request)
