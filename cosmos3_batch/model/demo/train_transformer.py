"""Trains the demo model's Cosmos3 transformer with the flow-matching objective its scheduler samples with.

Every input is built by the reference pipeline's own helpers (`tokenize_prompt`, `_prepare_text_segment`,
`_prepare_vision_segment`) and the transformer is called exactly as its denoising loop calls it, so what is
trained is what inference feeds: the same template, tokens, positions, timestep scale and latent
normalisation. The negative branch of classifier-free guidance is trained by replacing the prompt with the
pipeline's default negative (an empty prompt plus the inverse templates) one time in ten.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cosmos3_batch.model.demo.grammar import FPS, SIDE, VIDEO_FRAMES, Scene

log = logging.getLogger("cosmos3_batch.train_tiny")


@dataclass(frozen=True)
class TransformerRecipe:
    steps: int = 1500
    batch: int = 16  # samples per optimizer step (one forward each: the transformer packs one sequence)
    lr: float = 3e-3  # 1.5e-3: held-out colour 8/16 after 500 steps; 3e-3: 13/16
    warmup: int = 100
    drop_prompt: float = 0.1  # the negative branch's share, so guidance has an unconditional to push from
    video_share: float = 0.4
    # The figure covers ~6% of the latent pixels: without a weight the loss is mostly background and the
    # figure's colour and place are learned last. Its latent pixels count this many times more.
    figure_weight: float = 0.0


@dataclass
class Example:
    """One training item: its packed text/vision layout for the prompt and for the negative, its clean
    normalised latents [1, C, T, h, w] and where its figure is on their grid [1, 1, T, h, w]."""

    cond: dict[str, Any]
    uncond: dict[str, Any]
    latents: torch.Tensor
    figure: torch.Tensor


def build_helper(transformer, tokenizer, vae, scheduler):
    """A `Cosmos3OmniPipeline` used for its templating and packing helpers only."""
    from diffusers import Cosmos3OmniPipeline

    helper = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=scheduler,
        enable_safety_checker=False,
        default_use_system_prompt=False,
    )
    helper.set_progress_bar_config(disable=True)
    return helper


def grammar_tokenizer(vae, scenes: list[Scene]):
    """The demo model's tokenizer: one token per word of the texts the pipeline builds for `scenes`.

    The texts come from the pipeline's own `tokenize_prompt` (its duration and resolution templates, the
    negative's inverse ones), so every word the transformer sees in training or at 128x128 is a token.
    """
    from cosmos3_batch.model.tiny import build_tokenizer

    byte_level = build_tokenizer()
    helper = build_helper(None, byte_level, vae, None)
    corpus = []
    for scene in scenes:
        frames = VIDEO_FRAMES if scene.is_video else 1
        for ids in helper.tokenize_prompt(
            scene.prompt, None, num_frames=frames, height=SIDE, width=SIDE, fps=FPS, use_system_prompt=False
        ):
            corpus.append(byte_level.decode(ids, skip_special_tokens=True))
    return build_tokenizer(corpus)


def _packed(helper, input_ids: list[int], latents: torch.Tensor) -> dict[str, Any]:
    text = helper._prepare_text_segment(input_ids, device="cpu")
    vision = helper._prepare_vision_segment(
        input_vision_tokens=latents,
        has_image_condition=False,
        mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=FPS,
        curr=text["und_len"],
        device="cpu",
        condition_frame_indexes=[],
    )
    return {
        **text,
        **vision,
        "position_ids": torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
        "sequence_length": text["und_len"] + vision["num_vision_tokens"],
    }


def make_examples(
    helper, scenes: list[Scene], latents: list[torch.Tensor], figures: list[torch.Tensor], variants: int
) -> list[Example]:
    """`latents` and `figures` hold `variants` items per scene, in scene order (as encode_means returns)."""
    examples = []
    for index, scene in enumerate(scenes):
        frames = VIDEO_FRAMES if scene.is_video else 1
        cond_ids, uncond_ids = helper.tokenize_prompt(
            scene.prompt, None, num_frames=frames, height=SIDE, width=SIDE, fps=FPS, use_system_prompt=False
        )
        for v in range(variants):
            z = latents[index * variants + v]
            figure = figures[index * variants + v]
            examples.append(Example(_packed(helper, cond_ids, z), _packed(helper, uncond_ids, z), z, figure))
    return examples


def velocity(transformer, packed: dict[str, Any], noisy: torch.Tensor, timestep: float) -> torch.Tensor:
    """The transformer's prediction for one sequence, called as the pipeline's denoising loop calls it."""
    vision_timesteps = torch.full((packed["num_noisy_vision_tokens"],), timestep)
    preds, _, _ = transformer(
        input_ids=packed["input_ids"],
        text_indexes=packed["text_indexes"],
        position_ids=packed["position_ids"],
        und_len=packed["und_len"],
        sequence_length=packed["sequence_length"],
        vision_tokens=[noisy],
        vision_token_shapes=packed["vision_token_shapes"],
        vision_sequence_indexes=packed["vision_sequence_indexes"],
        vision_mse_loss_indexes=packed["vision_mse_loss_indexes"],
        vision_timesteps=vision_timesteps,
        vision_noisy_frame_indexes=packed["vision_noisy_frame_indexes"],
        return_dict=False,
    )
    return preds[0]


def sample_sigma(rng: np.random.Generator, flow_shift: float) -> float:
    # The scheduler's shifted flow sigmas crowd the noisy end; sample as it steps, plus a uniform half so the
    # last, detail-setting steps are trained as well.
    u = float(rng.uniform(0.0, 1.0))
    if rng.uniform() < 0.5:
        return u
    return flow_shift * u / (1.0 + (flow_shift - 1.0) * u)


def _example_loss(transformer, example: Example, rng: np.random.Generator, recipe, flow_shift: float):
    sigma = sample_sigma(rng, flow_shift)
    noise = torch.from_numpy(rng.standard_normal(example.latents.shape).astype(np.float32))
    noisy = (1.0 - sigma) * example.latents + sigma * noise
    packed = example.uncond if rng.uniform() < recipe.drop_prompt else example.cond
    # The scheduler steps x0 = x_t - sigma * v, so v = noise - x0; its timesteps are sigma * 1000.
    pred = velocity(transformer, packed, noisy, sigma * 1000.0)
    weight = 1.0 + recipe.figure_weight * example.figure
    return ((pred - (noise - example.latents)).square() * weight).mean() / weight.mean()


def _lr_factor(step: int, recipe: TransformerRecipe) -> float:
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_transformer(
    transformer,
    images: list[Example],
    videos: list[Example],
    recipe: TransformerRecipe,
    flow_shift: float,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    params = [p for n, p in transformer.named_parameters() if not n.startswith("lm_head")]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, recipe))
    transformer.train()
    start, running = time.monotonic(), 0.0
    for step in range(recipe.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(recipe.batch):
            pool = videos if rng.uniform() < recipe.video_share else images
            loss = _example_loss(transformer, pool[int(rng.integers(len(pool)))], rng, recipe, flow_shift)
            (loss / recipe.batch).backward()
            total += loss.item() / recipe.batch
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        running = total if step == 0 else 0.95 * running + 0.05 * total
        if step % 25 == 0 or step == recipe.steps - 1:
            log.info(
                "transformer step %d/%d loss %.4f (%.0f s)",
                step,
                recipe.steps,
                running,
                time.monotonic() - start,
            )
    transformer.eval()
