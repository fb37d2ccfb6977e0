"""A shard's rows rounded as the unsplit call rounds them: the three places where CPU kernels of the VAE's
walk compute a row differently depending on what else is in the call (model/vae_patch.py uses them).

Found by comparing every intermediate of a split walk with the unsplit one on CPU float32 (the
end-to-end comparison is tests/unit/test_vae_patch.py):

* convolutions: torch picks a backend by the input's size (oneDNN above a size: for 3-D convolutions
  N x C x T x H, so a cut of the height can cross it; else its own im2col + GEMM). Two backends may round a
  pixel an ulp apart; within one, a row came out alike whatever rows were around it. So a shard runs the
  backend torch's own selector picks for the unsplit input.
* SiLU: torch's vectorized CPU loop computes the last (n % step) elements of a serial loop with the
  scalar function, which rounds some values an ulp apart from the vector one. The elements where a shard
  and the whole disagree on the path are recomputed on the whole's.
* the mean of the encoder's average shortcut (AvgDown3D): torch's CPU sum takes a different summation
  order for a column depending on where it falls in its row of columns, so each column is reduced at its
  own place in a row as long as the whole's.

Everything else the walk computes (channel norms, adds, products, copies, the clamp) came out equal.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

FORCEABLE = ("Mkldnn", "Slow2d", "Slow3d")  # the CPU backends of float convolutions torch picks between
KERNELS = ("mkldnn_convolution", "thnn_conv2d", "slow_conv3d")  # their aten ops, called by conv_as_in_whole


def exact_walk_available() -> bool:
    """Whether this torch has the private selector and backend ops `conv_as_in_whole` calls (those of torch
    2.13, which the project pins). Without them a CPU decode is not split (vae_shards.plan_cut): one rank
    decodes it whole, exactly, rather than a split walk that could differ or fail."""
    if not hasattr(torch._C, "_select_conv_backend"):
        return False
    return all(hasattr(torch.ops.aten, kernel) for kernel in KERNELS)


def conv_as_in_whole(conv: nn.Module, x: torch.Tensor, whole_shape: list[int]) -> torch.Tensor:
    """conv(x) computed by the kernel torch would pick for an input of `whole_shape` (the unsplit call's),
    asked through torch's own selector; the kernel is then called as torch's dispatch calls it."""
    weight, bias = conv.weight, conv.bias
    d = x.dim() - 2
    args = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0] * d, conv.groups, None)
    select = torch._C._select_conv_backend
    theirs = select(_stand_in(whole_shape, x), _stand_in(weight.shape, weight), bias, *args)
    mine = select(x, weight, bias, *args)
    if mine == theirs:
        return conv._conv_forward(x, weight, bias)
    name = theirs.name
    if name == "Mkldnn":
        return torch.ops.aten.mkldnn_convolution(
            x.contiguous(), weight.contiguous(), bias, conv.padding, conv.stride, conv.dilation, conv.groups
        )
    kernel = list(weight.shape[2:])
    if name == "Slow2d":
        return torch.ops.aten.thnn_conv2d(x.contiguous(), weight, kernel, bias, conv.stride, conv.padding)
    if name == "Slow3d":
        return torch.ops.aten.slow_conv3d(x.contiguous(), weight, kernel, bias, conv.stride, conv.padding)
    raise RuntimeError(f"a shard's convolution would run on {mine.name}, the unsplit one on {name}")


def _stand_in(shape, like: torch.Tensor) -> torch.Tensor:
    """A tensor of `shape` with no memory (zero strides): all the selector reads is shape, dtype, device."""
    return torch.empty(1, dtype=like.dtype, device=like.device).expand(tuple(shape))


@functools.lru_cache(maxsize=8)
def silu_period(dtype: torch.dtype) -> int:
    """The step of torch's vectorized CPU SiLU loop, measured (32 floats on AVX512, 16 on AVX2), or 1 where
    no value rounds differently on its two paths: a serial loop over n elements computes the first
    n - n % step with vector instructions and the rest with the scalar function, and for some x the two
    differ by an ulp."""
    values = torch.linspace(-6.0, 6.0, 997, dtype=dtype)
    for x0 in values:
        vector = F.silu(x0.expand(256).contiguous())[0]
        if F.silu(x0.reshape(1))[0] != vector:  # one element: the scalar path
            return next(n for n in range(1, 257) if F.silu(x0.expand(n).contiguous())[0] == vector)
    return 1


def silu_as_in_whole(x: torch.Tensor, dim: int, offset: int, whole: int) -> torch.Tensor:
    """F.silu(x) for a dense shard x of a whole tensor (`dim` `whole` long, the shard at `offset`) with every
    element rounded as F.silu of the whole rounds it, on CPU at one intra-op thread (plan_cut keeps the
    split to that): the whole's serial loop takes the scalar path for its last (numel % step) elements in
    memory order, the shard's for its own last ones. Only those can differ; they are recomputed on the
    path the whole takes for them."""
    y = F.silu(x)
    step = silu_period(x.dtype)
    n_shard = x.numel()
    n_whole = n_shard // x.shape[dim] * whole
    tail, whole_tail = n_shard % step, n_whole % step
    m = min(n_shard, max(tail, whole_tail))
    if step == 1 or m == 0:
        return y
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))  # outermost first, as in memory
    flat_x, flat_y = x.permute(order).reshape(-1), y.permute(order).view(-1)
    sizes = [x.shape[d] for d in order]
    wide = list(sizes)
    wide[order.index(dim)] = whole
    coords = torch.unravel_index(torch.arange(n_shard - m, n_shard), sizes)
    position = torch.zeros(m, dtype=torch.int64)
    for axis, (c, extent) in enumerate(zip(coords, wide, strict=True)):
        position = position * extent + c + (offset if axis == order.index(dim) else 0)
    scalar_here = position >= n_whole - whole_tail
    suffix = flat_x[-m:]
    vector = F.silu(F.pad(suffix, (0, step - m)))[:m]  # exactly one full step: vector path for all
    scalar = F.silu(suffix.clone())  # fewer than a step: scalar path for all
    flat_y[-m:] = torch.where(scalar_here, scalar, vector)
    return y


def mean_as_in_whole(x: torch.Tensor, dim: int, offset: int, whole: int) -> torch.Tensor:
    """x.mean(dim=2) of a contiguous [B, C, G, ...] shard (`dim` `whole` long in the whole, the shard at
    `offset`) rounded as the whole's call rounds it. torch's CPU sum takes a different summation order
    for an output column depending on where the column falls in its row of columns (vectorized blocks,
    then a remainder), so each column is reduced at its own place in a row as long as the whole's:
    the shard is written into zeros of the whole's extent, a few channels at a time (each channel's
    columns are reduced on their own, so a slice of channels keeps every column's place), about the
    shard's own size per slice."""
    channels, extent = x.shape[1], x.shape[dim]
    step = max(1, -(-channels * extent // whole))
    means = []
    for first in range(0, channels, step):
        part = x[:, first : first + step]
        shape = list(part.shape)
        shape[dim] = whole
        buffer = part.new_zeros(shape)
        buffer.narrow(dim, offset, extent).copy_(part)
        means.append(buffer.mean(dim=2).narrow(dim - 1, offset, extent))
    return torch.cat(means, 1)
