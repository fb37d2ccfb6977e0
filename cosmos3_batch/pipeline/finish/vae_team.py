"""A request's VAE decode and encode shared by the first P ranks of its `--sp` group (DESIGN.md §15).

Decode (the finisher thread). Every rank of the group runs the same requests in lockstep, so every one
finishes them in the same order; the first P submit each to their finisher (the group's first rank writes,
the other P - 1 only decode), which therefore walks the same decodes in the same order on every member,
on a process group of its own (parallel/vae_group.py) that nothing else uses. A decode opens with a
broadcast of the writer's latents (then one of the cut), so the members decode one tensor one way;
latents that are not finite fail the request on every member alike, before any other collective. The writer
gathers the decoded frames.

Encode (the pass loop's thread, at admission: I2V / V2V conditioning and action canvases). Every rank
of the group prepares each admitted request, so every one calls the VAE's `encode`; the encode view's
VAE (pipeline/kinds/context.py) is given `VaeTeam.encode` instead, which runs the split walk on the first P
ranks over the group's own process group and broadcasts the result to all S. Before it, the runner has
read each admitted request's files on every rank and agreed on them (`agree_inputs`): a file one rank
cannot read fails that request on every rank before any encode.

A failure inside a split walk, after its first collective, leaves the members at different points of the
same sequence of messages: none of them may issue another one. The team is then broken on that rank (its
later decodes fail at once, with no collective), and the pass loop raises at its next pass, which ends
the job as a dead rank does: its peers' collectives fail on the closed connections (DESIGN.md §11, "a
compute error ends the job"). So does an error on one rank before its part in a request's encode (`prepare`):
its peers would wait in that encode, or pair it with the next request's. Bad inputs never get that far, and a
request too small to split is decoded or encoded whole after the cut's one broadcast, where an error fails it
alone: no message follows that the members could disagree on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cosmos3_batch.model.vae_patch import Shard, decode_shard, encode_shard
from cosmos3_batch.model.vae_shards import plan_cut, shard_sizes
from cosmos3_batch.parallel.vae_group import GroupBroken, PatchGroup, PeerLost
from cosmos3_batch.pipeline.kinds.denoise import RequestFailed

log = logging.getLogger("cosmos3_batch")


@dataclass
class VaeTeam:
    parts: int  # P
    vae: torch.nn.Module  # the walks read its submodules only (no per-call state on the module)
    encoding: PatchGroup  # the --sp group, its first P ranks encode (the pass loop's process group)
    decoding: PatchGroup | None = None  # this rank's decode team (the finisher's); None: not a member
    encode_vae: torch.nn.Module | None = None  # the encode view's VAE (own caches: kinds/context.py)
    broken: str | None = None  # what broke the team on this rank (its message only: no frame is kept alive)
    split_decodes: int = 0  # decodes this rank took part in that used more than one shard
    split_encodes: int = 0
    split_boundary_encodes: int = 0  # a Transfer chunk boundary's, on the decode team
    _boundary_view: object = None  # `boundary_view`'s helper pipeline, once made
    encodes: int = 0  # encodes whose messages this rank has all taken part in (`prepare` reads it)

    @property
    def decodes(self) -> bool:
        """This rank decodes (with the group's writer) every request the group finishes."""
        return self.decoding is not None

    def check(self) -> None:
        """Called by the pass loop every pass: a broken team ends the job."""
        if self.broken is not None:
            raise GroupBroken(self.broken)

    def install(self, ctx) -> None:
        """Admission's encodes (the helper pipeline's `self.vae.encode`) go through the group."""
        self.encode_vae = ctx.encode_helper.vae
        object.__setattr__(self.encode_vae, "encode", self.encode)

    # ---- decode (finisher thread) -----------------------------------------------------------------

    def share(self, latents: torch.Tensor) -> torch.Tensor:
        """The writer's latents on every member (the decode's first collective)."""
        self.check()
        return self.guarded(lambda: self.decoding.broadcast(latents.contiguous().clone(), 0))

    def decode(self, z: torch.Tensor) -> torch.Tensor | None:
        """`vae.decode(z).sample` on the writer (None on the other members)."""
        self.check()
        cut = self.guarded(lambda: self._cut(self.decoding, z.shape[-2:], z.device))
        if len(cut.sizes) == 1:  # too small to split: the writer decodes it whole, as without the flag (no
            # message follows: an error fails this request alone)
            return self.vae.decode(z).sample if self.decoding.index == 0 else None
        return self.guarded(lambda: self._decode(z, cut))

    def _decode(self, z: torch.Tensor, cut: Shard) -> torch.Tensor | None:
        group = self.decoding
        if group.index >= len(cut.sizes):
            return None
        self.split_decodes += 1
        exchange = group.bind(cut)
        shard = exchange.shard
        return exchange.collect(decode_shard(self.vae, shard.of(z), shard, exchange), cut.dim)

    # ---- encode (pass loop thread) ----------------------------------------------------------------

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        """AutoencoderKLWan.encode's output for a video [1, 3, T, H, W], on every rank of the --sp group."""
        return self._encode_output(self.encoding, self.encode_vae, x, return_dict)

    def _encode_output(
        self, group: PatchGroup, whole_vae: torch.nn.Module, x: torch.Tensor, return_dict: bool
    ):
        """`encode`'s result through `group` (its first P ranks walk the split encoder; all of it receives
        the result); `whole_vae` encodes a video too small to split, on every rank of `group`."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.models.modeling_outputs import AutoencoderKLOutput

        self.check()
        spatial = int(self.vae.config.scale_factor_spatial)
        latent_hw = (x.shape[3] // spatial, x.shape[4] // spatial)
        cut = self.guarded(lambda: self._cut(group, latent_hw, x.device))
        # Each counter has one writer thread: `encodes` and `split_encodes` the loop's (admission through
        # `encoding`), `split_boundary_encodes` the finisher's (a chunk boundary through `decoding`). A `+= 0`
        # from the other thread would still be a read-modify-write that can lose the loop's increment.
        loop = group is self.encoding
        if len(cut.sizes) == 1:  # every rank encodes it whole, as without the flag (no message follows: an
            # error fails this request alone, so its messages are done here)
            if loop:
                self.encodes += 1
            h = type(whole_vae)._encode(whole_vae, x)
        else:
            h = self.guarded(lambda: self._encode(group, x, cut, spatial))
            if loop:
                self.encodes += 1
                self.split_encodes += 1
            else:
                self.split_boundary_encodes += 1
        posterior = DiagonalGaussianDistribution(h)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    def _encode(self, group: PatchGroup, x: torch.Tensor, cut: Shard, spatial: int) -> torch.Tensor:
        config = self.vae.config
        whole = None
        if group.index < len(cut.sizes):
            exchange = group.bind(cut)
            shard = exchange.shard
            whole = exchange.collect(encode_shard(self.vae, shard.of(x, spatial), shard, exchange), cut.dim)
        if whole is None:
            frames = 1 + (x.shape[2] - 1) // int(config.scale_factor_temporal)
            shape = (x.shape[0], 2 * int(config.z_dim), frames, x.shape[3] // spatial, x.shape[4] // spatial)
            whole = x.new_empty(shape)
        return group.broadcast(whole, 0)

    # ---- a Transfer chunk boundary (finisher thread, decode members only) ---------------------------

    def boundary_view(self, helper):
        """A view of the helper pipeline whose VAE encodes through the decode team (the finisher thread's
        group): a chunk boundary's encodes, in order with the team's decodes on every member. Made once."""
        if self._boundary_view is None:
            from cosmos3_batch.pipeline.kinds.context import encoder_view

            view = encoder_view(helper, self.vae)

            def encode(x: torch.Tensor, return_dict: bool = True):
                return self._encode_output(self.decoding, view.vae, x, return_dict)

            object.__setattr__(view.vae, "encode", encode)
            self._boundary_view = view
        return self._boundary_view

    def share_tail(self, frames: torch.Tensor | None, count: int, size: tuple[int, int], device):
        """The last `count` of the writer's decoded frames (float32 [1, 3, count, H, W]) on every member: what
        the next chunk's target is seeded with (None when it takes none)."""
        if count == 0:
            return None
        self.check()
        if frames is not None:
            buffer = frames[:, :, -count:].contiguous()
        else:
            buffer = torch.empty((1, 3, count, *size), dtype=torch.float32, device=device)
        return self.guarded(lambda: self.decoding.broadcast(buffer, 0))

    # ---- both -------------------------------------------------------------------------------------

    def _cut(self, group: PatchGroup, latent_hw, device: torch.device) -> Shard:
        """The cut every member uses: the first rank's (one broadcast), so that no difference between the
        ranks' settings (an intra-op thread count) can make them walk differently."""
        cut = plan_cut(tuple(int(v) for v in latent_hw), self.parts, device)
        used = group.share_int(len(cut.sizes))
        return cut if used == len(cut.sizes) else _with_parts(cut, used)

    def prepare(self, job) -> None:
        """`job.prepare()` at admission. Every rank of the group takes part in each request's encode, in
        order: an error on this rank before its part in it (preprocessing, the copy to the device) would leave
        its peers waiting there, or pair them with the next request's, so it ends the job. RequestFailed is
        raised on every rank alike (the agreed inputs, the checkpoint's modes) and fails the request alone, as
        does any error once the encode's messages are done (the runner's agreement then drops it on every
        rank)."""
        done = self.encodes
        try:
            job.prepare()
        except (RequestFailed, GroupBroken):
            raise
        except Exception as exc:
            if self.encodes - done < job.group_encodes:  # before or between its encodes (Transfer: several)
                what = f"request {job.request.id} failed on this rank before its group encodes were done"
                raise GroupBroken(f"{what}: {type(exc).__name__}: {exc}") from exc
            raise

    def guarded(self, step):
        """`step()`, a VAE walk over the team's messages (or several, with work of this rank's own between
        them: a Transfer chunk boundary): any error in it breaks the team, so no later message is sent."""
        try:
            return step()
        except GroupBroken:  # an inner walk's: the team is broken already
            raise
        except Exception as exc:
            if isinstance(exc, PeerLost):
                what = f"a message failed: a peer rank died or stalled past --collective-timeout-s ({exc})"
            else:
                what = f"failed on this rank: {type(exc).__name__}: {exc}"
            self.broken = f"a group VAE walk broke midway, {what}"
            log.error("%s; the job ends", self.broken)
            raise GroupBroken(self.broken) from exc


def _with_parts(cut: Shard, used: int) -> Shard:
    return Shard(cut.dim, shard_sizes(sum(cut.sizes), 1, used, min_pixels=1), 0)


def agree_inputs(jobs: list, seq_group) -> None:
    """Read each admitted request's files on this rank, then one agree over the --sp group: a request whose
    files one rank cannot read fails on every rank (`job.input_error`), before any encode. Nothing (no
    collective) when no request needs an encode."""
    if not any(job.needs_encode for job in jobs):
        return
    for job in jobs:
        job.load_inputs()
    agreed = seq_group.agree([job.input_error is None for job in jobs])
    for job, ok in zip(jobs, agreed, strict=True):
        if not ok and job.input_error is None:
            job.input_error = "its inputs could not be read on another rank of its --sp group"


def build_team(ctx, parts: int, seq_group, decode_group: PatchGroup | None) -> VaeTeam | None:
    """The team of this rank (None at P = 1): the --sp group's process group for encodes."""
    if parts == 1:
        return None
    from cosmos3_batch.parallel.vae_group import encode_group

    encoding = encode_group(seq_group.group, seq_group.rank, seq_group.size, parts, seq_group.device)
    team = VaeTeam(parts, ctx.vae, encoding, decode_group)
    team.install(ctx)
    return team
