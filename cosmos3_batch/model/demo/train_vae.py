"""Trains the demo model's Wan VAE (diffusers' `AutoencoderKLWan`, the class the checkpoint loads) to
reconstruct grammar pictures and clips, then measures the latent statistics the pipeline normalises by."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from cosmos3_batch.model.demo.grammar import Scene, draw

log = logging.getLogger("cosmos3_batch.train_tiny")

LATENT_NOISE = 0.1


@dataclass(frozen=True)
class VaeRecipe:
    steps: int = 1000
    batch: int = 4  # pictures per step
    clip_batch: int = 1  # 9-frame clips per video step
    video_every: int = 5  # one step in this many trains on clips (they cost ~9 pictures each)
    crop: int = 64  # most steps see crops: the VAE is convolutional and a crop costs a quarter
    # The last tenth sees whole 128x128 pictures: the middle block's attention then sees the 8x8 latent grid
    # that generation decodes (a step there costs four of the cropped ones).
    full_size_from: float = 0.9
    lr: float = 1e-3  # 2e-3 and above diverge early (measured)
    kl_weight: float = 1e-6


def to_vae_input(frames: np.ndarray) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float [3, T, H, W] in [-1, 1], the range the pipeline's VAE sees."""
    return torch.from_numpy(frames).float().permute(3, 0, 1, 2) / 127.5 - 1.0


def _batch(scenes: list[Scene], count: int, rng: np.random.Generator, crop: int | None) -> torch.Tensor:
    items = []
    for index in rng.integers(0, len(scenes), size=count):
        x = to_vae_input(draw(scenes[int(index)], rng))
        if crop is not None:
            top, left = (int(v) for v in rng.integers(0, x.shape[-1] - crop + 1, size=2))
            x = x[..., top : top + crop, left : left + crop]
        items.append(x)
    return torch.stack(items)


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode` without its final clamp to [-1, 1]: a pixel the untrained decoder pushes past the
    clamp on the wrong side has no gradient there and stays wrong (measured: flat colours never fit)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):  # one latent frame at a time through the causal cache, as decode does
        vae._conv_idx = [0]
        chunk, cache = x[:, :, i : i + 1], vae._feat_map
        frames.append(vae.decoder(chunk, feat_cache=cache, feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return unpatchify(torch.cat(frames, 2), patch_size=vae.config.patch_size)


def _step_loss(vae, x: torch.Tensor, kl_weight: float) -> torch.Tensor:
    posterior = vae.encode(x).latent_dist
    # Decode the mean plus a little noise: the posterior's own sample starts at unit variance, which buries
    # the signal and leaves only blur to learn, while a little noise still teaches the decoder to forgive
    # the small latent errors that denoising leaves.
    mean = posterior.mode()
    recon = decode_unclamped(vae, mean + LATENT_NOISE * torch.randn_like(mean))
    error = recon - x
    return error.abs().mean() + error.square().mean() + kl_weight * posterior.kl().mean()


def train_vae(
    vae, image_scenes: list[Scene], video_scenes: list[Scene], recipe: VaeRecipe, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=recipe.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=recipe.lr, total_steps=recipe.steps)
    vae.train()
    start = time.monotonic()
    for step in range(recipe.steps):
        crop = None if step >= recipe.full_size_from * recipe.steps else recipe.crop
        if step % recipe.video_every == recipe.video_every - 1:
            x = _batch(video_scenes, recipe.clip_batch, rng, crop)
        else:
            x = _batch(image_scenes, recipe.batch, rng, crop)
        loss = _step_loss(vae, x, recipe.kl_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == recipe.steps - 1:
            log.info(
                "vae step %d/%d loss %.4f (%.0f s)", step, recipe.steps, loss.item(), time.monotonic() - start
            )
    vae.eval()


@torch.no_grad()
def encode_means(vae, scenes: list[Scene], variants: int, seed: int, batch: int = 8) -> list[torch.Tensor]:
    """Raw posterior means [1, C, T, h, w]: `variants` jittered drawings per scene, in scene order."""
    rng = np.random.default_rng(seed)
    drawings = [to_vae_input(draw(s, rng)) for s in scenes for _ in range(variants)]
    out: list[torch.Tensor] = []
    for i in range(0, len(drawings), batch):
        mu = vae.encode(torch.stack(drawings[i : i + batch])).latent_dist.mode()
        out.extend(m.unsqueeze(0) for m in mu)
    return out


def latent_statistics(latents: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per-channel mean and std over every latent position: the config's latents_mean / latents_std."""
    flat = torch.cat([z.flatten(2).squeeze(0) for z in latents], dim=1)
    return [round(v, 5) for v in flat.mean(dim=1).tolist()], [round(v, 5) for v in flat.std(dim=1).tolist()]
