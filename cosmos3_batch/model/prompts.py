"""The reference pipeline's prompt side: the tokenizer, diffusers' pipeline helper (templates, packing) and a
request's (cond, uncond) token ids, exactly as generation and the planner both need them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint

if TYPE_CHECKING:
    from cosmos3_batch.requests.parse import Request


def load_tokenizer(checkpoint: Checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint.root / "text_tokenizer")


def build_helper(checkpoint: Checkpoint, tokenizer, transformer=None, vae=None, sound_tokenizer=None):
    """A `Cosmos3OmniPipeline` used only for its helpers (templating, packing, latent prep).

    Without modules it is built over meta-device ones from the configs: enough to tokenize and
    validate prompts before any weight is read.
    """
    from diffusers import (
        AutoencoderKLWan,
        Cosmos3OmniPipeline,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
    )

    from cosmos3_batch.model.loading import build_transformer_on_meta

    if transformer is None:
        transformer = build_transformer_on_meta(checkpoint.config("transformer"))
    if vae is None:
        with torch.device("meta"):
            vae = AutoencoderKLWan.from_config(checkpoint.config("vae"))
    index = checkpoint.model_index
    distilled = checkpoint.sampler.distilled
    scheduler_class = FlowMatchEulerDiscreteScheduler if distilled else UniPCMultistepScheduler
    helper = Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        # It never steps (pipeline/kinds/samplers.py does); its scheduler is the declared class anyway.
        scheduler=scheduler_class.from_config(checkpoint.config("scheduler")),
        enable_safety_checker=False,  # guardrail requests are rejected up front (no safety models offline)
        default_use_system_prompt=checkpoint.default_use_system_prompt,
        use_native_flow_schedule=index.get("use_native_flow_schedule", False),
        sound_tokenizer=sound_tokenizer,  # read by prepare_latents for sound+action requests
    )
    helper.set_progress_bar_config(disable=True)
    return helper


def tokenize(helper, r: Request) -> tuple[list[int], list[int]]:
    """(cond, uncond) token ids, templated exactly as the reference pipeline does for this request."""
    action = {}
    if r.action is not None:  # the reference turns an action prompt into its structured JSON caption
        action = {"action_mode": r.action.mode, "action_view_point": r.action.viewpoint}
    return helper.tokenize_prompt(
        r.prompt,
        r.negative_prompt,
        **action,
        num_frames=r.num_frames,
        height=r.height,
        width=r.width,
        fps=r.fps,
        use_system_prompt=r.system_prompt,
        add_resolution_template=r.use_resolution_template,
        add_duration_template=r.use_duration_template,
    )


# Cosmos3TransferTextStep's own system prompt (diffusers' modular_pipelines/cosmos/encoders.py): Transfer
# conditions on control signals, so it does not use the image/video ones.
TRANSFER_SYSTEM_PROMPT = (
    "You are a helpful assistant that generates images or videos following the user's instructions"
    " and control signals (edge maps, blur, depth, or segmentation)."
)


def tokenize_transfer(helper, r: Request) -> tuple[list[int], list[int]]:
    """(cond, uncond) token ids as Cosmos3TransferTextStep makes them: prompts verbatim (no templates), its
    system prompt unless `system_prompt` is false, and "" for an absent negative prompt."""
    special = helper.llm_special_tokens

    def ids(text: str) -> list[int]:
        conversation = (
            [] if r.system_prompt is False else [{"role": "system", "content": TRANSFER_SYSTEM_PROMPT}]
        )
        conversation.append({"role": "user", "content": text})
        encoding = helper.text_tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=True, add_vision_id=False, return_dict=True
        )
        return [*encoding.input_ids, special["eos_token_id"], special["start_of_generation"]]

    return ids(r.prompt), ids(r.negative_prompt if r.negative_prompt is not None else "")
