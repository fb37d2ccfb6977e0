"""What the first GPU run would hit, round two (issue 48): one section per finding, on one GPU.

    python scripts/gpu/review_two.py [--device cuda:0] [--tmp DIR] [--out review_two.md]

NCCL refuses two ranks on one device, so two ranks sharing the GPU run every group on gloo: the closest this
single-GPU machine comes to the NCCL paths. Each section runs real `cosmos3-batch` jobs on the tiny model.

1. The decode team beside the loop (`--sp 2 --vae-patch-parallel-size 2`, 2 ranks): the team's messages
   staged through host memory from the finisher thread while the loop gathers; the outputs against the same
   requests unsplit in one process. Read: "identical" = outputs whose bytes equal the one-process run's
   (a split decode on a GPU may differ in the last bit: the table says by how much), and the job ended.
2. SeaCache decisions inside an `--sp` group (`--cache sea --sp 2`, 2 ranks): the members gate with the
   lead's distances; the sidecars' decisions against one process. Read: equal decisions, no hang.
3. Device timings: one process; the engine's totals in summary.json (every pass drained at the end) against
   the per-pass rows of passes.*.csv (read at each pass's end: the last passes' device times come late).
   Read: summary stall_s / compute_s >= the CSV's sums; "clocks" as summary.json says them.
4. A stalled peer on the GPU (2 ranks, rank 1 SIGSTOPped after the first output): the survivors' exit code
   and line. Read: exit 69 and a line naming rank 1 and the place.

Prints markdown tables (docs/benchmarks.md). With `--device cpu` the same jobs run on the CPU (a dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from layers import markdown  # noqa: E402
from multi_rank import run_job  # noqa: E402

REQUESTS = [  # i1's latent (8 x 8) is large enough to split over two ranks; v0 runs enough steps to reuse
    {"id": "i0", "prompt": "a red cube", "size": "64x64", "num_frames": 1, "num_inference_steps": 6},
    {"id": "i1", "prompt": "a blue sphere", "size": "128x128", "num_frames": 1, "num_inference_steps": 2},
    {"id": "v0", "prompt": "a lighthouse", "size": "64x32", "num_frames": 9, "num_inference_steps": 12},
    {"id": "v1", "prompt": "waves at night", "size": "32x64", "num_frames": 5, "num_inference_steps": 5},
]


def _setup(tmp: Path, device: str) -> tuple[list[str], dict]:
    model, prompts = tmp / "tiny", tmp / "requests.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    if not model.exists():
        run_job(["make-tiny", str(model)], 1, env)
    return [str(prompts), "--model", str(model), "--device", device, "--no-progress"], env


def _outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".png", ".mp4")}


def decode_team_section(device: str, tmp: Path) -> str:
    common, env = _setup(tmp, device)
    one, two = tmp / "team-one", tmp / "team-two"
    run_job(["run", *common, "--out", str(one)], 1, env)
    started = time.monotonic()
    run_job(["run", *common, "--sp", "2", "--vae-patch-parallel-size", "2", "--out", str(two)], 2, env)
    seconds = time.monotonic() - started
    ref, got = _outputs(one), _outputs(two)
    same = sum(ref[name] == got.get(name) for name in ref)
    ranks = json.loads((two / "summary.json").read_text())["ranks"]
    split = "/".join(str(r["vae_split_decodes"]) for r in ranks)
    rows = [
        [f"--sp 2 --vae-patch-parallel-size 2 on {device}", f"{same}/{len(ref)}", split, f"{seconds:.1f}"]
    ]
    title = "### Decode team on gloo (host-staged) from the finisher thread, 2 ranks, vs one process\n\n"
    return title + markdown(["run", "identical outputs", "split decodes per rank", "wall s"], rows)


def _decisions(out: Path) -> dict[str, dict]:
    return {
        r["id"]: json.loads((out / f"{r['id']}.json").read_text())["cache"]["decisions"] for r in REQUESTS
    }


def sea_section(device: str, tmp: Path) -> str:
    common, env = _setup(tmp, device)
    one, two = tmp / "sea-one", tmp / "sea-two"
    sea = ["--cache", "sea", "--cache-threshold", "1.0"]  # a loose threshold: some steps reuse
    run_job(["run", *common, *sea, "--out", str(one)], 1, env)
    run_job(["run", *common, *sea, "--sp", "2", "--out", str(two)], 2, env)
    ref, got = _decisions(one), _decisions(two)
    ranks = json.loads((two / "summary.json").read_text())["ranks"]
    traces = "equal" if ranks[0]["collective_trace"] == ranks[1]["collective_trace"] else "DIFFER"
    same = sum(ref[k] == got[k] for k in ref)
    rows = [[f"--cache sea --sp 2 on {device}", f"{same}/{len(ref)}", traces, json.dumps(got["v0"])]]
    title = "### SeaCache decisions inside an --sp group (the lead's distances) vs one process\n\n"
    return title + markdown(["run", "equal decisions", "group traces", "v0's decisions"], rows)


def timings_section(device: str, tmp: Path) -> str:
    common, env = _setup(tmp, device)
    out = tmp / "timings"
    run_job(["run", *common, "--out", str(out)], 1, env)
    summary = json.loads((out / "summary.json").read_text())
    rank = summary["ranks"][0]
    with next((out / ".cosmos3_batch").glob("passes.*rank0.csv")).open() as f:
        rows = list(csv.DictReader(f))
    csv_stall = sum(float(r["stall_s"]) for r in rows)
    table = [[len(rows), rank["stall_s"], csv_stall, rank["compute_s"], summary["clocks"]["stall_s"]]]
    title = "### Device timings: summary totals (drained at the end) vs the per-pass rows\n\n"
    return title + markdown(["passes", "summary stall_s", "CSV stall_s sum", "compute_s", "clock"], table)


def stall_section(device: str, tmp: Path) -> str:
    common, env = _setup(tmp, device)
    out, long = tmp / "stall", tmp / "long.jsonl"
    # Enough work that the job is far from done when rank 1 stops: 8 requests of 30 steps.
    rows = [
        {"id": f"s{k}", "prompt": f"scene {k}", "size": "64x64", "num_inference_steps": 30} for k in range(8)
    ]
    long.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [str(long), *common[1:]]
    launch = [sys.executable, "-m", "cosmos3_batch.parallel.launch", "--standalone", "--nproc-per-node=2"]
    flags = ["--collective-timeout-s", "20", "--max-active", "1", "--out", str(out)]
    job = subprocess.Popen(
        [*launch, "-m", "cosmos3_batch", "run", *common, *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not list(out.glob("s*.json")) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    stopped = _rank_worker(job.pid, 1)
    if stopped is not None:
        os.kill(stopped, signal.SIGSTOP)
    try:
        text, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if stopped is not None:
            with_signal(stopped, signal.SIGKILL)
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    table = [[f"rank 1 SIGSTOPped on {device}", job.returncode, last[0][:160]]]
    return "### A stalled peer on the GPU: exit code and line\n\n" + markdown(["run", "exit", "line"], table)


def _rank_worker(launcher: int, rank: int) -> int | None:
    """The launcher's worker process of `rank` (its RANK in the environment), None if gone."""
    found = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    for pid in map(int, found):
        with contextlib.suppress(OSError):
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    return None


def with_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda:0", help="cuda:N (every rank on GPU N), or cpu for a dry run"
    )
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where files go")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--only", type=int, nargs="*", help="section numbers to run (default: all)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="review-two-", dir=args.tmp))
    builders = [decode_team_section, sea_section, timings_section, stall_section]
    sections = []
    for number, build in enumerate(builders, 1):
        if args.only and number not in args.only:
            continue
        try:
            sections.append(build(args.device, tmp))
        except Exception as exc:  # one failed section must not hide the others' tables
            sections.append(f"### section {number} failed\n\n{type(exc).__name__}: {str(exc)[-2000:]}")
        print("\n" + sections[-1], flush=True)
    if args.out:
        args.out.write_text("\n\n".join(sections) + "\n")
    return 0 if not any(" failed\n" in s for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
