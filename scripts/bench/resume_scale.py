"""Datasets at scale (docs/scale.md, "A million outputs"): a rerun's start-up over N complete requests, and
the cost of writing one more sample as the dataset grows, for the nested files layout, the flat one, and
WebDataset shards.

    python scripts/bench/resume_scale.py [--quick] [--count N] [--layouts nested,flat,webdataset]

For each layout: N complete outputs (tiny 32x32 PNG requests) are written with the job's own writer
(`finish/results.py ResultWriter`, sidecars or shards and metrics rows as a run writes them); the writes
of the first 1,000 and of the last 1,000 are timed with fsync as a run does, the ones between are written
with fsync off to keep the set-up short (what is on disk is the same); then metrics.csv and
manifest.parquet are written as the run's end writes them. Then `cosmos3-batch run` is started on the
same request file in a fresh process, as a user reruns a finished job, and once more in this process
(imports done: the start-up the project's own code takes); both must find all N complete. Wall and CPU
seconds of each. Goal: <= 10 s at 100,000 (the default N; --quick: 5,000).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

GOAL_S = 10.0
TIMED = 1_000  # samples timed at the start and at the end of the set-up


def write_requests(path: Path, count: int) -> None:
    with open(path, "w") as f:
        for i in range(count):
            row = {"id": f"s{i:07d}", "prompt": f"a red cube {i % 997}", "size": "32x32", "num_frames": 1}
            f.write(json.dumps({**row, "num_inference_steps": 2, "seed": i}) + "\n")


@contextlib.contextmanager
def no_fsync(active: bool):
    real = os.fsync
    if active:
        os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = real


def fill(out: Path, prompts: Path, fmt: str, layout: str, model: Path) -> tuple[float, float]:
    """Write every request's outputs as a run would; (ms per sample of the first and of the last TIMED)."""
    import numpy as np
    import torch

    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.config import make_config
    from cosmos3_batch.io.dataset import Dataset, write_record
    from cosmos3_batch.io.metrics import MetricsWriter, state_dir
    from cosmos3_batch.pipeline.finish.results import ResultWriter, shard_writer
    from cosmos3_batch.pipeline.job.dtypes import compute_tag
    from cosmos3_batch.pipeline.kinds.denoise import Result
    from cosmos3_batch.requests.parse import load_requests

    flags = {"format": fmt, **({"layout": layout} if fmt == "files" else {"shard_size": "1GB"})}
    cfg = make_config("allgather", None, prompts=str(prompts), out=out, model=model, **flags)
    checkpoint = Checkpoint.open(model)
    identity = checkpoint.identity() + compute_tag(cfg, checkpoint)
    requests, _ = load_requests(str(prompts))
    out.mkdir(parents=True)
    state_dir(out)
    held = Dataset(fmt, layout if fmt == "files" else "flat")
    write_record(out, held)
    metrics = MetricsWriter(out, rank=0)
    writer = ResultWriter(
        cfg, model, metrics, identity, layout=held.layout, shards=shard_writer(cfg, held, 0), weights={}
    )
    result = Result(latents=torch.zeros(1, 48, 1, 2, 2), frames=np.full((1, 32, 32, 3), 0.5, np.float32))
    times = []
    for number, r in enumerate(requests):
        job = SimpleNamespace(request=r, timings={"prepare_s": 0.0}, tokens=10, admitted_at=time.time())
        job.__dict__.update(admitted_perf=time.perf_counter(), weight_bytes=0, stall_s=0.0)
        timed = number < TIMED or number >= len(requests) - TIMED
        if number in (0, len(requests) - TIMED):
            os.sync()  # the untimed writes' dirty pages must not land in the timed fsyncs
        with no_fsync(not timed):
            start = time.perf_counter()
            writer(job, result, None)
            times.append(time.perf_counter() - start if timed else 0.0)
    writer.finish()
    metrics.close()
    assert len(writer.ok) == len(requests) and not writer.failed
    from cosmos3_batch.io.manifest import write_manifest
    from cosmos3_batch.io.metrics import merge_metrics

    merge_metrics(out)  # what the end of the run that wrote them leaves, as a rerun finds it
    write_manifest(out, tag=cfg.tag)
    first, last = times[:TIMED], times[-TIMED:]
    return 1e3 * sum(first) / len(first), 1e3 * sum(last) / len(last)


def rerun(out: Path, prompts: Path, model: Path, fmt: str, count: int) -> tuple[float, float, float, float]:
    """A fresh `cosmos3-batch run` process (wall and CPU seconds), then the same run in this process, where
    the interpreter, torch and diffusers are already imported (wall and CPU seconds): all N complete. CPU
    seconds hardly move when other jobs share the machine; wall seconds do."""
    args = ["run", str(prompts), "--model", str(model), "--out", str(out), "--no-progress", "--format", fmt]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as stdout:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "cosmos3_batch", *args], stdout=stdout, stderr=stdout, env=env
        )
        _, status, usage = os.wait4(proc.pid, 0)
        fresh = time.perf_counter() - start
        stdout.seek(0)
        text = stdout.read()
    assert os.waitstatus_to_exitcode(status) == 0 and f"0 generated, 0 failed, {count} already" in text, text[
        -2000:
    ]
    from cosmos3_batch.cli import app

    logging.getLogger("cosmos3_batch").setLevel(logging.WARNING)  # its list of 100,000 skipped ids
    start, cpu = time.perf_counter(), time.process_time()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            app(args, prog_name="cosmos3-batch")
    except SystemExit as exc:
        assert exc.code == 0, exc.code
    warm, warm_cpu = time.perf_counter() - start, time.process_time() - cpu
    return fresh, usage.ru_utime + usage.ru_stime, warm, warm_cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="5,000 requests (a smoke run).")
    parser.add_argument("--count", type=int, default=None, help="Complete requests (default 100,000).")
    parser.add_argument(
        "--layouts", default="nested,flat,webdataset", help="Which of nested, flat, webdataset."
    )
    args = parser.parse_args()
    count = args.count or (5_000 if args.quick else 100_000)
    from cosmos3_batch.model.tiny import ensure_default_tiny

    model = ensure_default_tiny()
    root = Path(tempfile.mkdtemp(prefix="resume-scale-"))
    try:
        prompts = root / "p.jsonl"
        write_requests(prompts, count)
        print(f"{count:,} complete requests (rerun: a fresh process; in-process: imports already done);"
              f" load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
        print(f"{'layout':>12} {'write ms first':>14} {'write ms last':>13} {'last/first':>10} "
              f"{'rerun s':>8} {'(cpu)':>6} {'in-process s':>12} {'(cpu)':>6} {'s/goal':>7}")  # fmt: skip
        chosen = args.layouts.split(",")
        layouts = [("files", "nested"), ("files", "flat"), ("webdataset", "-")]
        for fmt, layout in [(f, x) for f, x in layouts if (x if f == "files" else f) in chosen]:
            out = root / f"{fmt}-{layout}"
            first, last = fill(out, prompts, fmt, layout, model)
            fresh, fresh_cpu, warm, warm_cpu = rerun(out, prompts, model, fmt, count)
            name = layout if fmt == "files" else "webdataset"
            print(
                f"{name:>12} {first:>14.2f} {last:>13.2f} {last / first:>10.2f} {fresh:>8.1f} "
                f"{fresh_cpu:>6.1f} {warm:>12.1f} {warm_cpu:>6.1f} {fresh / GOAL_S:>7.2f}"
            )
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
