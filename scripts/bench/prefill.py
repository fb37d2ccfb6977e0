"""Choosing the prefill rule with the pass simulator (DESIGN.md §4), and checking it on a real run.

1. `--real` (default on): the issue's 48-request mix (6-14 steps; images and 5/9-frame videos; guidance
   1.0/4/6) on 4 gloo ranks at --max-active 4, run for real through `cosmos3-torchrun` with the old
   rule (a UND pass whenever any rank admits: free share 1/slots, no wait, no look-ahead) and with the
   defaults: UND share of weight bytes, mean slot occupancy, bytes per output, and the simulator's
   prediction beside each measured figure.
2. Realistic jobs at N = 8, 16, 64 (35-50 steps; 480p/720p videos and 1024^2 images, guidance 6 or 1)
   with Cosmos3-Nano's part sizes: a grid of rules, simulated.

    python scripts/bench/prefill.py [--no-real]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cosmos3_batch.plan.prefill import PrefillRule
from cosmos3_batch.plan.simulator import PartBytes, SimRequest, Simulation, simulate

# Cosmos3-Nano at any world size: 36 layers, each half-layer part 385,894,400 B in bf16; under allgather a
# rank moves the whole part per fetch (its shard host->device, the rest gathered).
NANO = PartBytes(gen=36 * 385_894_400, und=36 * 385_894_400)
OLD = ("old: UND whenever a rank admits", lambda slots: PrefillRule(1 / slots, 0, 0))


def issue_mix(seed: int = 0, count: int = 48) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        frames = rng.choice([1, 1, 5, 9])
        rows.append(
            {
                "id": f"m{i:02d}",
                "prompt": rng.choice(["a cat", "ocean waves at night", "a busy street", "snow on pines"]),
                "num_frames": frames,
                "size": "32x32",
                "num_inference_steps": rng.randint(6, 14),
                "guidance_scale": rng.choice([1.0, 4.0, 6.0]),
            }
        )
    return rows


def realistic(world: int, per_rank: int, seed: int) -> list[list[SimRequest]]:
    """Dataset-like: 35-50 steps, mostly CFG; the schedule balances cost, so queues come from assign()."""
    from cosmos3_batch.plan.schedule import assign
    from cosmos3_batch.requests.parse import parse_lines

    rng = random.Random(seed)
    lines = []
    for i in range(world * per_rank):
        kind = rng.choice(["1024x1024:1", "832x480:93", "1280x720:189", "832x480:189"])
        size, frames = kind.split(":")
        row = {"id": f"j{i}", "prompt": "x", "size": size, "num_frames": int(frames)}
        row |= {
            "num_inference_steps": rng.randint(35, 50),
            "guidance_scale": rng.choice([6.0, 6.0, 6.0, 1.0]),
        }
        lines.append(json.dumps(row).encode())
    requests, errors = parse_lines(lines)
    assert not errors, errors
    return [
        [SimRequest(r.id, r.num_inference_steps, 1 if r.guidance_scale == 1.0 else 2) for r in queue]
        for queue in assign(requests, world).queues
    ]


def mix_queues(seed: int, world: int) -> list[list[SimRequest]]:
    from cosmos3_batch.plan.schedule import assign
    from cosmos3_batch.requests.parse import parse_lines

    requests, _ = parse_lines([json.dumps(r).encode() for r in issue_mix(seed)])
    return [
        [SimRequest(r.id, r.num_inference_steps, 1 if r.guidance_scale == 1.0 else 2) for r in queue]
        for queue in assign(requests, world).queues
    ]


def row(label: str, sim: Simulation) -> str:
    return (
        f"| {label} | {sim.passes} | {sim.und_passes} | {sim.und_byte_share:.1%} | {sim.occupancy:.1%} "
        f"| {sim.bytes_per_output / 1e9:,.1f} |"
    )


def grid(worlds: list[int], max_active: int) -> None:
    rules = [
        ("free 0.25, wait 2, ahead 4", PrefillRule(0.25, 2, 4)),
        ("free 0.25, wait 2, ahead 3 (default)", PrefillRule(0.25, 2, 3)),
        ("free 0.25, wait 4, ahead 2", PrefillRule(0.25, 4, 2)),
        ("free 0.25, wait 4, ahead 1", PrefillRule(0.25, 4, 1)),
        ("free 0.5, wait 8, ahead 2", PrefillRule(0.5, 8, 2)),
        ("free 0.125, wait 2, ahead 2", PrefillRule(0.125, 2, 2)),
        ("free 0.25, wait 4, ahead 0", PrefillRule(0.25, 4, 0)),
    ]
    print(f"\n### Simulated: the 48-request mix, 6 seeds, N=4, --max-active {max_active}\n")
    print("| rule | occupancy (min-max) | UND share of bytes (min-max) |")
    print("|---|---|---|")
    label, make = OLD
    for name, rule in [(label, make(4 * max_active)), *rules]:
        sims = [simulate(mix_queues(seed, 4), max_active, rule, PartBytes(1, 1)) for seed in range(6)]
        occ = [s.occupancy for s in sims]
        und = [s.und_byte_share for s in sims]
        print(f"| {name} | {min(occ):.1%}-{max(occ):.1%} | {min(und):.1%}-{max(und):.1%} |")
    print(f"\n### Simulated, Nano part sizes, --max-active {max_active}, 16 requests per rank\n")
    print("| N | rule | passes | UND passes | UND share of bytes | occupancy | GB per output |")
    print("|---|---|---|---|---|---|---|")
    for world in worlds:
        queues = realistic(world, 16, seed=world)
        label, make = OLD
        for name, rule in [(label, make(world * max_active)), *rules]:
            print(f"| {world} " + row(name, simulate(queues, max_active, rule, NANO)))


def real_run(rows: list[dict], rule: PrefillRule, world: int, max_active: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    prompts = folder / "p.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cmd = [sys.executable, "-m", "cosmos3_batch.parallel.launch", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--out", str(folder / "out"), "--no-progress"]
    cmd += ["--max-active", str(max_active), "--prefill-free-share", str(rule.free_share)]
    cmd += ["--prefill-max-wait", str(rule.max_wait), "--prefill-lookahead", str(rule.lookahead)]
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    summary = json.loads((folder / "out" / "summary.json").read_text())
    summary["seconds"] = time.perf_counter() - started
    return summary


def real(world: int = 4, max_active: int = 4) -> None:
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.engine.transport import OffloadMode
    from cosmos3_batch.model.tiny import ensure_default_tiny
    from cosmos3_batch.plan import planner
    from cosmos3_batch.plan.model_shape import model_shape
    from cosmos3_batch.plan.schedule import assign
    from cosmos3_batch.requests.parse import parse_lines

    rows = issue_mix()
    requests, _ = parse_lines([json.dumps(r).encode() for r in rows])
    import torch

    shape = model_shape(Checkpoint.open(ensure_default_tiny()), world, torch.bfloat16)
    und_parts = [p for p in shape.parts if not p.key.endswith("gen")]
    und_bytes = sum(planner._bytes_per_pass(und_parts, OffloadMode.ALLGATHER, world))
    print(f"\n### Real run: 48-request mix, {world} gloo ranks, --max-active {max_active} (tiny model)\n")
    print(
        "| rule | passes (sim) | UND passes (sim) | UND share of bytes (sim) | occupancy (sim) | MB/output |"
    )
    print("|---|---|---|---|---|---|")
    label, make = OLD
    for name, rule in [(label, make(world * max_active)), ("default", PrefillRule())]:
        summary = real_run(rows, rule, world, max_active)
        sim = planner.simulate_job(
            assign(requests, world).queues, max_active, rule, shape, OffloadMode.ALLGATHER, world
        )
        ranks = summary["ranks"]
        moved = sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks)
        und_share = ranks[0]["und_passes"] * und_bytes * world / moved
        occupancy = sum(r["active_sum"] for r in ranks) / (ranks[0]["passes"] * world * max_active)
        print(
            f"| {name} | {ranks[0]['passes']} ({sim.passes}) | {ranks[0]['und_passes']} ({sim.und_passes}) "
            f"| {und_share:.1%} ({sim.und_byte_share:.1%}) | {occupancy:.1%} ({sim.occupancy:.1%}) "
            f"| {moved / 1e6 / summary['generated_ok']:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--real",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also check the rule on a real run",
    )
    args = parser.parse_args()
    if args.real:
        real()
    grid([4, 8, 16, 64], max_active=4)


if __name__ == "__main__":
    main()
