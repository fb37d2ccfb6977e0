"""The Wan VAE's decode and encode on one spatial shard (`--vae-patch-parallel-size`, DESIGN.md §15).

The P ranks of a group each hold a contiguous slice of the latent's longer spatial side and run diffusers'
`AutoencoderKLWan` submodules on it, in the order its own `_decode` / `_encode` run them (this file mirrors
`WanDecoder3d`, `WanEncoder3d`, `WanResidualUpBlock`, `WanResidualDownBlock`, `WanMidBlock`,
`WanResidualBlock`, `WanResample` and `WanCausalConv3d` of diffusers 0.42, line for line):

* everything per pixel runs on the shard as it is: `WanRMS_norm` (over channels), SiLU, the residual adds,
  nearest upsampling, `DupUp3D` / `AvgDown3D` (the shortcuts move whole 2x2 pixel groups: a shard's start
  is a multiple of every stage's factor), patchify / unpatchify, the temporal caches (`CACHE_T` frames of
  every causal convolution's input: each rank keeps its own rows of them) and the final clamp;
* every convolution with a spatial kernel first takes its halo (the neighbours' edge rows, `Exchange.halo`)
  and pads with zeros only at the global edges, the way the reference pads: explicitly for the causal
  convolutions (F.pad, then no padding in the call) and the downsampling (ZeroPad2d), implicitly for the
  upsampling's Conv2d (padding=1 in the call: the rows it pads at a shard's inner edge are the halo's and
  are cut from the output);
* the mid block's attention (one head over each frame's H x W) runs on the whole frame
  (`Exchange.on_whole`), so it is the reference's own call.

A rank's rows then see exactly the values the unsplit decode computes for them. Where a CPU kernel would
round them differently because the call is smaller, vae_exact.py computes them as the whole's call does;
vae_shards.py decides the cut. The transport is behind `Exchange`: this module never imports
torch.distributed (parallel/vae_group.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from cosmos3_batch.model.vae_exact import conv_as_in_whole, mean_as_in_whole, silu_as_in_whole

CACHE_T = 2  # diffusers' autoencoder_kl_wan.CACHE_T: frames of each causal convolution's input kept


class Exchange(Protocol):
    """What the shards of one decode (or encode) say to each other. Every used shard calls these in the same
    order with tensors of the same shape except along `dim` (the walk is the same on every shard)."""

    def halo(self, x: torch.Tensor, dim: int, before: int, after: int) -> tuple[torch.Tensor | None, ...]:
        """(the previous shard's last `before` rows of x, the next shard's first `after` rows); None at a
        global edge (or when the count is 0)."""
        ...

    def on_whole(self, x: torch.Tensor, dim: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """This shard's rows of fn(the whole tensor along dim)."""
        ...

    def collect(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """The whole tensor along dim on the first shard's rank (None on the others)."""
        ...


@dataclass(frozen=True)
class Shard:
    """One rank's slice of a latent: rows [start, start + rows) of `dim` (3: height, 4: width)."""

    dim: int
    sizes: tuple[int, ...]  # latent rows of every used shard, in rank order (all > 0)
    index: int

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.index])

    @property
    def rows(self) -> int:
        return self.sizes[self.index]

    def of(self, x: torch.Tensor, scale: int = 1) -> torch.Tensor:
        """This shard's rows of a whole tensor whose `dim` is `scale` x the latent's (pixels: the VAE's
        spatial factor)."""
        return x.narrow(self.dim, self.start * scale, self.rows * scale).contiguous()


