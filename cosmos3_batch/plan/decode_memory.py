"""Device memory of one VAE decode, from the VAE's own code run on the meta device (no weights, no math).

The finisher decodes one request at a time, on the device the pass loop computes on, on a stream of its
own (pipeline/finisher.py): its peak adds to the pass loop's, and the caching allocator keeps what the
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
"""

from __future__ import annotations

import functools
import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


@functools.lru_cache(maxsize=16)
def _vae(config_json: str, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(json.loads(config_json))
    for param in vae.parameters():  # not vae.to(dtype): diffusers warns about that on every call
        param.data = param.data.to(dtype)
    return vae.eval().requires_grad_(False)


def _measured(vae, latent_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    meter = _LiveBytes()
    z = torch.empty(latent_shape, device="meta", dtype=dtype)
    with torch.no_grad(), meter:
        vae.decode(z)
    return meter.peak


@functools.lru_cache(maxsize=64)
def decode_peak_bytes(
    vae_config_json: str, width: int, height: int, frames: int, dtype: torch.dtype, tiled: bool = False
) -> int:
    """Peak device bytes of decoding one `frames` x `height` x `width` output with this VAE config. Tiled
    (`--vae-tiling`): one tile's decode at most TILE x TILE pixels, plus the whole output twice (the decoded
    tiles and the blended frames)."""
    vae = _vae(vae_config_json, dtype)
    cfg = vae.config
    spatial, temporal = cfg.scale_factor_spatial, cfg.scale_factor_temporal
    latent_t = (frames - 1) // temporal + 1
    output = 3 * frames * height * width * dtype.itemsize
    if tiled:
        width, height = min(width, TILE), min(height, TILE)
    shape = (1, cfg.z_dim, 0, height // spatial, width // spatial)
    if latent_t <= 4:
        peak = _measured(vae, (*shape[:2], latent_t, *shape[3:]), dtype)
    else:
        at3, at4 = (_measured(vae, (*shape[:2], t, *shape[3:]), dtype) for t in (3, 4))
        peak = at4 + (at4 - at3) * (latent_t - 4)
    if tiled:
        tile_output = 3 * frames * height * width * dtype.itemsize
        peak += 2 * output - tile_output
    return int(peak)
