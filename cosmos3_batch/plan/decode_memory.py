"""Device memory of one VAE decode, from the VAE's own code run on the meta device (no weights, no math).

The finisher decodes one request at a time, on the device the pass loop computes on, on a stream of its
own (pipeline/finish/finisher.py): its peak adds to the pass loop's, and the caching allocator keeps what the
decode stream freed for that stream. What the peak is made of depends on the decoder (Wan's causal
convolutions keep CACHE_T frames of every convolution's input across the latent frames; the largest
feature maps live at half the output resolution; the decoded frames accumulate by `torch.cat`), so
rather than a formula this runs `AutoencoderKLWan.decode` on meta tensors and counts the bytes of
every tensor it creates while that tensor is alive: the peak is what the caching allocator must hold,
allocator rounding and fragmentation aside. Measured: Wan2.2's VAE, 1280x720, float32: 18.6 GB for
13 frames, +42 MB per further latent frame (the output), 20.4 GB for 189 frames; tiled (256 px tiles):
about 1.5 GB.

Decoding every latent frame would take seconds per plan on a long clip, and the steady state repeats:
the peak is measured at 3 and 4 latent frames and extended linearly (what grows is the output alone).

With --vae-patch-parallel-size P the same count runs over the group's own walk (model/vae_patch.py) of the
largest shard, on its first rank: that rank also receives the other shards' halos, computes the mid-block
attention on the whole frame and gathers the decoded frames, so its peak is the group's largest. The
decode's FLOPs come from the same meta walks (torch's FlopCounterMode), for `plan`'s roofline time.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cosmos3_batch.model.vae_patch import Shard, decode_shard
from cosmos3_batch.model.vae_shards import ShapeExchange, meta_vae, plan_cut

TILE = 256  # pixels: diffusers' default tile_sample_min_height/width for AutoencoderKLWan


class _LiveBytes(TorchDispatchMode):
    """Counts the storage bytes of every tensor an op creates until the tensor is garbage collected."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor._is_view():  # a view holds no new bytes
                nbytes = tensor.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, nbytes)
        return out


def cut_for(latent_h: int, latent_w: int, parts: int) -> Shard:
    """The cut a group of `parts` uses on a GPU (model/vae_shards.plan_cut: the pixel floor alone)."""
    return plan_cut((latent_h, latent_w), parts, torch.device("cuda"))


def _walk(vae, latent_shape: tuple[int, ...], dtype: torch.dtype, parts: int) -> None:
    """One decode on meta tensors: diffusers' own at P = 1, else the first rank's share of a group's."""
    z = torch.empty(latent_shape, device="meta", dtype=dtype)
    cut = cut_for(latent_shape[3], latent_shape[4], parts)
    if len(cut.sizes) == 1:
        vae.decode(z)
        return
    exchange = ShapeExchange(cut)
    exchange.collect(decode_shard(vae, cut.of(z), cut, exchange), cut.dim)


def _measured(vae, latent_shape: tuple[int, ...], dtype: torch.dtype, parts: int = 1) -> int:
    meter = _LiveBytes()
    with torch.no_grad(), meter:
        _walk(vae, latent_shape, dtype, parts)
    return meter.peak


def _flops(vae, latent_shape: tuple[int, ...], dtype: torch.dtype, parts: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        _walk(vae, latent_shape, dtype, parts)
    return counter.get_total_flops()


def _per_frames(measure, shape: tuple[int, ...], latent_t: int) -> int:
    """`measure(shape with T latent frames)` at `latent_t` frames: measured up to 4, else extended linearly
    from 3 and 4 (the steady state repeats per frame)."""
    at = lambda t: measure((*shape[:2], t, *shape[3:]))  # noqa: E731
    if latent_t <= 4:
        return at(latent_t)
    at3, at4 = at(3), at(4)
    return at4 + (at4 - at3) * (latent_t - 4)


@functools.lru_cache(maxsize=64)
def decode_peak_bytes(
    vae_config_json: str,
    width: int,
    height: int,
    frames: int,
    dtype: torch.dtype,
    tiled: bool = False,
    parts: int = 1,
) -> int:
    """Peak device bytes of decoding one `frames` x `height` x `width` output with this VAE config (on the
    busiest rank of a group of `parts`). Tiled (`--vae-tiling`): one tile's decode at most TILE x TILE
    pixels, plus the whole output twice (the decoded tiles and the blended frames)."""
    vae = meta_vae(vae_config_json, dtype)
    cfg = vae.config
    spatial, temporal = cfg.scale_factor_spatial, cfg.scale_factor_temporal
    latent_t = (frames - 1) // temporal + 1
    output = 3 * frames * height * width * dtype.itemsize
    if tiled:
        width, height = min(width, TILE), min(height, TILE)
    shape = (1, cfg.z_dim, 0, height // spatial, width // spatial)
    peak = _per_frames(lambda s: _measured(vae, s, dtype, parts), shape, latent_t)
    if tiled:
        tile_output = 3 * frames * height * width * dtype.itemsize
        peak += 2 * output - tile_output
    return int(peak)


@functools.lru_cache(maxsize=64)
def decode_flops(
    vae_config_json: str, width: int, height: int, frames: int, dtype: torch.dtype, parts: int
) -> int:
    """FLOPs of one untiled decode on the busiest rank of a group of `parts` (its shard and, on the first
    rank, the mid-block attention over whole frames)."""
    vae = meta_vae(vae_config_json, dtype)
    cfg = vae.config
    latent_t = (frames - 1) // cfg.scale_factor_temporal + 1
    spatial = cfg.scale_factor_spatial
    shape = (1, cfg.z_dim, 0, height // spatial, width // spatial)
    return _per_frames(lambda s: _flops(vae, s, dtype, parts), shape, latent_t)
