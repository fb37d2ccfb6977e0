"""How a latent is cut for a group decode or encode (model/vae_patch.py), and the floor of the cut.

The cut: the latent's longer spatial side (height on a tie), contiguous rows in rank order, as equal as
possible (the first shards take the extra rows), none below MIN_SHARD_PIXELS latent pixels: a GEMM's M
in torch's im2col convolutions is the shard's pixels, and MKL without strict CNR may round a GEMM of very
few rows differently (measured here: 1 pixel; the SP work found up to 15 rows on AVX512, 1-3 on AVX2), so
the floor is parallel/sequence.py's MIN_SHARD_ROWS, for the same reason; a decode that small is not
worth a second rank anyway. Fewer ranks than P share a smaller latent (one: the unsplit decode).

What else could round a shard's rows apart from the unsplit decode's is handled where it happens, in
vae_exact.py: the convolution backend torch picks by size and the remainder pixels of its im2col GEMM
(`conv_as_in_whole`), the scalar tail of the vectorized SiLU loop (`silu_as_in_whole`) and the summation
order of the Wan2.2 encoder's average shortcut (`mean_as_in_whole`). The SiLU fix reproduces a serial
loop, so on CPU the cut is used only at one intra-op thread (torchrun's default), only where torch has the
private calls of the backend fix (`exact_walk_available`) and only where the GEMM's remainder is measured
to follow a step (`gemm_column_step`); else one rank decodes. The GEMM fix needs the whole's remainder
pixels (the last < step of each frame) in the last shard: a width cut's last shard keeps step - 1 columns
(fewer ranks otherwise). On CUDA no bit-exactness is promised (cuDNN picks algorithms by shape): the cut
uses the pixel floor alone.
"""

from __future__ import annotations

import functools
import json
import logging

import torch
from torch import nn

from cosmos3_batch.model.vae_exact import exact_walk_available, gemm_column_step
from cosmos3_batch.model.vae_patch import Shard

log = logging.getLogger(__name__)

MIN_SHARD_PIXELS = 16  # = parallel.sequence.MIN_SHARD_ROWS (not imported: parallel sits above model)


def check_patchable(vae_config: dict, parts: int) -> None:
    """ValueError unless a group of `parts` can decode this VAE: the Wan2.2 (residual) layout."""
    if parts > 1 and not vae_config.get("is_residual", False):
        raise ValueError(
            f"--vae-patch-parallel-size {parts}: the checkpoint's VAE is not a Wan2.2 (residual) VAE; "
            "only that layout is split (use 1)"
        )


def split_dim(height: int, width: int) -> int:
    """The dim of [B, C, T, H, W] a latent is cut along: its longer side (height on a tie)."""
    return 3 if height >= width else 4


def shard_sizes(length: int, across: int, parts: int, min_pixels: int = MIN_SHARD_PIXELS) -> tuple[int, ...]:
    """Rows of `length` each used shard holds when `parts` ranks share it; `across` is the other side.
    No shard below `min_pixels` latent pixels (then fewer ranks, at least one)."""
    min_rows = -(-min_pixels // max(across, 1))
    used = max(1, min(parts, length // min_rows))
    base, extra = divmod(length, used)
    return tuple(base + (1 if i < extra else 0) for i in range(used))


def plan_cut(latent_hw: tuple[int, int], parts: int, device: torch.device) -> Shard:
    """Shard 0 of the cut a group uses for a latent `latent_hw` big (`sizes` tells every rank its own):
    no shard below the pixel floor; on CPU only at one intra-op thread (the serial loops whose rounding
    vae_exact.silu_as_in_whole reproduces; a thread pool cuts them elsewhere) and with a GEMM step
    measured, else one shard."""
    height, width = latent_hw
    dim = split_dim(height, width)
    length, across = (height, width) if dim == 3 else (width, height)
    used = len(shard_sizes(length, across, parts))
    if device.type == "cpu" and used > 1:
        step = 0
        if torch.get_num_threads() != 1:
            why = f"{torch.get_num_threads()} intra-op threads (the walk is exact at 1, torchrun's default)"
        elif not exact_walk_available():
            why = "this torch lacks the private convolution calls of the exact walk (torch 2.13 has them)"
        else:
            step = gemm_column_step(torch.float32)
            why = "no GEMM step describes this CPU's im2col convolutions (model/vae_exact.gemm_column_step)"
        if not step:
            _not_split(why)
            used = 1
        # The whole's GEMM remainder pixels (< step, the last of each frame) must all fall in the last shard:
        # its last row of a width cut holds at least step - 1 pixels.
        while used > 1 and shard_sizes(length, across, used)[-1] * (across if dim == 3 else 1) < step - 1:
            used -= 1
    return Shard(dim, shard_sizes(length, across, used), 0)


@functools.cache
def _not_split(why: str) -> None:
    """Say once per process and reason that a CPU decode the group could share runs on one rank."""
    log.warning(
        "--vae-patch-parallel-size: CPU decodes and encodes are not split, one rank of the group runs each "
        "whole (exact, as the reference): %s",
        why,
    )


class ShapeExchange:
    """The exchange of a shard whose neighbours are imagined: zeros of the right shapes (meta walks for the
    floor, the planner's memory and FLOP counts). `collect` allocates the whole, as the writer does."""

    def __init__(self, shard: Shard):
        self.shard = shard

    def _rows(self, x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = rows
        return x.new_zeros(shape)

    def halo(self, x, dim, before, after):
        s = self.shard
        top = self._rows(x, dim, before) if before and s.index > 0 else None
        bottom = self._rows(x, dim, after) if after and s.index < len(s.sizes) - 1 else None
        return top, bottom

    def on_whole(self, x, dim, fn):
        if len(self.shard.sizes) == 1:
            return fn(x)
        scale = x.shape[dim] // self.shard.rows
        whole = self._rows(x, dim, sum(self.shard.sizes) * scale)
        return self.shard.of(fn(whole), scale)

    def collect(self, x, dim):
        if len(self.shard.sizes) == 1:
            return x
        if self.shard.index:
            return None
        scale = x.shape[dim] // self.shard.rows
        others = [self._rows(x, dim, rows * scale) for rows in self.shard.sizes[1:]]
        return torch.cat([x, *others], dim)


@functools.lru_cache(maxsize=16)
def meta_vae(config_json: str, dtype: torch.dtype) -> nn.Module:
    """An AutoencoderKLWan on the meta device (no weights, no math): for shapes, bytes and FLOPs."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(json.loads(config_json))
    for param in vae.parameters():  # not vae.to(dtype): diffusers warns about that on every call
        param.data = param.data.to(dtype)
    return vae.eval().requires_grad_(False)
