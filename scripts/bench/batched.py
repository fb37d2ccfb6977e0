"""Per-branch vs batched layer halves on CPU, timed side by side in one run.

The case issue 10 names as the worst for per-branch GEMMs: K=4 images of ~1k tokens with CFG on, i.e.
8 sequences through every GEN half, on the "tiny but wider" model (hidden 512, 8 heads, 4 KV heads,
intermediate 1536, 4 layers). Prints ms per layer for each path (per branch; all branches batched; batched
in groups of at most --max-rows rows) and the ratio to per-branch, for the GEN half (every pass) and the
UND half (prefill passes), plus whether the outputs were bit-equal to the per-branch ones in this run.

    .venv/bin/python scripts/bench/batched.py [--images 4] [--tokens 1024] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from cosmos3_batch.model.batched import gen_layer_batched, row_groups, und_layer_batched
from cosmos3_batch.model.cosmos3 import BranchSeq, Cosmos3Split
from cosmos3_batch.model.tiny import TinySpec, write_tiny
from cosmos3_batch.pipeline.kinds.context import load_context

WIDE = TinySpec(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1536)


def make_seq(split: Cosmos3Split, und_len: int, gen_len: int, generator: torch.Generator) -> BranchSeq:
    # Positions as the packer lays them out: text on the diagonal, one frame of a near-square grid after it.
    width = max(1, math.isqrt(gen_len))
    t = torch.arange(gen_len)
    gen_pos = torch.stack([torch.full((gen_len,), und_len), und_len + t // width, und_len + t % width])
    positions = torch.cat([torch.arange(und_len).expand(3, -1), gen_pos], dim=1)
    rot_und, rot_gen = split.rotary(positions, und_len, torch.device("cpu"))
    hidden = split.config.hidden_size
    text = torch.randn(und_len, hidden, generator=generator)
    return BranchSeq(
        und_hidden=text,
        text_hidden=text,
        rot_und=rot_und,
        rot_gen=rot_gen,
        mse_rows=torch.arange(gen_len),
        gen_hidden=torch.randn(gen_len, hidden, generator=generator),
    )


def fresh(seq: BranchSeq) -> BranchSeq:
    return replace(seq, und_hidden=seq.text_hidden, und_kv=[])


def timed(fn, *args) -> tuple[float, float]:
    """(wall, CPU) seconds. On a CPU shared with other jobs the process's CPU time is the steadier figure:
    it does not count the time the scheduler gave someone else."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def _best_per_layer(samples: list[tuple[float, float]], layers: int, which: int) -> float:
    # Samples are appended layer by layer, repeat after repeat: sample i belongs to layer i % layers. Best
    # of the repeats per layer (the least disturbed), then the median over layers.
    return statistics.median(min(t[which] for t in samples[i::layers]) for i in range(layers))


def per_branch_und(split: Cosmos3Split, layer: torch.nn.Module, seqs: list[BranchSeq], is_last: bool) -> None:
    for seq in seqs:
        split.und_layer(layer, seq, is_last)


def per_branch_gen(split: Cosmos3Split, layer: torch.nn.Module, seqs: list[BranchSeq], index: int) -> None:
    for seq in seqs:
        split.gen_layer(layer, seq, index)


def grouped(max_rows: int, half: str):
    """The batched half over `row_groups` of at most max_rows rows: the CPU-friendly way to batch."""

    def run(split: Cosmos3Split, layer: torch.nn.Module, seqs: list[BranchSeq], arg) -> None:
        hidden = [s.gen_hidden if half == "GEN" else s.und_hidden for s in seqs]
        for group in row_groups(seqs, [h.shape[0] for h in hidden], max_rows):
            (gen_layer_batched if half == "GEN" else und_layer_batched)(split, layer, group, arg)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=4, help="active requests (K)")
    parser.add_argument("--tokens", type=int, default=1024, help="GEN tokens per image (1024 = 1024x1024 px)")
    parser.add_argument("--text", type=int, default=120, help="UND (prompt + template) tokens per branch")
    parser.add_argument("--max-rows", type=int, default=512, help="row budget of the grouped path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (torchrun sets 1)")
    parser.add_argument("--model", type=Path, help="checkpoint (default: the wide tiny model, in a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny(Path(tmp) / "wide", WIDE)
        split = load_context(model, torch.device("cpu")).split
    layers = split.transformer.layers
    generator = torch.Generator().manual_seed(0)
    # CFG on: a cond and an uncond branch per image, the uncond prompt a little shorter.
    und_lens = [args.text - (i % 2) * args.text // 4 for i in range(2 * args.images)]
    base = [make_seq(split, u, args.tokens, generator) for u in und_lens]
    last = len(layers) - 1
    paths = {
        "per": {"UND": per_branch_und, "GEN": per_branch_gen},
        "batched": {"UND": und_layer_batched, "GEN": gen_layer_batched},
        f"<={args.max_rows} rows": {half: grouped(args.max_rows, half) for half in ("UND", "GEN")},
    }
    keys = [(half, path) for half in ("GEN", "UND") for path in paths]
    times: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in keys}
    equal = dict.fromkeys(keys, True)

    with torch.inference_mode():
        for repeat in range(args.repeats):
            # Rotate which path goes first so cache warmth and a neighbour's load hit all of them alike.
            order = list(paths)[repeat % len(paths) :] + list(paths)[: repeat % len(paths)]
            seqs = {path: [fresh(s) for s in base] for path in paths}
            for half in ("UND", "GEN"):
                for index, layer in enumerate(layers):
                    for path in order:
                        arg = (index == last) if half == "UND" else index
                        times[half, path].append(timed(paths[path][half], split, layer, seqs[path], arg))
                for path in paths:
                    ref, got = seqs["per"], seqs[path]
                    if half == "UND":
                        equal[half, path] &= all(
                            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                            for p, q in zip(ref, got, strict=True)
                            for a, b in zip(p.und_kv, q.und_kv, strict=True)
                        )
                        for p, q in zip(ref, got, strict=True):
                            q.und_kv = p.und_kv  # so the GEN half is then compared alone
                    else:
                        equal[half, path] &= all(
                            torch.equal(p.gen_hidden, q.gen_hidden) for p, q in zip(ref, got, strict=True)
                        )

    rows = len(base) * args.tokens
    print(
        f"K={args.images} images x {args.tokens} tokens, CFG on: {len(base)} sequences, {rows} GEN rows, "
        f"{args.text} UND rows/branch; hidden {split.config.hidden_size}, {len(layers)} layers, "
        f"{torch.get_num_threads()} thread(s)"
    )
    # ms for one layer half over all the branches (best of the repeats, median over layers); ratio to per.
    head = ("half", "path", "wall ms/layer", "ratio", "CPU ms/layer", "ratio", "bit-equal")
    print(f"{head[0]:<5} {head[1]:<14} {head[2]:>14} {head[3]:>6} {head[4]:>13} {head[5]:>6} {head[6]}")
    for half in ("GEN", "UND"):
        per = [_best_per_layer(times[half, "per"], len(layers), which) for which in (0, 1)]
        for path in paths:
            wall, cpu = (_best_per_layer(times[half, path], len(layers), which) for which in (0, 1))
            print(
                f"{half:<5} {path:<14} {1e3 * wall:>14.2f} {wall / per[0]:>6.3f} {1e3 * cpu:>13.2f} "
                f"{cpu / per[1]:>6.3f} {equal[half, path]!s:>9}"
            )


if __name__ == "__main__":
    main()
