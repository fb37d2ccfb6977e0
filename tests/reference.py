"""The reference pipeline's call for one of our requests (DESIGN.md §7), shared by the fidelity tests."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
from diffusers.utils import load_video
from PIL import Image

from cosmos3_batch.requests.parse import Request


def reference_kwargs(r: Request) -> dict:
    """The reference call for one of our requests (DESIGN.md §7), mode fields included."""
    kwargs = dict(
        prompt=r.prompt,
        negative_prompt=r.negative_prompt,
        num_frames=r.num_frames,
        height=r.height,
        width=r.width,
        fps=r.fps,
        num_inference_steps=r.num_inference_steps,
        guidance_scale=r.guidance_scale,
        add_resolution_template=r.use_resolution_template,
        add_duration_template=r.use_duration_template,
        use_system_prompt=r.system_prompt,
        enable_sound=r.sound,
    )
    if r.image is not None:
        kwargs["image"] = Image.open(r.image)
    if r.action is not None:
        for key in ("num_frames", "height", "width", "image"):
            kwargs.pop(key, None)  # the reference derives them from the action (and wants them unset)
        return {**kwargs, "action": reference_action(r)}
    if r.video is not None:
        kwargs.update(
            video=load_video(r.video),
            condition_frame_indexes_vision=list(r.condition_frames),
            condition_video_keep=r.condition_video_keep,
        )
    return kwargs


def reference_action(r: Request) -> CosmosActionCondition:
    """The action condition built straight from the request's inputs (not through our loader)."""
    spec = r.action
    if isinstance(spec.actions, str):
        raw = torch.from_numpy(np.load(spec.actions))
    else:
        raw = torch.tensor(spec.actions, dtype=torch.float64) if spec.actions is not None else None
    media = {"video": load_video(r.video)} if r.video is not None else {"image": Image.open(r.image)}
    return CosmosActionCondition(
        mode=spec.mode,
        chunk_size=spec.chunk_size,
        domain_name=spec.domain,
        resolution_tier=spec.resolution_tier,
        raw_actions=raw,
        view_point=spec.viewpoint,
        **media,
    )


def distilled_reference(folder, dtype: torch.dtype = torch.float32):
    """`Cosmos3DistilledModularPipeline` as diffusers loads a distilled folder (its blocks and config from
    modular_model_index.json), with the components read from the folder itself: the index's loading specs
    point at the hub, which the tests never reach. `dtype`: the transformer's as stored (the VAE's is
    float32 in the tiny checkpoints: `from_pretrained(..., dtype={"transformer": dtype})`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(folder))
    return _with_components(pipe, folder, dtype, FlowMatchEulerDiscreteScheduler)


def _with_components(pipe, folder, dtype: torch.dtype, scheduler_class):
    """A modular pipeline given the folder's own components (the transformer in `dtype`, the VAE as stored),
    its safety checker off and its progress bars quiet."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer
    from transformers import AutoTokenizer

    pipe.update_components(
        transformer=Cosmos3OmniTransformer.from_pretrained(
            folder, subfolder="transformer", torch_dtype=dtype
        ),
        vae=AutoencoderKLWan.from_pretrained(folder, subfolder="vae"),
        text_tokenizer=AutoTokenizer.from_pretrained(folder, subfolder="text_tokenizer"),
        scheduler=scheduler_class.from_pretrained(folder, subfolder="scheduler"),
    )
    pipe.disable_safety_checker()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def distilled_kwargs(r: Request) -> dict:
    """The distilled pipeline's call for one of our requests: no negative prompt, steps nor guidance."""
    kwargs = reference_kwargs(r)
    for key in ("negative_prompt", "num_inference_steps", "guidance_scale", "enable_sound"):
        kwargs.pop(key)
    return kwargs


