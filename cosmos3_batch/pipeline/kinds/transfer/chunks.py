"""A Transfer request's chunk chain, in tensors: controls in, chunk inputs encoded, chunk outputs stitched.

Each function is one block of diffusers' modular Transfer path (modular_pipelines/cosmos/), on the same
tensors in the same dtypes, so the chain is bit-exact with `Cosmos3OmniModularPipeline`:

- `prepare_controls`: Cosmos3TransferSetupStep (preprocess to [-1, 1] in the transformer's dtype, reflect-pad
  along time to cover every chunk);
- `chunk_inputs`: Cosmos3TransferChunkVaeEncoderStep (this chunk's control window, the target seeded from the
  seed video or the previous chunk's decoded tail, both encoded);
- `chunk_noise`: Cosmos3TransferPrepareLatentsStep (noise from the request's generator, the condition mask);
- `decode_chunk` and `stitch`: Cosmos3TransferDecodeChunkStep and Cosmos3TransferStitchStep;
- `combine`: Cosmos3TransferLoopDenoiser's nested guidance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosmos3_batch.plan.branches import COND, COND_NO_CONTROL, UNCOND, StepBranches


@dataclass
class ChunkState:
    """One chunk's clean inputs and the masks its steps use."""

    control_latents: list[torch.Tensor]  # float32, one per hint in canonical order
    latents: torch.Tensor  # float32 [1, C, T, H, W]: noise where generated, clean where conditioned
    velocity_mask: torch.Tensor  # [T, 1, 1]: 0 on conditioned latent frames
    condition_latents: torch.Tensor  # the clean target on conditioned frames (re-pinned every step)
    condition_indexes: list[int]  # latent frames the target's conditioning fixes
    conditional_frames: int  # pixel frames that seeded the target


def load_control(path: str) -> list:
    """A control as PIL frames: a video decoded as `diffusers.utils.load_video` does, a still image as one
    frame (RGB, what the reference's preprocessing reads)."""
    from diffusers.utils import load_video
    from PIL import Image

    from cosmos3_batch.requests.transfer import IMAGE_SUFFIXES

    if path.lower().endswith(IMAGE_SUFFIXES):
        with Image.open(path) as image:
            return [image.convert("RGB")]
    return load_video(path)


def reflect_pad(frames: torch.Tensor, length: int) -> torch.Tensor:
    """Reflect along time up to `length` frames, repeating the last frame once too short to reflect."""
    while frames.shape[2] < length:
        pad_len = min(frames.shape[2] - 1, length - frames.shape[2])
        if pad_len <= 0:
            pad_frame = frames[:, :, -1:].repeat(1, 1, length - frames.shape[2], 1, 1)
            return torch.cat([frames, pad_frame], dim=2)
        frames = torch.cat([frames, frames.flip(dims=[2])[:, :, :pad_len]], dim=2)
    return frames


def prepare_controls(helper, controls: list, size: tuple[int, int], dtype, length: int) -> list:
    """Each control's frames preprocessed at (height, width), padded to `length` = max(total, chunk), in the
    transformer's dtype. Kept in host memory (a 720p control of 189 frames is 1 GiB in bf16): only a chunk's
    window goes to the device, for its encode (a cast and a copy: the same bits as the reference's cast on
    the device)."""
    height, width = size
    return [
        reflect_pad(helper.video_processor.preprocess_video(frames, height=height, width=width), length).to(
            dtype=dtype
        )
        for frames in controls
    ]


def _window(frames: torch.Tensor, start: int, chunk: int, total: int) -> torch.Tensor:
    return reflect_pad(frames[:, :, start : min(start + chunk, total)], chunk)


def seed_target(
    chunk: int, size: tuple[int, int], vae_dtype, device, seed: torch.Tensor | None, frames: int, tail: bool
) -> tuple[torch.Tensor, int]:
    """The target clip: its first frames from `seed` (the head of the seed video, or with `tail` the end of
    the previous chunk's output), the rest repeating the last of them; (clip, seeded frames)."""
    target = torch.zeros(1, 3, chunk, *size, device=device, dtype=vae_dtype)
    current = 0
    if seed is not None:
        current = min(frames, seed.shape[2], chunk)
        if current > 0:
            target[:, :, :current] = (seed[:, :, -current:] if tail else seed[:, :, :current]).to(
                device, vae_dtype
            )
    if 0 < current < chunk:
        fill = target[:, :, current - 1 : current]
        target[:, :, current:] = fill.expand(-1, -1, chunk - current, -1, -1)
    return target, current


