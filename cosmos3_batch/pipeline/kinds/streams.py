"""Per-request state of the sound and action streams that ride in the GEN half next to the vision tokens.

Each stream mirrors the reference's handling of that modality in `Cosmos3OmniPipeline.__call__`: its own
latents and condition mask from `prepare_latents`, its segment of the packed sequence, its own scheduler
(a deep copy of the vision one, made before the first step), CFG combined per modality.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from cosmos3_batch.model.modes import ACTION, SOUND, StreamLayout
from cosmos3_batch.pipeline.kinds import sync_free


@dataclass
class ExtraStream:
    kind: str  # SOUND or ACTION
    latents: torch.Tensor  # sound [C, T]; action [T, D]
    condition_mask: torch.Tensor  # [T, 1]: 1 where the token is given (kept clean), 0 where generated
    fps: float  # the temporal rate its positions are modulated with (sound: latents per second)
    condition_frames: list[int] = field(default_factory=list)  # ACTION: tokens given (forward dynamics)
    domain_id: torch.Tensor | None = None  # ACTION
    raw_action_dim: int | None = None  # ACTION: the embodiment's width; wider channels stay zero
    scheduler: object = None
    layout: StreamLayout | None = None
    steps: bool = True  # set by start(): whether this stream's latents move at all

    @property
    def length(self) -> int:
        return int(self.latents.shape[1] if self.kind == SOUND else self.latents.shape[0])

    def segment(self, helper, mrope_offset: float, curr: int, und_len: int, device) -> torch.Tensor:
        """This stream's part of one branch's packed sequence; returns its mRoPE ids, records its layout."""
        if self.kind == SOUND:
            seg = helper._prepare_sound_segment(
                input_sound_tokens=self.latents, mrope_offset=mrope_offset, sound_fps=self.fps, curr=curr,
                device=device,
            )  # fmt: skip
        else:
            seg = helper._prepare_action_segment(
                input_action_tokens=self.latents, condition_frame_indexes=self.condition_frames,
                mrope_offset=mrope_offset, action_fps=self.fps, curr=curr, device=device,
            )  # fmt: skip
        layout = StreamLayout(
            kind=self.kind,
            token_shapes=seg[f"{self.kind}_token_shapes"],
            noisy_frame_indexes=seg[f"{self.kind}_noisy_frame_indexes"],
            rows=seg[f"{self.kind}_mse_loss_indexes"] - und_len,
            domain_id=self.domain_id,
        )
        # Branches differ only in their text, so the rows (relative to the GEN stream) agree in all of them.
        assert self.layout is None or torch.equal(self.layout.rows, layout.rows)
        self.layout = layout
        return seg[f"{self.kind}_mrope_ids"]

    def start(self, vision_scheduler) -> None:
        # UniPC keeps per-step state on the instance: each modality needs its own, as in the reference.
        self.scheduler = copy.deepcopy(vision_scheduler)
        # The reference steps the action stream only when some action token is generated. Decided once
        # here: reading the mask on the host every step would synchronize the device.
        self.steps = self.kind == SOUND or bool(self.condition_mask.sum() < self.condition_mask.numel())

    def step(self, velocity: torch.Tensor, t: torch.Tensor) -> None:
        if not self.steps:
            return
        self.latents = sync_free.step(self.scheduler, velocity.unsqueeze(0), t, self.latents.unsqueeze(0))
        self.latents = self.latents.squeeze(0)
        if self.raw_action_dim is not None:
            self.latents[:, self.raw_action_dim :] = 0


def sound_stream(ctx, num_frames: int, fps: float, generator: torch.Generator) -> ExtraStream:
    """Sound latents as `prepare_latents(enable_sound=True)` draws them: all noisy, drawn after the vision
    noise from the same generator."""
    from diffusers.utils.torch_utils import randn_tensor

    from cosmos3_batch.model.sound import hop_size, sound_length

    config = ctx.split.config
    tokenizer = ctx.sound_tokenizer
    length = sound_length(num_frames, fps, int(tokenizer.config.sampling_rate), hop_size(tokenizer.config))
    shape = (int(config.sound_dim), length)
    noise = randn_tensor(shape, generator=generator, device=ctx.device, dtype=torch.float32)
    mask = torch.zeros((length, 1), device=ctx.device, dtype=torch.float32)
    # The reference mixes mask * zeros + (1 - mask) * noise, which is the noise bit for bit.
    return ExtraStream(SOUND, noise, mask, fps=float(config.sound_latent_fps))


def mask_velocities(vision_pred, vision_mask, streams: list[ExtraStream], extra_preds: list[torch.Tensor]):
    """The reference's `_mask_velocity_predictions` over every modality of one branch, in float32."""
    from diffusers import Cosmos3OmniPipeline

    by_kind = {s.kind: (s, p) for s, p in zip(streams, extra_preds, strict=True)}
    sound, action = by_kind.get(SOUND), by_kind.get(ACTION)
    out = Cosmos3OmniPipeline._mask_velocity_predictions(
        [vision_pred],
        [sound[1]] if sound else None,
        vision_condition_mask=[vision_mask],
        sound_condition_mask=[sound[0].condition_mask] if sound else None,
        preds_action=[action[1]] if action else None,
        action_condition_mask=[action[0].condition_mask] if action else None,
        raw_action_dim=action[0].raw_action_dim if action else None,
    )
    velocities = {"vision": out[0].float()}
    for kind, value in ((SOUND, out[1]), (ACTION, out[2])):
        if value is not None:
            velocities[kind] = value.float()
    return velocities


def action_condition(request, conditioning, raw: torch.Tensor | None = None):
    """The reference's `CosmosActionCondition` for an action request; `conditioning` is the PIL image or the
    load_video frames; `raw` the given actions if already read."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    from cosmos3_batch.requests.actions import load_actions

    spec = request.action
    if raw is None and spec.actions is not None:
        raw = torch.from_numpy(load_actions(spec))
    media = {"video": conditioning} if request.video is not None else {"image": conditioning}
    return CosmosActionCondition(
        mode=spec.mode,
        chunk_size=spec.chunk_size,
        domain_name=spec.domain,
        resolution_tier=spec.resolution_tier,
        raw_actions=raw,
        view_point=spec.viewpoint,
        **media,
    )


def action_latents(ctx, request, conditioning, generator: torch.Generator, raw: torch.Tensor | None = None):
    """(vision latents, vision condition mask, [sound stream,] action stream) from the pipeline's own
    `prepare_latents`: the padded canvas encode, the given/generated action tokens, and the noise of every
    modality in the reference's order (vision, sound, action)."""
    out = ctx.encode_helper.prepare_latents(
        enable_sound=request.sound,
        num_frames=request.num_frames,
        height=request.height,
        width=request.width,
        fps=request.fps,
        generator=generator,
        device=ctx.device,
        dtype=torch.float32,
        action=action_condition(request, conditioning, raw),
    )
    (
        latents,
        sound,
        actions,
        fps,
        fps_sound,
        vision_mask,
        sound_mask,
        action_mask,
        domain_id,
        _,
        raw_dim,
        given,
    ) = out
    streams = [ExtraStream(SOUND, sound, sound_mask, fps=fps_sound)] if request.sound else []
    streams.append(
        ExtraStream(
            ACTION, actions, action_mask, fps=fps, condition_frames=list(given), domain_id=domain_id,
            raw_action_dim=raw_dim,
        )
    )  # fmt: skip
    return latents, vision_mask, streams
