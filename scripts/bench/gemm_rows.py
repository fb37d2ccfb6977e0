"""Probe: for which row counts M does a float32 GEMM row depend on how many rows share the call?

The project's exactness under `--sp` (shards of a sequence) and batched branches (rows of several
sequences in one GEMM) rests on one BLAS property: a row of `F.linear(x, W)` computed in a call of M rows
is bit-identical to the same row computed inside a larger call. That is the BLAS's and the CPU's
property, not ours, so no test asserts its thresholds: this script measures them, one subprocess per
numerics setting (MKL reads MKL_CBWR and MKL_ENABLE_INSTRUCTIONS once, at its first call).

How to read the table: one row per (setting, threads, K = N); `differs at M` lists the row counts whose
rows differ from the top M rows of a 1024-row call, and `M >= 16 exact` says whether every M from 16
up (the `--sp` shard floor, MIN_SHARD_ROWS) agreed, also when split into uneven shards of a 33..1024
row sequence. `yes` everywhere in that column is what `--sp` and batched branches need to be bit-exact.

    python scripts/bench/gemm_rows.py            # the default settings list below
    python scripts/bench/gemm_rows.py --markdown # the same table for docs/numerics.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# (label, environment overrides); None removes the variable. cosmos3_batch is not imported by the child,
# so "MKL default" really is MKL's default (the project would set strict mode itself).
SETTINGS: list[tuple[str, dict[str, str | None]]] = [
    ("MKL default (CNR off)", {"MKL_CBWR": None}),
    ("MKL_CBWR=AUTO,STRICT (project default)", {"MKL_CBWR": "AUTO,STRICT"}),
    ("MKL_CBWR=COMPATIBLE", {"MKL_CBWR": "COMPATIBLE"}),
    (
        "AUTO,STRICT + MKL_ENABLE_INSTRUCTIONS=AVX",
        {"MKL_CBWR": "AUTO,STRICT", "MKL_ENABLE_INSTRUCTIONS": "AVX"},
    ),
]
HIDDEN = (64, 128, 512, 4096)
ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 15, 16, 17, 24, 32, 57, 64, 100, 160, 256, 512)
SEQUENCES = (33, 48, 100, 255, 1024)  # sequences split into --sp shards (2 and 4 ways)


def _shards(rows: int, parts: int) -> list[int]:
    base, extra = divmod(rows, parts)
    return [base + (i < extra) for i in range(parts)]


def _measure(threads: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    results = []
    for hidden in HIDDEN:
        generator = torch.Generator().manual_seed(hidden)
        weight = torch.randn(hidden, hidden, generator=generator)
        x = torch.randn(1024, hidden, generator=generator)
        full = F.linear(x, weight)
        differs = [m for m in ROWS if not torch.equal(F.linear(x[:m].clone(), weight), full[:m])]
        shard_ok = True
        for total in SEQUENCES:
            whole = F.linear(x[:total].clone(), weight)
            for parts in (2, 4):
                start = 0
                for n in _shards(total, parts):
                    if n >= 16:
                        shard_ok &= torch.equal(
                            F.linear(x[start : start + n].clone(), weight), whole[start : start + n]
                        )
                    start += n
        exact16 = shard_ok and all(m < 16 for m in differs)
        results.append({"threads": threads, "hidden": hidden, "differs": differs, "exact16": exact16})
    return results


def _child() -> None:
    import torch

    out = {"capability": torch.backends.cpu.get_cpu_capability(), "rows": _measure(1) + _measure(2)}
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print a Markdown table (for docs/numerics.md)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child()
        return
    rows = []
    for label, overrides in SETTINGS:
        env = dict(os.environ)
        for key, value in overrides.items():
            env.pop(key, None) if value is None else env.__setitem__(key, value)
        done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{label}: probe failed\n{done.stderr}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows += [(label, result["capability"], r) for r in result["rows"]]
    from cosmos3_batch.model.numerics import cpu_name

    cpu = cpu_name()
    print(f"CPU: {cpu}; float32 F.linear, K = N; M rows alone vs the top M rows of a 1024-row call")
    head = ("setting", "ATen", "threads", "K", "differs at M", "M >= 16 exact")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for label, capability, r in rows:
        cells = (
            label,
            capability,
            str(r["threads"]),
            str(r["hidden"]),
            ", ".join(map(str, r["differs"])) or "none",
            "yes" if r["exact16"] else "NO",
        )
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(f"{c:<10}" for c in cells))


if __name__ == "__main__":
    main()
