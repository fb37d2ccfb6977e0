"""Reasoner decode cost on CPU, measured side by side in one run (docs/reasoner.md, "Cost").

For N sequences sharing passes (every pass a decode pass), the UND half streamed and held (--und-resident),
the weight bytes each generated token cost (host->device + gathered, all ranks, as the engine counts them;
all UND parts' in a job of reasoner requests alone), and the tokens per second of the decode loop at world 2
(a torchrun launch) next to transformers' `generate` at batch 1 on the same requests and CPU (at the one
thread torchrun gives each rank).

    python scripts/bench/reasoner.py [--ckpt DIR] [--tokens 16] [--counts 1,8,64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `tests.reasoner_reference`, the reference this compares with
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def rows(count: int, tokens: int) -> list[dict]:
    return [
        {"id": f"r{i}", "prompt": f"Describe scene {i}.", "reason": {"max_new_tokens": tokens}}
        for i in range(count)
    ]


def run(ckpt: Path, count: int, tokens: int, folder: Path, world: int, resident: bool = False) -> dict:
    """One job of `count` reasoner requests at `world` ranks, the UND half streamed or (`resident`) held."""
    prompts = folder / f"p{count}-{world}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows(count, tokens)))
    out = folder / f"out{count}-{world}-{'resident' if resident else 'streamed'}"
    args = [
        "run",
        str(prompts),
        "--model",
        str(ckpt),
        "--out",
        str(out),
        "--no-progress",
        "--max-reason-active",  # the reasoner sequences sharing a rank's passes (their own slots)
        str(count),
        "--und-resident" if resident else "--no-und-resident",
    ]
    launch = [sys.executable, "-m", "cosmos3_batch"]
    if world > 1:
        torchrun = [
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "cosmos3_batch",
        ]
        launch = [sys.executable, "-m", *torchrun]
    subprocess.run([*launch, *args], check=True, env=ENV, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    generated = sum(
        json.loads((out / f"r{i}.json").read_text())["reason"]["generated_tokens"] for i in range(count)
    )
    ranks = summary["ranks"]
    # A job of reasoner requests alone has no GEN work: every byte it moves is a UND part's (padded as the
    # engine's slots hold it; streamed, beside it, the unpadded payload the UND passes would fetch).
    moved = sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks)
    payload = {} if resident else {"und_payload_per_token": ranks[0]["und_passes"] * und_bytes(ckpt) * world}
    return {
        "sequences": count,
        "world": world,
        "und": "resident" if resident else "streamed",
        "tokens": generated,
        "passes": ranks[0]["passes"],
        "bytes_per_token": moved / generated,
        **{key: value / generated for key, value in payload.items()},
        "pass_s": max(r["pass_s"] for r in ranks),
        "tokens_per_s": generated / max(r["pass_s"] for r in ranks),
    }


def und_bytes(ckpt: Path) -> int:
    """Bytes of every layer's UND part (unpadded): what a decode pass fetches beside the GEN parts."""
    from safetensors import safe_open

    from cosmos3_batch.model.cosmos3 import UND, part_of

    total = 0
    for path in (ckpt / "transformer").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names = f.keys()  # a safe_open handle is not iterable itself
            for name in names:
                if name.startswith("layers.") and part_of(name.split(".", 2)[2]) == UND:
                    tensor = f.get_tensor(name)
                    total += tensor.numel() * tensor.element_size()
    return total


def generate_rate(ckpt: Path, count: int, tokens: int) -> float:
    """transformers' generate at batch 1, one request after another: tokens per second."""
    import torch

    from cosmos3_batch.requests.reason import ReasonSpec
    from tests.reasoner_reference import reference_ids

    torch.set_num_threads(1)
    spec = ReasonSpec(max_new_tokens=tokens)
    reference_ids(ckpt, "warm up", ReasonSpec(max_new_tokens=2), 0)
    started, generated = time.perf_counter(), 0
    for row in rows(count, tokens):
        generated += len(reference_ids(ckpt, row["prompt"], spec, 0))
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--counts", default="1,8,64")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = args.ckpt
        if ckpt is None:
            from cosmos3_batch.model.tiny import TinySpec, write_tiny

            ckpt = write_tiny(folder / "tiny", TinySpec(reasoner=True))
        for count in [int(c) for c in args.counts.split(",")]:
            for resident in (False, True):
                print(json.dumps(run(ckpt, count, args.tokens, folder, 1, resident)))
        for resident in (False, True):
            print(json.dumps(run(ckpt, 8, args.tokens, folder, 2, resident)))
        print(json.dumps({"generate_batch_1_tokens_per_s": generate_rate(ckpt, 8, args.tokens)}))


if __name__ == "__main__":
    main()
