"""A Transfer request's state machine (DESIGN.md §17): a chain of chunks, each denoised with the branches
its step asks for (plan/branches.py), as `Cosmos3OmniModularPipeline` runs `Cosmos3OmniBlocks` with
`control_videos`.

The layers see ordinary `BranchSeq`s. Two texts are prefilled (cond, and uncond when text guidance is ever
on); the GEN branches (cond over [controls..., target], cond over [target], uncond over [controls...,
target]) read the K/V list of their text's UND branch, so cond and its no-control twin share one prefill.
A step hands the layers only its own branches (`gen_branches`). At a chunk boundary the chain keeps its slot
but computes nothing for `gap` passes while the finisher thread decodes the chunk and encodes the next one's
inputs on this rank (the other requests keep the passes busy); then it rejoins with the next chunk. The text
K/V stay (the texts do not change).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from cosmos3_batch.model.cosmos3 import BranchSeq
from cosmos3_batch.model.prompts import tokenize_transfer
from cosmos3_batch.parallel.stall import peer_failure
from cosmos3_batch.parallel.vae_group import GroupBroken
from cosmos3_batch.pipeline.kinds.denoise import RequestFailed, RequestJob, Result
from cosmos3_batch.pipeline.kinds.samplers import UniPCSampler
from cosmos3_batch.pipeline.kinds.transfer import chunks
from cosmos3_batch.pipeline.kinds.transfer.inputs import host_inputs
from cosmos3_batch.pipeline.kinds.transfer.pack import GenBranch, pack, text_branch
from cosmos3_batch.plan.branches import (
    COND,
    COND_NO_CONTROL,
    UNCOND,
    StepBranches,
    texts_needed,
    transfer_plan,
)

# Each GEN branch: (name, the text whose K/V it reads, over the controls too).
BRANCHES = ((COND, COND, True), (COND_NO_CONTROL, COND, False), (UNCOND, UNCOND, True))


class TransferJob(RequestJob):
    # Set by the runner at admission:
    gap = 0  # passes sat out at each chunk boundary (PrefillRule.chunk_gap)
    hand_off: Callable[[Callable[[], Any]], Future] | None = None  # Finisher.hand_off: crosses a boundary
    keeps_output = True  # False on the ranks of an --sp group that never write: no pieces kept there
    ahead: Future | None = None  # its HostInputs, being prepared off the loop (transfer/inputs.py)

    @property
    def rejoins(self) -> bool:
        return self._boundary is not None and not self.away

    @property
    def group_encodes(self) -> int:
        return len(self.spec.controls) + 1  # the first chunk's, at admission

    @property
    def done(self) -> bool:
        return self.chunk_id == self.spec.num_chunks - 1 and self.step_index >= len(self.timesteps)

    @property
    def last_step(self) -> bool:
        return self.chunk_id == self.spec.num_chunks - 1 and self.step_index + 1 >= len(self.timesteps)

    @property
    def needs_encode(self) -> bool:
        return True

    @property
    def spec(self):
        return self.request.transfer

    def gen_branches(self) -> list[BranchSeq]:
        if self.away or self._boundary is not None:  # sitting out a chunk boundary: nothing to compute
            return []
        return [self.gen[name].seq for name in self.plan[self.step_index].names]

    # ---- admission ---------------------------------------------------------------------------------

    def load_inputs(self) -> None:
        """The controls read, preprocessed and padded, and the seed video: prepared ahead of admission on its
        own thread when the runner started them (`ahead`, transfer/inputs.py), else now; a failure is kept
        for `prepare`."""
        try:
            if self.ahead is not None:
                self._inputs = self.ahead.result()  # waits only if not ready yet
            else:
                self._inputs = host_inputs(self.ctx.helper, self.request, self.ctx.split.dtype)
        except Exception as exc:
            self.input_error = f"{type(exc).__name__}: {exc}"
        self.ahead = None

    def prepare(self) -> None:
        if self._inputs is None:
            self.load_inputs()
        if self.input_error is not None:
            raise RequestFailed(self.input_error)
        start = time.perf_counter()
        r, ctx = self.request, self.ctx
        self.generator = torch.Generator("cpu").manual_seed(r.seed)
        self.controls = self._inputs.controls  # in the transformer's dtype, as the setup step casts them
        self.pieces: list[torch.Tensor] = []
        self.chunk_latents: list[torch.Tensor] = []
        self.chunk_id = 0
        self.away = 0  # passes left to sit out at a chunk boundary (the gap)
        self._boundary: Future | None = None  # the boundary being crossed off the loop
        self.timings["boundary_wait_s"] = 0.0
        self.vae_calls = {"chunks": self.spec.num_chunks, "decodes": 0, "encodes": 0}  # the sidecar's
        self._enter(*self._chunk_start(0, None, ctx.encode_helper, ctx.encode_lock))
        # Every chunk's fresh scheduler has these timesteps: read on the host once, here (a device sync at
        # admission, as any request's), not at each rejoin.
        self._timestep_values = self.timesteps.tolist()
        spec = self.spec
        self.plan: list[StepBranches] = transfer_plan(
            self._timestep_values,
            r.guidance_scale,
            spec.control_guidance,
            spec.guidance_interval,
            spec.control_guidance_interval,
        )
        cond_ids, uncond_ids = tokenize_transfer(ctx.helper, r)
        ids = {COND: cond_ids, UNCOND: uncond_ids}
        self.texts = {name: text_branch(ctx, self.sp, ids[name]) for name in texts_needed(self.plan)}
        self.branches = [text.seq for text in self.texts.values()]  # the UND prefills
        self.tokens = sum(len(ids[name]) for name in self.texts)
        self.gen = self._branches(self.state)
        self.timings["prepare_s"] = time.perf_counter() - start

    def _chunk_start(self, chunk_id: int, previous, encoder, lock) -> tuple[chunks.ChunkState, UniPCSampler]:
        """A chunk's control window and seeded target encoded, its noise drawn, a fresh scheduler. Touches
        only what it returns, the chain's generator and its VAE call count: the finisher thread runs it at a
        boundary (`encoder`: a helper pipeline whose VAE that thread may use, `lock` that VAE's)."""
        r, ctx, spec = self.request, self.ctx, self.spec
        vae_dtype = ctx.vae.dtype
        if chunk_id == 0:
            seed = self._inputs.seed  # the seed video preprocessed, or None
            frames, tail = spec.first_chunk_conditional_frames, False
        else:
            seed, frames, tail = previous, spec.conditional_frames, True
        size = (r.height, r.width)
        target, current = chunks.seed_target(
            spec.chunk_frames, size, vae_dtype, ctx.device, seed, frames, tail
        )
        window = (chunk_id * spec.stride, spec.chunk_frames, r.num_frames)
        with lock:
            controls, x0 = chunks.chunk_inputs(encoder, self.controls, target, window)
        self.vae_calls["encodes"] += len(controls) + 1
        temporal = int(ctx.vae.config.scale_factor_temporal)
        latents, mask, clean, indexes = chunks.chunk_noise(x0, current, temporal, self.generator, ctx.device)
        # Cosmos3TransferSetTimestepsStep: set_timesteps on the pipeline's scheduler, per chunk, never the
        # native flow schedule; a fresh scheduler per chunk is the same state.
        sampler = UniPCSampler(ctx, r, native_schedule=False)
        return chunks.ChunkState(controls, latents, mask, clean, indexes, current), sampler

    def _enter(self, state: chunks.ChunkState, sampler: UniPCSampler) -> None:
        """Make `state` the chunk the steps work on (the pass loop's thread)."""
        self.state, self.latents = state, state.latents
        self.sampler = sampler
        self.scheduler = sampler.scheduler
        self.timesteps = self.scheduler.timesteps
        self.step_index = 0

    def _branches(self, state: chunks.ChunkState) -> dict[str, GenBranch]:
        """The GEN sequences of a chunk's steps (any thread: they read only the texts' fixed parts)."""
        wanted = {name for step in self.plan for name in step.names}
        return {
            name: pack(self.ctx, self.sp, self.request.fps, self.texts[text], state, full)
            for name, text, full in BRANCHES
            if name in wanted
        }

    # ---- one denoising step ------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Embed [controls..., target] and, for the no-control branch, [target] alone at this timestep."""
        if self.away:
            return
        if self.step_index == 0 and self.chunk_id == 0:
            self._denoise_started = time.perf_counter()
        split, device = self.ctx.split, self.ctx.device
        value = self._timestep_values[self.step_index]
        target = self.latents.to(device=device, dtype=split.dtype)
        controls = [c.to(device=device, dtype=split.dtype) for c in self.state.control_latents]
        hidden: dict[bool, tuple[torch.Tensor, list]] = {}  # by "over the controls too"
        for name in self.plan[self.step_index].names:
            branch = self.gen[name]
            if branch.full not in hidden:
                layout = branch.layout
                timesteps = torch.full((layout.num_noisy_tokens,), value, device=device)
                items = [*controls, target] if branch.full else [target]
                hidden[branch.full] = split.embed_vision(
                    items, timesteps, layout.token_shapes, layout.noisy_frame_indexes
                )
            whole, branch.layout.original_shapes = hidden[branch.full]
            shard = branch.seq.shard  # --sp: every rank embeds the whole stream and keeps its rows
            branch.seq.gen_hidden = whole if shard is None else whole[shard.local]

    def finish_step(self) -> None:
        """Heads, the nested control/text combine, the scheduler step and the re-pin of conditioned frames;
        after a chunk's last step, its boundary is handed off the loop."""
        if self.away:
            self.away -= 1
            if not self.und_cache:
                self._forget_und()
            return
        step = self.plan[self.step_index]
        split = self.ctx.split
        preds = {}
        for name in step.names:
            branch = self.gen[name]
            layout = branch.layout
            if branch.seq.shard is not None:  # the heads read rows by their index in the whole stream
                branch.seq.gen_hidden = branch.seq.shard.gather(branch.seq.gen_hidden)
            normed = split.final_norm(branch.seq)
            preds[name] = split.vision_head(
                normed, branch.seq, layout.token_shapes, layout.noisy_frame_indexes, layout.original_shapes
            ).float()
        velocity = chunks.combine(preds, step) * self.state.velocity_mask
        t = self.timesteps[self.step_index]
        latents = self.sampler.step(velocity, t, self.latents, self.step_index)
        mask = self.state.velocity_mask
        self.latents = mask * latents + (1.0 - mask) * self.state.condition_latents
        self.step_index += 1
        if not self.und_cache:
            self._forget_und()
        self.timings["denoise_s"] = time.perf_counter() - self._denoise_started
        if self.step_index >= len(self.timesteps) and self.chunk_id < self.spec.num_chunks - 1:
            self._leave()

    def _forget_und(self) -> None:
        """The --no-und-cache ablation: the texts' K/V are recomputed next pass, the branches relinked."""
        for text in self.texts.values():
            text.seq.reset_und()
        self._relink()

    def _relink(self) -> None:
        for name, branch in self.gen.items():  # each GEN branch reads its text's current K/V list
            branch.seq.und_kv = self.texts[UNCOND if name == UNCOND else COND].seq.und_kv

    # ---- a chunk boundary, off the loop ------------------------------------------------------------

    def _leave(self) -> None:
        """The chain keeps its slot and computes nothing for `gap` passes (the same count on every rank and in
        the simulator) while the finisher thread decodes this chunk and encodes the next one."""
        self.away = self.gap
        latents = self.latents
        if self.hand_off is not None:
            self._boundary = self.hand_off(lambda: self._cross(latents))
            return
        self._boundary = Future()  # no finisher (a bare job): cross it here
        try:
            self._boundary.set_result((self._cross(latents), None))
        except Exception as exc:
            self._boundary.set_exception(exc)

    def _cross(self, latents: torch.Tensor) -> tuple:
        """On the finisher thread: decode the chunk, keep its piece, seed the next chunk with its tail, encode
        that one's inputs and pack its branches (the chain's generator and scheduler state live on this
        rank). A member of a --vae-patch-parallel-size decode team walks the VAE with the team, in order with
        its decodes; every other rank walks it whole (the split walk's bits are the whole one's)."""
        started = time.perf_counter()
        ctx, team = self.ctx, self.ctx.vae_team
        if team is None or not team.decodes:
            state, sampler = self._chunk_start(
                self.chunk_id + 1, self._decode_chunk(latents), ctx.helper, ctx.vae_lock
            )
        else:  # an error between the team's messages on one member only breaks the team (no message after)
            state, sampler = team.guarded(lambda: self._cross_with(team, latents))
        out = state, sampler, self._branches(state)
        self.timings["decode_s"] += time.perf_counter() - started
        return out

    def _cross_with(self, team, latents: torch.Tensor) -> tuple:
        ctx = self.ctx
        pixels = self._decode_chunk(team.share(latents), team.decode)  # the frames on the writer only
        size = (self.request.height, self.request.width)
        previous = team.share_tail(pixels, self.spec.conditional_frames, size, ctx.device)
        return self._chunk_start(self.chunk_id + 1, previous, team.boundary_view(ctx.helper), ctx.vae_lock)

    def rejoin(self) -> None:
        """Before the pass's gates, once the gap is over: take the next chunk from the finisher thread
        (waiting for it if it is not done yet: boundary_wait_s; raises what crossing it raised)."""
        if not self.rejoins:
            return
        started = time.perf_counter()
        try:
            (state, sampler, gen), done = self._boundary.result()
        finally:
            self._boundary = None
            self.timings["boundary_wait_s"] += time.perf_counter() - started
        if done is not None:  # its kernels ran on the finisher's stream
            torch.cuda.current_stream(self.ctx.device).wait_event(done)
        self.chunk_id += 1
        self._enter(state, sampler)
        self.gen = gen
        self._relink()

    def abandon(self) -> None:
        """The run stops: a boundary not yet started is not crossed (without a VAE team: with one, every
        member must walk the same messages, and which have started differs between them)."""
        if self._boundary is not None and self.ctx.vae_team is None:
            self._boundary.cancel()

    def _decode_chunk(self, latents: torch.Tensor, decode=None) -> torch.Tensor | None:
        """Decode a chunk and keep its piece and latents; None on a member of a --vae-patch-parallel-size
        group that is not its writer (`decode`: the group's)."""
        if not torch.isfinite(latents).all():
            raise RequestFailed(f"chunk {self.chunk_id}: latents contain NaN or inf; nothing was written")
        with self.ctx.vae_lock:
            pixels = chunks.decode_chunk(self.ctx.helper, self.ctx.vae, latents, decode)
        if pixels is None:
            return None
        self.vae_calls["decodes"] += 1
        if self.keeps_output:
            self.chunk_latents.append(latents.cpu())
            piece = pixels if self.chunk_id == 0 else pixels[:, :, self.state.conditional_frames :]
            self.pieces.append(piece.cpu())  # until the stitch: host memory, not the device's
        return pixels

    # ---- finish ------------------------------------------------------------------------------------

    def decode(self) -> Result | None:
        """The last chunk decoded and every chunk stitched; latents: every chunk's, [chunks, C, T, H, W]. None
        on a rank that decodes with its --vae-patch-parallel-size group's writer but is not it."""
        start = time.perf_counter()
        self.branches, self.gen = [], {}
        team = self.ctx.vae_team
        if team is None:
            self._decode_chunk(self.latents)
        elif self._decode_chunk(team.share(self.latents), team.decode) is None:
            return None  # the last chunk decoded with the team; the writer stitches
        frames = chunks.stitch(self.ctx.helper, self.pieces, self.request.num_frames)
        self.timings["decode_s"] += time.perf_counter() - start
        return Result(latents=torch.cat(self.chunk_latents, dim=0), frames=frames)


def rejoin(active: list[RequestJob], sp) -> tuple[list[RequestJob], list[tuple[RequestJob, str]]]:
    """Chains whose gap ends take their next chunk: (the jobs kept, the (job, error) that failed at their
    boundary). Under --sp the group agrees first (a chain rejoins on the same pass on every rank of its group,
    and a non-finite chunk fails on each alike), unless its decode team broke: that ends the job."""
    returning = [job for job in active if job.rejoins]
    if not returning:
        return active, []
    errors = []
    for job in returning:
        try:
            job.rejoin()
            errors.append(None)
        except GroupBroken:
            raise
        except Exception as exc:
            if peer_failure(exc) is not None:  # the boundary's device work met a lost peer: the job's end
                raise
            errors.append(f"{type(exc).__name__}: {exc}")
    if sp is not None:
        agreed = sp.agree([error is None for error in errors])
        other = "failed at a chunk boundary on another rank of its --sp group"
        errors = [e if e is not None or ok else other for e, ok in zip(errors, agreed, strict=True)]
    failed = [(job, error) for job, error in zip(returning, errors, strict=True) if error is not None]
    gone = {id(job) for job, _ in failed}
    return [job for job in active if id(job) not in gone], failed
