"""A shard's rows rounded as the unsplit call rounds them: the places where CPU kernels of the VAE's walk
compute a row differently depending on what else is in the call (model/vae_patch.py uses them).

Found by comparing every intermediate of a split walk with the unsplit one on CPU float32 (the
end-to-end comparison is tests/unit/test_vae_patch.py):

* convolutions: torch picks a backend by the input's size (oneDNN above a size: for 3-D convolutions
  N x C x T x H, so a cut of the height can cross it; else its own im2col + GEMM). Two backends may round a
  pixel an ulp apart. So a shard runs the backend torch's own selector picks for the unsplit input.
* the im2col backends' GEMM: its m is a batch element's output pixels, and a BLAS may compute the last
  m % step of them with a remainder kernel that rounds an ulp apart (MKL's SSE4.2 path, which
  MKL_ENABLE_INSTRUCTIONS=AVX selects: step 4; its AVX2 and AVX512 paths: none). The step is measured at
  run time (`gemm_column_step`) and a shard's call is padded with zero rows so that each pixel falls in
  the same part of its GEMM as in the whole's.
* SiLU: torch's vectorized CPU loop computes the last (n % step) elements of a serial loop with the
  scalar function, which rounds some values an ulp apart from the vector one. The elements where a shard
  and the whole disagree on the path are recomputed on the whole's. (ATen's `default` capability: none.)
* the mean of the encoder's average shortcut (AvgDown3D): torch's CPU sum takes a different summation
  order for a column depending on where it falls in its row of columns, so each column is reduced at its
  own place in a row as long as the whole's.

Everything else the walk computes (channel norms, adds, products, copies, the clamp) came out equal, at
ATen's AVX512, AVX2 and default capabilities with MKL's AVX512, AVX2 and SSE4.2 paths.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("mkldnn_convolution", "thnn_conv2d", "slow_conv3d")  # their aten ops, called by conv_as_in_whole
GEMM_PIXELS = 16  # gemm_column_step measures calls of at least this many pixels (the walk's: a shard's floor)
# The GEMM reduction depths gemm_column_step measures: a 1x1 convolution's over 16 channels, a 3x3x3 one's.
# A BLAS may pick its kernel by depth too, so the step must hold at both (else none is claimed).
GEMM_DEPTHS = (16, 16 * 27)


def exact_walk_available() -> bool:
    """Whether this torch has the private selector and backend ops `conv_as_in_whole` calls (those of torch
    2.13, which the project pins). Without them a CPU decode is not split (vae_shards.plan_cut): one rank
    decodes it whole, exactly, rather than a split walk that could differ or fail."""
    if not hasattr(torch._C, "_select_conv_backend"):
        return False
    return all(hasattr(torch.ops.aten, kernel) for kernel in KERNELS)


def conv_as_in_whole(
    conv: nn.Module, x: torch.Tensor, whole_shape: list[int], dim: int, last: bool
) -> torch.Tensor:
    """conv(x) computed by the kernel torch would pick for an input of `whole_shape` (the unsplit call's),
    asked through torch's own selector; the kernel is then called as torch's dispatch calls it. x is a shard
    of that input along `dim` (with its halo); `last`: the shard whose rows end where the whole's do."""
    weight, bias = conv.weight, conv.bias
    d = x.dim() - 2
    args = (list(conv.stride), list(conv.padding), list(conv.dilation), False, [0] * d, conv.groups, None)
    select = torch._C._select_conv_backend
    theirs = select(_stand_in(whole_shape, x), _stand_in(weight.shape, weight), bias, *args)
    mine = select(x, weight, bias, *args)
    name = theirs.name
    if name in ("Slow2d", "Slow3d"):
        return _im2col_as_in_whole(conv, x, whole_shape, dim, last)
    if mine == theirs:
        return conv._conv_forward(x, weight, bias)
    if name == "Mkldnn":
        return torch.ops.aten.mkldnn_convolution(
            x.contiguous(), weight.contiguous(), bias, conv.padding, conv.stride, conv.dilation, conv.groups
        )
    raise RuntimeError(f"a shard's convolution would run on {mine.name}, the unsplit one on {name}")


def _im2col(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's im2col + GEMM convolution (Slow2d / Slow3d) of x, whatever the selector would pick for x."""
    kernel = list(conv.weight.shape[2:])
    op = torch.ops.aten.thnn_conv2d if len(kernel) == 2 else torch.ops.aten.slow_conv3d
    return op(x.contiguous(), conv.weight, kernel, conv.bias, conv.stride, conv.padding)


def _im2col_as_in_whole(conv: nn.Module, x: torch.Tensor, whole_shape, dim: int, last: bool) -> torch.Tensor:
    """The im2col convolution of a shard with every output pixel in the same part of its GEMM as in the
    whole's call. The GEMM's m is a batch element's output pixels (memory order), and a BLAS may compute
    the last (m % step) of them with a remainder kernel that rounds apart (`gemm_column_step`). In the
    whole's call those are the last pixels of the last frame: the last shard's. So zero rows are put
    before the shard (their output rows are dropped) until its m leaves the same remainder as the whole's
    (the last shard: the same pixels in it) or none (the others), and at least GEMM_PIXELS in all: the step
    describes calls of that many pixels only (measured on an AMD EPYC: at step 1, calls of 5 and 10 pixels
    round apart from a 45-pixel one)."""
    step = gemm_column_step(x.dtype)
    if (
        step == 0
    ):  # plan_cut does not split where no step was measured; a caller that does gets the plain call
        return _im2col(conv, x)
    mine, whole = _out_sizes(conv, x.shape), _out_sizes(conv, whole_shape)
    per_row = math.prod(mine) // mine[dim - 2]  # output pixels of one row along dim, per batch element
    target = math.prod(whole) % step if last else 0
    pixels = math.prod(mine)
    extra = next(  # output rows put before the shard: that remainder, and GEMM_PIXELS at least (as measured)
        e
        for e in range(GEMM_PIXELS + step)
        if (pixels + e * per_row) % step == target and pixels + e * per_row >= GEMM_PIXELS
    )
    if not extra:
        return _im2col(conv, x)
    shape = list(x.shape)
    shape[dim] = extra * conv.stride[dim - 2]
    y = _im2col(conv, torch.cat([x.new_zeros(shape), x], dim))
    return y.narrow(dim, extra, y.shape[dim] - extra)


def _out_sizes(conv: nn.Module, shape) -> list[int]:
    """The spatial sizes of conv's output for an input of `shape`."""
    return [
        (n + 2 * p - dil * (k - 1) - 1) // s + 1
        for n, p, dil, k, s in zip(
            shape[2:], conv.padding, conv.dilation, conv.weight.shape[2:], conv.stride, strict=True
        )
    ]


def gemm_column_step(dtype: torch.dtype) -> int:
    """The step of the GEMM behind torch's im2col convolutions, measured through those kernels at this
    process's thread count: in a call of m >= GEMM_PIXELS output pixels, the first m - m % step are computed
    alike whatever m, and each of the last m % step alike in every call with that remainder, but possibly
    an ulp apart from the others (MKL's SSE4.2 path, which MKL_ENABLE_INSTRUCTIONS=AVX selects: 4). 1 where
    every pixel comes out alike (MKL's AVX2 and AVX512 paths); 0 where no step up to 16 describes the
    kernel (then vae_shards.plan_cut does not split)."""
    return _measured_step(dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=8)
def _measured_step(dtype: torch.dtype, threads: int) -> int:
    """gemm_column_step, once per dtype and thread count (MKL reads its instruction set once, at start)."""
    gen = torch.Generator().manual_seed(0)
    calls = []  # per kernel and input column: {m: the output's pixels [m, 16]}, the column repeated m times
    for depth, _ in itertools.product(GEMM_DEPTHS, range(3)):
        weight = torch.randn(16, depth, 1, 1, generator=gen, dtype=dtype)
        bias = torch.randn(16, generator=gen, dtype=dtype)
        column = torch.randn(1, depth, 1, 1, generator=gen, dtype=dtype)
        two, three = {}, {}
        for m in range(GEMM_PIXELS, 4 * GEMM_PIXELS + 1):
            x = column.expand(1, depth, 1, m).contiguous()
            out = torch.ops.aten.thnn_conv2d(x, weight, [1, 1], bias, [1, 1], [0, 0])
            two[m] = out[0, :, 0].T
            out = torch.ops.aten.slow_conv3d(
                x.unsqueeze(2), weight.unsqueeze(2), [1] * 3, bias, [1] * 3, [0] * 3
            )
            three[m] = out[0, :, 0, 0].T
        calls += [two, three]
    for step in (1, 2, 4, 8, 16):
        if all(_follows_step(outputs, step) for outputs in calls):
            return step
    return 0


def _follows_step(outputs: dict[int, torch.Tensor], step: int) -> bool:
    """Whether every call gives the main value to its first m - m % step pixels and, to each of the others,
    what the first call with the same remainder gives that place."""
    main = outputs[max(outputs)][0]  # 4 x GEMM_PIXELS pixels: a multiple of every step tried
    tails: dict[int, torch.Tensor] = {}
    for m, out in outputs.items():
        tail = m % step
        if not (out[: m - tail] == main).all():
            return False
        if not torch.equal(tails.setdefault(tail, out[m - tail :]), out[m - tail :]):
            return False
    return True


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
