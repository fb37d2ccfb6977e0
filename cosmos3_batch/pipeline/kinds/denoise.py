"""Per-request state machine: tokenize + pack -> initial noise -> denoising steps -> VAE decode.

Each step mirrors one iteration of `Cosmos3OmniPipeline.__call__`'s loop for one request, with the
transformer forward split so that the pass loop (runner.py) can interleave many requests per layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from cosmos3_batch.io.inputs import input_stats
from cosmos3_batch.model.cosmos3 import BranchSeq
from cosmos3_batch.model.modes import ACTION, SOUND, embed_stream, head_stream
from cosmos3_batch.model.prompts import tokenize
from cosmos3_batch.model.ulysses import SeqShard
from cosmos3_batch.parallel.sequence import check_model, shard_rows
from cosmos3_batch.pipeline.kinds.context import ModelContext
from cosmos3_batch.pipeline.kinds.samplers import make_sampler
from cosmos3_batch.pipeline.kinds.step_cache.cache import GateView, StepCache, stack_output
from cosmos3_batch.pipeline.kinds.streams import ExtraStream, action_latents, mask_velocities, sound_stream

if TYPE_CHECKING:
    from cosmos3_batch.parallel.seq_group import SeqGroup
    from cosmos3_batch.requests.parse import Request


class RequestFailed(RuntimeError):
    """This request cannot be completed; the job goes on with the others."""


@dataclass
class VisionLayout:
    """The packed-sequence facts shared by a request's branches (they differ only in their text)."""

    token_shapes: list[tuple[int, int, int]]
    noisy_frame_indexes: list[torch.Tensor]
    num_noisy_tokens: int
    original_shapes: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Result:
    latents: torch.Tensor  # [1, C, T, H, W] float32: what the reference returns with output_type="latent"
    frames: np.ndarray  # [T, H, W, 3] float32 in [0, 1]: the reference's output_type="np"
    sound: torch.Tensor | None = None  # [channels, samples] float32 in [-1, 1]: the reference's `.sound`
    sample_rate: int | None = None  # of `sound`
    actions: torch.Tensor | None = None  # [T, D] float32: the reference's `.action[0]` (inverse dyn., policy)
    texts: dict | None = None  # the reasoner's caption / score of these frames (kinds/chained.py)