def record_sea_decisions(pipe) -> dict[str, list[bool]]:
    """Enable nothing; watch the SeaCache root hook `pipe.transformer.enable_cache(SeaCacheConfig(...))`
    installed: every decoder-stack decision, per cache context ("cond", "uncond"), True = computed. The
    caller clears the lists between requests."""
    hook = pipe.transformer._diffusers_hook.get_hook("sea_cache_root")
    decisions: dict[str, list[bool]] = {}
    prepare = hook.prepare_decoder_stack

    def watched(module, und_seq, gen_seq):
        und_seq, gen_seq, should_compute = prepare(module, und_seq, gen_seq)
        name = hook.state_manager._context.name
        decisions.setdefault(name, []).append(should_compute)
        return und_seq, gen_seq, should_compute

    hook.prepare_decoder_stack = watched
    return decisions


def transfer_reference(folder, dtype: torch.dtype = torch.float32):
    """`Cosmos3OmniModularPipeline` with `Cosmos3OmniBlocks`, its components read from the folder (the tiny
    checkpoints have no modular index); the transformer in `dtype` as stored."""
    from diffusers import UniPCMultistepScheduler
    from diffusers.modular_pipelines.cosmos.modular_blocks_cosmos3 import Cosmos3OmniBlocks

    return _with_components(Cosmos3OmniBlocks().init_pipeline(), folder, dtype, UniPCMultistepScheduler)


def transfer_outputs(
    pipe, requests, controls: dict | None = None
) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    """Each Transfer request of `requests` through `pipe` (`transfer_reference`): every chunk's latents as
    they go to the decoder, concatenated as --save-latents writes them ([chunks, C, T, H, W]), and the
    frames. `controls`: frames by hint, given in place of the request's (its derived ones)."""
    from diffusers.modular_pipelines.cosmos import decoders

    chunk_latents: list[torch.Tensor] = []
    original = decoders.Cosmos3TransferDecodeChunkStep.__call__

    def recording(self, components, state):
        chunk_latents.append(state.get("latents").clone())
        return original(self, components, state)

    out = {}
    scheduler = pipe.scheduler
    decoders.Cosmos3TransferDecodeChunkStep.__call__ = recording
    try:
        for r in requests:
            if r.transfer is None:
                continue
            chunk_latents.clear()
            generator = torch.Generator("cpu").manual_seed(r.seed)
            if r.flow_shift is not None:  # as DESIGN §7 defines the reference: its scheduler with that shift
                pipe.update_components(
                    scheduler=scheduler.from_config(scheduler.config, flow_shift=r.flow_shift)
                )
            frames = pipe(
                **transfer_kwargs(r, controls), generator=generator, output_type="np", output="videos"
            )
            pipe.update_components(scheduler=scheduler)
            out[r.id] = (torch.cat(chunk_latents, dim=0), np.asarray(frames))
    finally:
        decoders.Cosmos3TransferDecodeChunkStep.__call__ = original
        pipe.update_components(scheduler=scheduler)
    return out


def transfer_kwargs(r: Request, controls: dict | None = None) -> dict:
    """The modular pipeline's Transfer call for one of our requests: the controls as frames, read straight
    from the files (`load_video`; a still image as one RGB frame), not through our loader; `controls`: frames
    by hint given instead (a derived control's)."""
    spec = r.transfer
    given = controls or {}

    def frames(path: str) -> list:
        if path.lower().endswith((".png", ".jpg", ".jpeg")):
            return [Image.open(path).convert("RGB")]
        return load_video(path)

    kwargs = dict(
        prompt=r.prompt,
        negative_prompt=r.negative_prompt,
        control_videos={hint: given[hint] if hint in given else frames(path) for hint, path in spec.controls},
        height=r.height,
        width=r.width,
        num_frames=r.num_frames,
        num_video_frames_per_chunk=spec.chunk_frames,
        num_conditional_frames=spec.conditional_frames,
        fps=r.fps,
        num_inference_steps=r.num_inference_steps,
        guidance_scale=r.guidance_scale,
        control_guidance=spec.control_guidance,
        guidance_interval=spec.guidance_interval,
        control_guidance_interval=spec.control_guidance_interval,
        use_system_prompt=r.system_prompt is not False,
    )
    if spec.video is not None:
        kwargs.update(
            video=load_video(spec.video),
            num_first_chunk_conditional_frames=spec.first_chunk_conditional_frames,
        )
    return kwargs
