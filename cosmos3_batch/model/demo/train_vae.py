"""Trains the demo model's Wan VAE (diffusers' `AutoencoderKLWan`, the class the checkpoint loads) to
reconstruct grammar pictures and clips, then measures the latent statistics the pipeline normalises by."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from cosmos3_batch.model.demo.grammar import PALETTE, Scene, draw

log = logging.getLogger("cosmos3_batch.train_tiny")

LATENT_NOISE = 0.1


@dataclass(frozen=True)
class VaeRecipe:
    steps: int = 1500
    batch: int = 4  # pictures per step
    clip_batch: int = 1  # 9-frame clips per video step
    # One step in this many trains on clips (they cost ~9 pictures each). At 5, 1000 steps reconstructed
    # 1/16 held-out clips with colour, background and direction all right; at 2 with 1500 steps, 8/16.
    video_every: int = 2
    crop: int = 64  # most steps see crops: the VAE is convolutional and a crop costs a quarter
    # The last tenth sees whole 128x128 pictures: the middle block's attention then sees the 8x8 latent grid
    # that generation decodes (a step there costs four of the cropped ones).
    full_size_from: float = 0.9
    lr: float = 1e-3  # 2e-3 and above diverge early (measured)
    kl_weight: float = 1e-6
    # The figure is ~6% of the pixels: its pixels count this many times more in the reconstruction loss
    # (with 5, held-out clips reconstructed all right went from 8/16 to 15/16, pictures 31/32 to 32/32).
    figure_weight: float = 5.0


def to_vae_input(frames: np.ndarray) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float [3, T, H, W] in [-1, 1], the range the pipeline's VAE sees."""
    return torch.from_numpy(frames).float().permute(3, 0, 1, 2) / 127.5 - 1.0


def _batch(
    scenes: list[Scene], count: int, rng: np.random.Generator, crop: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` drawings [N, 3, T, H, W] in [-1, 1] and their figure pixels [N, 1, T, H, W] (1.0 / 0.0)."""
    items, figures = [], []
    for index in rng.integers(0, len(scenes), size=count):
        scene = scenes[int(index)]
        frames = draw(scene, rng)
        x = to_vae_input(frames)
        f = torch.from_numpy(figure_pixels(frames, scene).astype(np.float32))[None]
        if crop is not None:
            top, left = (int(v) for v in rng.integers(0, x.shape[-1] - crop + 1, size=2))
            x = x[..., top : top + crop, left : left + crop]
            f = f[..., top : top + crop, left : left + crop]
        items.append(x)
        figures.append(f)
    return torch.stack(items), torch.stack(figures)


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


def _step_loss(vae, x: torch.Tensor, figure: torch.Tensor, recipe: VaeRecipe) -> torch.Tensor:
    posterior = vae.encode(x).latent_dist
    # Decode the mean plus a little noise: the posterior's own sample starts at unit variance, which buries
    # the signal and leaves only blur to learn, while a little noise still teaches the decoder to forgive
    # the small latent errors that denoising leaves.
    mean = posterior.mode()
    recon = decode_unclamped(vae, mean + LATENT_NOISE * torch.randn_like(mean))
    error = recon - x
    weight = 1.0 + recipe.figure_weight * figure
    pixel = ((error.abs() + error.square()) * weight).mean() / weight.mean()
    return pixel + recipe.kl_weight * posterior.kl().mean()


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
            x, figure = _batch(video_scenes, recipe.clip_batch, rng, crop)
        else:
            x, figure = _batch(image_scenes, recipe.batch, rng, crop)
        loss = _step_loss(vae, x, figure, recipe)
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
def encode_means(
    vae, scenes: list[Scene], variants: int, seed: int, batch: int = 8
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Raw posterior means [1, C, T, h, w] of `variants` jittered drawings per scene, in scene order, and
    where each drawing's figure is on that latent grid [1, 1, T, h, w] (1: the latent pixel covers some of
    the figure), for the transformer's loss to weigh the figure as much as the wide background."""
    rng = np.random.default_rng(seed)
    drawings = [(s, draw(s, rng)) for s in scenes for _ in range(variants)]
    latents: list[torch.Tensor] = []
    for i in range(0, len(drawings), batch):
        mu = vae.encode(torch.stack([to_vae_input(d) for _, d in drawings[i : i + batch]])).latent_dist.mode()
        latents.extend(m.unsqueeze(0) for m in mu)
    config = vae.config
    masks = [
        figure_mask(d, s, int(config.scale_factor_spatial), int(config.scale_factor_temporal))
        for s, d in drawings
    ]
    return latents, masks


def figure_pixels(frames: np.ndarray, scene: Scene) -> np.ndarray:
    """[F, H, W] bool: the drawn pixels that are not the background colour (the figure)."""
    return np.any(frames != np.array(PALETTE[scene.background], dtype=np.uint8), axis=-1)


def figure_mask(frames: np.ndarray, scene: Scene, spatial: int, temporal: int) -> torch.Tensor:
    """[1, 1, T, h, w]: 1 where a latent pixel's block of frames and pixels holds some of the figure (the
    causal VAE's first latent frame is the first frame alone, each later one `temporal` frames)."""
    figure = figure_pixels(frames, scene)
    groups = [figure[:1]] + [figure[1 + k : 1 + k + temporal] for k in range(0, len(figure) - 1, temporal)]
    side = figure.shape[1] // spatial
    blocks = [g.any(axis=0).reshape(side, spatial, side, spatial).any(axis=(1, 3)) for g in groups]
    return torch.from_numpy(np.stack(blocks).astype(np.float32))[None, None]


def latent_statistics(latents: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per-channel mean and std over every latent position: the config's latents_mean / latents_std."""
    flat = torch.cat([z.flatten(2).squeeze(0) for z in latents], dim=1)
    return [round(v, 5) for v in flat.mean(dim=1).tolist()], [round(v, 5) for v in flat.std(dim=1).tolist()]