class RequestJob(GateView):
    def __init__(
        self, ctx: ModelContext, request: Request, und_cache: bool = True, sp: SeqGroup | None = None
    ):
        self.ctx = ctx
        self.cache: StepCache | None = None  # --cache sea: set by the runner once prepared (step_cache.py)
        self.request = request
        self.und_cache = und_cache
        # --sp: every rank of the group runs this same job on its slice of the GEN rows (model/ulysses.py).
        self.sp = sp
        self.branches: list[BranchSeq] = []
        self.streams: list[ExtraStream] = []  # sound / action tokens after the vision tokens in the GEN half
        self.step_index = 0
        self.timings: dict[str, float] = {"prepare_s": 0.0, "denoise_s": 0.0, "decode_s": 0.0}
        self.tokens = 0
        self.weight_bytes = 0.0  # this request's share of the weight traffic of the passes it rode on
        self.stall_s = 0.0
        self.error: str | None = None  # set when a layer's compute failed for this request mid-pass
        # --vae-patch-parallel-size: the request's files read ahead of `prepare` (pipeline/finish/vae_team.py)
        self.input_error: str | None = None
        self.input_stats: dict | None = None
        self._inputs: tuple | None = None
        # Admission: where latency_s starts (and queue_s ends).
        self.admitted_at = time.time()
        self.admitted_perf = time.perf_counter()
        self._denoise_started = 0.0

    @property
    def cfg(self) -> bool:
        return self.request.guidance_scale != 1.0

    @property
    def done(self) -> bool:
        return self.step_index >= len(self.timesteps)

    @property
    def last_step(self) -> bool:
        """The next finish_step is the request's last."""
        return self.step_index + 1 >= len(self.timesteps)

    @property
    def needs_encode(self) -> bool:
        """Its admission encodes conditioning frames with the VAE (an image, a video, an action canvas)."""
        r = self.request
        return r.image is not None or r.video is not None or r.action is not None

    @property
    def needs_und(self) -> bool:
        return any(b.needs_und for b in self.branches)

    # A kind that runs the parts it is handed itself (`apply_part`), not through BranchSeqs: the reasoner.
    owns_parts = False
    # A Transfer chain (pipeline/kinds/transfer/chain.py) hands work off the loop; a one-segment job does not.
    rejoins = False  # this pass, before its gates, it takes back what it handed off

    def rejoin(self) -> None:
        """Before the pass's gates: take back work handed off the loop (a Transfer chain's next chunk)."""

    def abandon(self) -> None:
        """The run stops with this job unfinished: drop work handed off and not yet started."""

    @property
    def group_encodes(self) -> int:
        """The VAE encodes its `prepare` makes (a --vae-patch-parallel-size group makes them together)."""
        return int(self.needs_encode)

    def gen_branches(self) -> list[BranchSeq]:
        """The sequences this step runs through the GEN halves (cond, and uncond under CFG: every step)."""
        return self.branches

    # ---- admission ---------------------------------------------------------------------------------

    def load_inputs(self) -> None:
        """Read the conditioning image or video (and an action file) now; a failure is kept for `prepare`."""
        r = self.request
        try:
            self.input_stats = input_stats(r)  # the files as they are read (the sidecar's `inputs`)
            media = None
            if r.image is not None:
                media = self._load_image()
            elif r.video is not None:
                media = self._load_video()
            raw = None
            if r.action is not None and r.action.actions is not None:
                from cosmos3_batch.requests.actions import load_actions

                raw = torch.from_numpy(load_actions(r.action))
            self._inputs = (media, raw)
        except Exception as exc:
            self.input_error = f"{type(exc).__name__}: {exc}"

    def _media(self):
        if self._inputs is not None:
            return self._inputs[0]
        return self._load_image() if self.request.image is not None else self._load_video()

    def prepare(self) -> None:
        if self.input_error is not None:
            raise RequestFailed(self.input_error)
        start = time.perf_counter()
        r, helper = self.request, self.ctx.helper
        cond_ids, uncond_ids = tokenize(helper, r)
        # The reference draws noise from a CPU generator seeded per request, whatever the device.
        generator = torch.Generator("cpu").manual_seed(r.seed)
        if r.action is not None:
            self.latents, self.condition_mask, self.streams = self._action_latents(generator)
        else:
            self.latents, self.condition_mask = self._initial_latents(generator)
            if r.sound:
                self.streams.append(self._sound_stream(generator))
        condition_frames = [int(i) for i in torch.nonzero(self.condition_mask[:, 0, 0] > 0).flatten()]
        prompts = [cond_ids, uncond_ids] if self.cfg else [cond_ids]
        self.branches = [self._branch(ids, condition_frames) for ids in prompts]
        self.tokens = sum(len(ids) for ids in prompts)
        self.sampler = make_sampler(self.ctx, r, generator, self.latents, self.condition_mask)
        self.scheduler = self.sampler.scheduler
        for stream in self.streams:
            stream.start(self.scheduler)
        self.timesteps = self.scheduler.timesteps
        self._timestep_values = self.timesteps.tolist()  # read on the host each step without a device sync
        self.timings["prepare_s"] = time.perf_counter() - start

    def _action_latents(self, generator: torch.Generator):
        r = self.request
        if not self.ctx.split.config.get("action_gen", False):
            raise RequestFailed(f"{r.action.mode}: this checkpoint's transformer has no action_gen")
        if r.sound:
            self._require_sound()
        raw = self._inputs[1] if self._inputs is not None else None
        with self.ctx.encode_lock:  # the canvas encode, on the encoder view: never behind a decode
            return action_latents(self.ctx, r, self._media(), generator, raw)

    def _initial_latents(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        r, ctx = self.request, self.ctx
        if r.image is None and r.video is None:
            return self._noise_latents(generator)
        if r.image is not None:
            conditioning = {"image": self._media()}
        else:
            conditioning = {
                "video": self._media(),
                "condition_frame_indexes_vision": list(r.condition_frames),
                "condition_video_keep": r.condition_video_keep,
            }
        with ctx.encode_lock:
            out = self._prepare_conditioned_latents(conditioning, generator)
        return out[0], out[5]

    def _load_image(self) -> Image.Image:
        try:
            image = Image.open(self.request.image)
            image.load()
        except OSError as exc:
            raise RequestFailed(f"cannot read image {self.request.image}: {exc}") from exc
        return image

    def _load_video(self) -> list:
        """The clip as the reference takes it: decoded by `diffusers.utils.load_video`."""
        from diffusers.utils import load_video

        r = self.request
        try:
            frames = load_video(r.video)
        except Exception as exc:  # the clip changed on disk after validation
            raise RequestFailed(f"cannot read video {r.video}: {type(exc).__name__}: {exc}") from exc
        return frames

    def _prepare_conditioned_latents(self, conditioning: dict, generator: torch.Generator):
        r, ctx = self.request, self.ctx
        return ctx.encode_helper.prepare_latents(
            **conditioning,
            num_frames=r.num_frames,
            height=r.height,
            width=r.width,
            fps=r.fps,
            generator=generator,
            device=ctx.device,
            dtype=torch.float32,
        )

    def _noise_latents(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        r, ctx = self.request, self.ctx
        # Without a conditioning image the reference encodes an all-zero video only to multiply it by a zero
        # mask: the latents are exactly the noise. Skip the encode (a full VAE pass at 720p) and draw it.
        from diffusers.utils.torch_utils import randn_tensor

        vae_cfg = ctx.vae.config
        latent_t = (r.num_frames - 1) // int(vae_cfg.scale_factor_temporal) + 1
        spatial = int(vae_cfg.scale_factor_spatial)
        shape = (1, int(vae_cfg.z_dim), latent_t, r.height // spatial, r.width // spatial)
        noise = randn_tensor(shape, generator=generator, device=ctx.device, dtype=torch.float32)
        return noise, torch.zeros((latent_t, 1, 1), device=ctx.device, dtype=torch.float32)

    def _require_sound(self) -> None:
        if self.ctx.sound_tokenizer is None or not self.ctx.split.config.get("sound_gen", False):
            raise RequestFailed("sound: this checkpoint has no sound_tokenizer or no sound_gen")

    def _sound_stream(self, generator: torch.Generator) -> ExtraStream:
        self._require_sound()
        return sound_stream(self.ctx, self.request.num_frames, self.request.fps, generator)

    def _branch(self, input_ids: list[int], condition_frames: list[int]) -> BranchSeq:
        helper, split, device = self.ctx.helper, self.ctx.split, self.ctx.device
        text = helper._prepare_text_segment(input_ids, device=device)
        vision = helper._prepare_vision_segment(
            input_vision_tokens=self.latents,
            has_image_condition=bool(condition_frames),
            mrope_offset=text["vision_start_temporal_offset"],
            vision_fps=self.request.fps,
            curr=text["und_len"],
            device=device,
            condition_frame_indexes=condition_frames,
        )
        self.layout = VisionLayout(
            token_shapes=vision["vision_token_shapes"],
            noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
            num_noisy_tokens=vision["num_noisy_vision_tokens"],
        )
        und_len = text["und_len"]
        # Packed order: [text | vision | sound | action]; extra streams share the vision mRoPE offset.
        mrope, curr = (
            [text["text_mrope_ids"], vision["vision_mrope_ids"]],
            und_len + vision["num_vision_tokens"],
        )
        for stream in self.streams:
            mrope.append(stream.segment(helper, text["vision_start_temporal_offset"], curr, und_len, device))
            curr += stream.length
        position_ids = torch.cat(mrope, dim=1)
        rot_und, rot_gen = split.rotary(position_ids, und_len, device)
        text_hidden = split.embed_text(text["input_ids"], device)
        shard = None
        if self.sp is not None:  # this rank's GEN rows; the UND half stays whole (replicated in the group)
            heads = check_model(self.sp.size, split.config)
            shard = SeqShard(self.sp, shard_rows(curr - und_len, self.sp.size), heads)
            rot_gen = (rot_gen[0][shard.local], rot_gen[1][shard.local])
        return BranchSeq(
            und_hidden=text_hidden,
            text_hidden=text_hidden,
            rot_und=rot_und,
            rot_gen=rot_gen,
            mse_rows=vision["vision_mse_loss_indexes"] - und_len,
            shard=shard,
        )

    # ---- one denoising step ------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Embed the current latents into the GEN stream; every branch starts from the same tokens."""
        if self.step_index == 0:
            self._denoise_started = time.perf_counter()
        split, layout = self.ctx.split, self.layout
        tokens = self.latents.to(device=self.ctx.device, dtype=split.dtype)
        value = self._timestep_values[self.step_index]
        timesteps = torch.full((layout.num_noisy_tokens,), value, device=self.ctx.device)
        hidden, layout.original_shapes = split.embed_vision(
            tokens, timesteps, layout.token_shapes, layout.noisy_frame_indexes
        )
        if self.streams:
            extra = [
                embed_stream(split.transformer, s.latents.to(split.dtype), value, s.layout, split.dtype)
                for s in self.streams
            ]
            hidden = torch.cat([hidden, *extra], dim=0)
        if self.cache is not None:  # the decoder stack's input, which a reusing branch adds its residual to
            self.cache.inputs = dict.fromkeys(self.cache.names, hidden)
        for branch in self.branches:
            # Under --sp every rank embeds the whole stream (cheap, and the same op as the reference) and
            # keeps its rows.
            branch.gen_hidden = hidden if branch.shard is None else hidden[branch.shard.local]

    def finish_step(self) -> None:
        """Heads, condition masks, CFG combine and this request's own scheduler step, per modality."""
        branch_velocities = [self._velocities(i, branch) for i, branch in enumerate(self.branches)]
        if self.cfg:
            cond, uncond = branch_velocities
            g = self.request.guidance_scale
            velocity = {kind: uncond[kind] + g * (cond[kind] - uncond[kind]) for kind in cond}
        else:
            velocity = branch_velocities[0]
        t = self.timesteps[self.step_index]
        self.latents = self.sampler.step(velocity["vision"], t, self.latents, self.step_index)
        for stream in self.streams:
            stream.step(velocity[stream.kind], t)
        self.step_index += 1
        if not self.und_cache:
            for branch in self.branches:  # the ablation: forget the UND K/V, redo them next pass
                branch.reset_und()
        # Wall time from the first step to this one: the passes are shared with the other active requests.
        self.timings["denoise_s"] = time.perf_counter() - self._denoise_started

    def _velocities(self, index: int, branch: BranchSeq) -> dict[str, torch.Tensor]:
        split, layout = self.ctx.split, self.layout
        normed = stack_output(self, index, branch)  # the final GEN norm's output, computed or reused
        vision = split.vision_head(
            normed, branch, layout.token_shapes, layout.noisy_frame_indexes, layout.original_shapes
        )
        extra = [head_stream(split.transformer, normed, s.layout) for s in self.streams]
        return mask_velocities(vision, self.condition_mask, self.streams, extra)

    # ---- finish ------------------------------------------------------------------------------------

    def decode(self) -> Result | None:
        """None on a rank that decodes with its group's writer (--vae-patch-parallel-size) but is not it."""
        start = time.perf_counter()
        self.branches = []  # drop the UND caches before the VAE needs the memory
        team = self.ctx.vae_team
        # A group decode: the writer's latents on every member, so that all of them decide alike below.
        latents = self.latents if team is None else team.share(self.latents)
        if not torch.isfinite(latents).all():
            raise RequestFailed("latents contain NaN or inf after denoising; nothing was written")
        helper, vae = self.ctx.helper, self.ctx.vae
        mean = helper._vae_latents_mean.to(device=latents.device, dtype=vae.dtype)
        inv_std = helper._vae_latents_inv_std.to(device=latents.device, dtype=vae.dtype)
        z_raw = latents.to(vae.dtype) / inv_std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
        with self.ctx.vae_lock:
            decoded = vae.decode(z_raw).sample if team is None else team.decode(z_raw)
        if decoded is None:
            return None
        decoded = decoded.to(latents.dtype)
        frames = helper.video_processor.postprocess_video(decoded, output_type="np")[0]
        result = Result(latents=latents.cpu(), frames=frames)
        self._decode_streams(result)
        self.timings["decode_s"] = time.perf_counter() - start
        return result

    def _decode_streams(self, result: Result) -> None:
        from cosmos3_batch.model.sound import decode_waveform

        for stream in self.streams:
            if not torch.isfinite(stream.latents).all():
                raise RequestFailed(f"{stream.kind} latents contain NaN or inf after denoising")
            if stream.kind == SOUND:
                tokenizer = self.ctx.sound_tokenizer
                with self.ctx.vae_lock:  # the finisher thread decodes; one decoder call at a time
                    result.sound = decode_waveform(tokenizer, stream.latents).float().cpu()
                result.sample_rate = int(tokenizer.config.sampling_rate)
            elif stream.kind == ACTION and self.request.action.mode in ("inverse_dynamics", "policy"):
                # Forward dynamics is given its actions: the reference returns none for it.
                result.actions = stream.latents[:, : stream.raw_action_dim].detach().cpu()