def chunk_inputs(encoder, controls: list, target: torch.Tensor, window: tuple[int, int, int]) -> tuple:
    """(control latents, clean target latents) of one chunk; `window` = (start, chunk frames, total)."""
    start, chunk, total = window
    encode = encoder._encode_video
    device = target.device
    control_latents = [
        encode(_to_device(_window(c, start, chunk, total), device)).contiguous().float() for c in controls
    ]
    return control_latents, encode(target).contiguous().float()


def _to_device(window: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A control window (host memory) to the device: on a GPU pinned first, so the copy is asynchronous
    (from pageable memory it would wait for the device); the same bits either way."""
    if device.type != "cuda":
        return window.to(device)
    return window.pin_memory().to(device, non_blocking=True)


def chunk_noise(
    x0: torch.Tensor, conditional_frames: int, temporal: int, generator: torch.Generator, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(latents, velocity mask, condition latents, conditioned latent frames) of one chunk."""
    from diffusers.utils.torch_utils import randn_tensor

    target_x0 = x0.to(device=device, dtype=torch.float32)
    latent_t = target_x0.shape[2]
    condition_mask = torch.zeros((latent_t, 1, 1), device=device, dtype=torch.float32)
    latent_frames = 0
    if conditional_frames > 0:
        latent_frames = (conditional_frames - 1) // temporal + 1
        condition_mask[:latent_frames] = 1.0
    noise = randn_tensor(tuple(target_x0.shape), generator=generator, device=device, dtype=torch.float32)
    latents = condition_mask * target_x0 + (1.0 - condition_mask) * noise
    return latents, 1.0 - condition_mask, condition_mask * target_x0, list(range(latent_frames))


def decode_chunk(helper, vae, latents: torch.Tensor, decode=None) -> torch.Tensor | None:
    """The chunk's pixels, float32 in [-1, 1]: the next chunk's seed and a piece of the output. `decode`
    stands for `vae.decode(z).sample` (a --vae-patch-parallel-size group's, None on its other members)."""
    mean = helper._vae_latents_mean.to(device=latents.device, dtype=vae.dtype)
    inv_std = helper._vae_latents_inv_std.to(device=latents.device, dtype=vae.dtype)
    z_raw = latents.to(vae.dtype) / inv_std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
    sample = vae.decode(z_raw).sample if decode is None else decode(z_raw)
    return None if sample is None else sample.to(torch.float32).clamp(-1, 1)


def stitch(helper, pieces: list[torch.Tensor], total: int):
    """The output frames [T, H, W, 3] in [0, 1]: the pieces along time (later chunks without the frames
    they took from the previous one), cut to the requested length. The pieces wait in host memory (float32
    frames of a whole video); the post-processing is elementwise (x / 2 + 0.5, clamped): the same bits."""
    decoded = torch.cat(pieces, dim=2)[:, :, :total]
    return helper.video_processor.postprocess_video(decoded, output_type="np")[0]


def combine(preds: dict[str, torch.Tensor], step: StepBranches) -> torch.Tensor:
    """Cosmos3TransferLoopDenoiser's nested guidance: the control axis inside the text axis."""
    cond = preds[COND]
    if COND_NO_CONTROL in step.names and UNCOND in step.names:
        no_control, uncond = preds[COND_NO_CONTROL], preds[UNCOND]
        control_cond = no_control + step.control_scale * (cond - no_control)
        return uncond + step.text_scale * (control_cond - uncond)
    if COND_NO_CONTROL in step.names:
        no_control = preds[COND_NO_CONTROL]
        return no_control + step.control_scale * (cond - no_control)
    if UNCOND in step.names:
        uncond = preds[UNCOND]
        return uncond + step.text_scale * (cond - uncond)
    return cond
