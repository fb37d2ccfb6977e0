"""Why each of model/vae_exact.py's fixes is there: the split VAE decode and encode with one fix switched
off at a time, against diffusers' unsplit calls, on this CPU.

    python scripts/bench/vae_exact.py [--quick] [--all-settings]

For a random Wan2.2-layout VAE (the tiny checkpoint's: 8 base channels; and one of 32) and a few latent
shapes and group sizes, runs the split walk (model/vae_patch.py) by threads over in-process gloo groups,
at one intra-op thread, and prints per configuration how many output elements differ from
`AutoencoderKLWan.decode` / `encode` and by how much at most: with every fix, then with the convolution
backend left to the shard's size (`conv`: also no GEMM fix), the im2col GEMM's remainder pixels left where
the shard's call puts them (`gemm`: a step of 1 assumed), SiLU's scalar tail left where the shard's loop
puts it (`silu`), and the encoder shortcut's mean taken on the shard alone (`mean`). Nothing is asserted;
the tests (tests/unit/test_vae_patch.py) hold the first column at zero. `--all-settings` runs the table
once per instruction-set setting scripts/test.sh uses (this CPU's default, MKL_ENABLE_INSTRUCTIONS=AVX2
ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX ATEN_CPU_CAPABILITY=default, oneDNN lowered alike), one
subprocess each: MKL, ATen and oneDNN read them once, at start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cosmos3_batch.model import vae_exact, vae_patch
from cosmos3_batch.model.tiny import TinySpec, vae_config
from cosmos3_batch.model.vae_patch import Shard, decode_shard, encode_shard
from cosmos3_batch.model.vae_shards import plan_cut
from cosmos3_batch.parallel.vae_group import PatchGroup

# Each fix switched off: (module, name) replaced by the plain call.
PLAIN = {
    "conv": (
        vae_patch,
        "conv_as_in_whole",
        lambda conv, x, *_: conv._conv_forward(x, conv.weight, conv.bias),
    ),
    "gemm": (vae_exact, "gemm_column_step", lambda dtype: 1),
    "silu": (vae_patch, "silu_as_in_whole", lambda x, dim, offset, whole: F.silu(x)),
    "mean": (vae_patch, "mean_as_in_whole", lambda x, dim, offset, whole: x.mean(dim=2)),
}
# As scripts/test.sh lowers them (oneDNN with ATen: see there).
SETTINGS = (
    {},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX"},
)


def split(cut: Shard, x: torch.Tensor, walk, vae, scale: int) -> torch.Tensor:
    ranks = len(cut.sizes)
    store, groups, out = dist.HashStore(), [None] * ranks, [None] * ranks

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, ranks, timedelta(seconds=120))

    def work(rank: int) -> None:
        group = PatchGroup(groups[rank], rank, ranks, ranks)
        exchange = group.bind(cut)
        shard = exchange.shard
        with torch.no_grad():
            out[rank] = exchange.collect(walk(vae, shard.of(x, scale), shard, exchange), cut.dim)

    for target in (make, work):
        threads = [threading.Thread(target=target, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out[0]


def differ(got: torch.Tensor, expected: torch.Tensor) -> str:
    count = int((got != expected).sum())
    return "0" if not count else f"{count} ({(got - expected).abs().max().item():.1e})"


def row(vae, latent: tuple[int, int, int], parts: int) -> list[str]:
    frames, height, width = latent
    cut = plan_cut((height, width), parts, torch.device("cpu"))
    spatial = vae.config.scale_factor_spatial
    z = torch.randn(1, vae.config.z_dim, frames, height, width, generator=torch.Generator().manual_seed(0))
    video = torch.rand(1, 3, 4 * (frames - 1) + 1, height * spatial, width * spatial) * 2 - 1
    with torch.no_grad():
        decoded, encoded = vae.decode(z).sample, vae.encode(video).latent_dist.parameters
    cells = []
    for off in (None, *PLAIN):
        module, name, plain = PLAIN[off] if off else (None, None, None)
        saved = getattr(module, name) if off else None
        if off:
            setattr(module, name, plain)
        try:
            d = differ(split(cut, z, decode_shard, vae, 1), decoded)
            e = differ(split(cut, video, encode_shard, vae, spatial), encoded)
        finally:
            if off:
                setattr(module, name, saved)
        cells.append(f"{d} / {e}")
    return [f"{frames}x{height}x{width}", str(parts), "+".join(map(str, cut.sizes)), *cells]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one VAE, two shapes")
    parser.add_argument("--all-settings", action="store_true", help="once per instruction-set setting")
    args = parser.parse_args()
    if args.all_settings:
        for setting in SETTINGS:
            print(
                "== "
                + (" ".join(f"{k}={v}" for k, v in setting.items()) or "no setting (this CPU's default)")
            )
            command = [sys.executable, __file__, *(["--quick"] if args.quick else [])]
            subprocess.run(command, env={**os.environ, **setting}, check=True)
        return
    torch.set_num_threads(1)
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "(unset)")
    silu, gemm = vae_exact.silu_period(torch.float32), vae_exact.gemm_column_step(torch.float32)
    aten = torch.backends.cpu.get_cpu_capability()
    print(f"ATen {aten}, MKL_ENABLE_INSTRUCTIONS={mkl}: SiLU step {silu}, im2col GEMM step {gemm}")
    shapes = [((1, 8, 8), 2), ((2, 13, 7), 4)] + ([] if args.quick else [((3, 4, 16), 4), ((2, 9, 6), 4)])
    print("elements differing from the unsplit decode / encode (max |diff|), per fix switched off")
    header = ["latent TxHxW", "P", "cut", "all fixes", *(f"no {off} fix" for off in PLAIN)]
    print(" | ".join(header))
    for dim in (8,) if args.quick else (8, 32):
        torch.manual_seed(0)
        spec = vae_config(TinySpec(vae_dim=dim), torch.Generator().manual_seed(0))
        vae = build_vae(spec)
        print(f"-- base channels {dim}")
        for latent, parts in shapes:
            print(" | ".join(row(vae, latent, parts)), flush=True)


def build_vae(config: dict):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(**config).eval()


if __name__ == "__main__":
    main()