class _Walk:
    """One decode or encode of one shard: the per-call feature cache and the halo'd convolutions."""

    def __init__(self, shard: Shard, exchange: Exchange):
        self.dim = shard.dim
        self.shard = shard
        self.ex = exchange
        self.cache: dict[int, object] = {}  # diffusers' feat_cache, by the same running index
        self.idx = 0

    # ---- convolutions -----------------------------------------------------------------------------

    def _with_halo(self, x: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
        """x with its neighbours' rows before and after along dim, zeros where there is no neighbour."""
        if not before and not after:
            return x
        top, bottom = self.ex.halo(x, dim, before, after)
        parts = []
        for rows, got in ((before, top), (after, bottom)):
            if rows and got is None:
                shape = list(x.shape)
                shape[dim] = rows
                got = x.new_zeros(shape)
            parts.append(got if rows else None)
        return torch.cat([p for p in (parts[0], x, parts[1]) if p is not None], dim)

    def causal(self, conv: nn.Conv3d, x: torch.Tensor, cache=None) -> torch.Tensor:
        """WanCausalConv3d.forward: time padded causally (after the cache), then the spatial zero pads of the
        split side replaced by the halo, then the call with no padding."""
        padding = list(conv._padding)  # (w, w, h, h, 2 * t, 0)
        if cache is not None and padding[4] > 0:
            x = torch.cat([cache.to(x.device), x], dim=2)
            padding[4] -= cache.shape[2]
        side = 2 if self.dim == 3 else 0
        before, after = padding[side], padding[side + 1]
        padding[side] = padding[side + 1] = 0
        x = F.pad(x, padding)
        rows = x.shape[self.dim]
        return self._conv(conv, self._with_halo(x, self.dim, before, after), self.dim, rows, before + after)

    def cached(self, conv: nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
        """The feat_cache step every causal convolution of the decoder and encoder takes."""
        idx = self.idx
        previous = self.cache.get(idx)
        cache_x = x[:, :, -CACHE_T:, :, :].clone()
        if cache_x.shape[2] < 2 and previous is not None:
            cache_x = torch.cat([previous[:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
        x = self.causal(conv, x, previous)
        self.cache[idx] = cache_x
        self.idx += 1
        return x

    def _same2d(self, conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        """A Conv2d with implicit padding p on [N, C, H, W]: called as the reference calls it, on the shard
        with its halo; the output rows of the halo (padded by the call, not by the data) are cut."""
        dim = self.dim - 1
        pad = conv.padding[dim - 2]
        top, bottom = self.ex.halo(x, dim, pad, pad) if pad else (None, None)
        extended = torch.cat([p for p in (top, x, bottom) if p is not None], dim)
        y = self._conv(conv, extended, dim, x.shape[dim], 0)
        cut_top = pad if top is not None else 0
        cut_bottom = pad if bottom is not None else 0
        return y.narrow(dim, cut_top, y.shape[dim] - cut_top - cut_bottom).contiguous()

    def _down2d(self, zero_pad: nn.ZeroPad2d, conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        """ZeroPad2d((0, 1, 0, 1)) then a stride-2 Conv2d: the row after a shard is its neighbour's first."""
        dim = self.dim - 1
        padding = list(zero_pad.padding)  # (left, right, top, bottom)
        side = 2 if dim == 2 else 0
        before, after = padding[side], padding[side + 1]
        padding[side] = padding[side + 1] = 0
        extended = self._with_halo(F.pad(x, padding), dim, before, after)
        return self._conv(conv, extended, dim, x.shape[dim], before + after)

    def _conv(self, conv: nn.Module, x: torch.Tensor, dim: int, rows: int, padded: int) -> torch.Tensor:
        """`conv` on x, whose `dim` holds `rows` rows of this shard and halo or zero rows around them; the
        unsplit call's input holds the whole's rows and `padded` more. On CPU, with the unsplit call's
        kernel."""
        shard = self.shard
        if x.device.type != "cpu" or len(shard.sizes) == 1:
            return conv._conv_forward(x, conv.weight, conv.bias)
        whole = list(x.shape)
        whole[dim] = rows // shard.rows * sum(shard.sizes) + padded
        return conv_as_in_whole(conv, x, whole, dim, shard.index == len(shard.sizes) - 1)

    def _resample2d(self, seq: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(seq, nn.Identity):
            return x
        first, conv = seq[0], seq[1]
        if isinstance(first, nn.ZeroPad2d):
            return self._down2d(first, conv, x)
        return self._same2d(conv, first(x))  # WanUpsample (nearest-exact x2: row i reads row i // 2)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """F.silu with each element rounded as the unsplit call rounds it (see `silu_as_in_whole`)."""
        shard = self.shard
        if x.device.type != "cpu" or len(shard.sizes) == 1:
            return F.silu(x)
        scale = x.shape[self.dim] // shard.rows
        return silu_as_in_whole(x, self.dim, shard.start * scale, sum(shard.sizes) * scale)

    # ---- blocks -----------------------------------------------------------------------------------

    def resblock(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shortcut = block.conv_shortcut
        h = x if isinstance(shortcut, nn.Identity) else self.causal(shortcut, x)
        x = self.silu(block.norm1(x))
        x = self.cached(block.conv1, x)
        x = block.dropout(self.silu(block.norm2(x)))
        x = self.cached(block.conv2, x)
        return x + h

    def resample(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.size()
        if mod.mode == "upsample3d":
            x = self._time_upsample(mod, x)
        t = x.shape[2]
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        x = self._resample2d(mod.resample, x)
        x = x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)
        if mod.mode == "downsample3d":
            idx, previous = self.idx, self.cache.get(self.idx)
            if previous is None:
                self.cache[idx] = x.clone()
            else:
                cache_x = x[:, :, -1:, :, :].clone()
                x = self.causal(mod.time_conv, torch.cat([previous[:, :, -1:, :, :], x], 2))
                self.cache[idx] = cache_x
            self.idx += 1
        return x

    def _time_upsample(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """WanResample's upsample3d time_conv: the first latent frame is not doubled ("Rep")."""
        b, c, t, h, w = x.size()
        idx, previous = self.idx, self.cache.get(self.idx)
        self.idx += 1
        if previous is None:
            self.cache[idx] = "Rep"
            return x
        rep = isinstance(previous, str)
        cache_x = x[:, :, -CACHE_T:, :, :].clone()
        if cache_x.shape[2] < 2 and not rep:
            cache_x = torch.cat([previous[:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
        if cache_x.shape[2] < 2 and rep:
            cache_x = torch.cat([torch.zeros_like(cache_x).to(cache_x.device), cache_x], dim=2)
        x = self.causal(mod.time_conv, x, None if rep else previous)
        self.cache[idx] = cache_x
        x = x.reshape(b, 2, c, t, h, w)
        x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
        return x.reshape(b, c, t * 2, h, w)

    def mid(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = self.resblock(block.resnets[0], x)
        for attn, resnet in zip(block.attentions, block.resnets[1:], strict=True):
            if attn is not None:  # one head over the whole frame: the reference's own call, on the whole
                x = self.ex.on_whole(x, self.dim, attn)
            x = self.resblock(resnet, x)
        return x

    def up_block(self, block: nn.Module, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        x_copy = x.clone()
        for resnet in block.resnets:
            x = self.resblock(resnet, x)
        if block.upsampler is not None:
            x = self.resample(block.upsampler, x)
        if block.avg_shortcut is not None:
            x = x + block.avg_shortcut(x_copy, first_chunk=first_chunk)
        return x

    def down_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x_copy = x.clone()
        for resnet in block.resnets:
            x = self.resblock(resnet, x)
        if block.downsampler is not None:
            x = self.resample(block.downsampler, x)
        return x + self._avg_down(block.avg_shortcut, x_copy)

    def _avg_down(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """AvgDown3D.forward, on CPU its mean taken as in the whole (`mean_as_in_whole`)."""
        if len(self.shard.sizes) == 1 or x.device.type != "cpu":
            return mod(x)
        ft, fs = mod.factor_t, mod.factor_s
        x = F.pad(x, (0, 0, 0, 0, (ft - x.shape[2] % ft) % ft, 0))
        b, c, t, h, w = x.shape
        x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs)
        x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
        x = x.view(b, mod.out_channels, mod.group_size, t // ft, h // fs, w // fs)
        rows = x.shape[self.dim + 1] // self.shard.rows
        return mean_as_in_whole(x, self.dim + 1, self.shard.start * rows, sum(self.shard.sizes) * rows)

    def decoder(self, decoder: nn.Module, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        """WanDecoder3d.forward for one latent frame."""
        self.idx = 0
        x = self.cached(decoder.conv_in, x)
        x = self.mid(decoder.mid_block, x)
        for block in decoder.up_blocks:
            x = self.up_block(block, x, first_chunk)
        x = self.silu(decoder.norm_out(x))
        return self.cached(decoder.conv_out, x)

    def encoder(self, encoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """WanEncoder3d.forward for one chunk of frames."""
        self.idx = 0
        x = self.cached(encoder.conv_in, x)
        for block in encoder.down_blocks:
            x = self.down_block(block, x)
        x = self.mid(encoder.mid_block, x)
        x = self.silu(encoder.norm_out(x))
        return self.cached(encoder.conv_out, x)


def decode_shard(vae: nn.Module, z: torch.Tensor, shard: Shard, exchange: Exchange) -> torch.Tensor:
    """`AutoencoderKLWan._decode` (untiled) of this shard's rows `z` of the latent [1, C, T, rows, W] (or
    [.., H, rows]): its rows of the clamped frames, spatial factor x rows long."""
    walk = _Walk(shard, exchange)
    x = walk.causal(vae.post_quant_conv, z)
    frames = [walk.decoder(vae.decoder, x[:, :, i : i + 1, :, :], i == 0) for i in range(x.shape[2])]
    out = torch.cat(frames, 2)
    if vae.config.patch_size is not None:
        out = _unpatchify(out, vae.config.patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)


def encode_shard(vae: nn.Module, x: torch.Tensor, shard: Shard, exchange: Exchange) -> torch.Tensor:
    """`AutoencoderKLWan._encode` (untiled) of this shard's pixel rows `x` of a video [1, 3, T, H, W]: its
    rows of `quant_conv(encoder(...))` (mean and log-variance), one per latent row."""
    walk = _Walk(shard, exchange)
    frames = x.shape[2]
    if vae.config.patch_size is not None:
        x = _patchify(x, vae.config.patch_size)
    chunks = []
    for i in range(1 + (frames - 1) // 4):
        chunk = x[:, :, :1, :, :] if i == 0 else x[:, :, 1 + 4 * (i - 1) : 1 + 4 * i, :, :]
        chunks.append(walk.encoder(vae.encoder, chunk))
    return walk.causal(vae.quant_conv, torch.cat(chunks, 2))


def _patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    return patchify(x, patch_size=p)


def _unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    return unpatchify(x, patch_size=p)
