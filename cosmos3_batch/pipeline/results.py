"""What each finished request leaves on disk: its files (sidecar last) and its metrics row."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import cosmos3_batch
from cosmos3_batch.config import RunConfig
from cosmos3_batch.io import outputs
from cosmos3_batch.io.metrics import MetricsWriter, iso_time
from cosmos3_batch.pipeline.denoise import RequestJob, Result
from cosmos3_batch.requests.parse import Request

log = logging.getLogger("cosmos3_batch")


def output_key(r: Request, model_identity: str, vae_tiling: bool) -> str:
    """What besides the request decides the output bytes: the model and how we decode."""
    text = json.dumps([r.content_hash(), model_identity, vae_tiling])
    return hashlib.sha256(text.encode()).hexdigest()


def versions() -> dict[str, str]:
    import diffusers
    import transformers

    return {
        "cosmos3_batch": cosmos3_batch.__version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }


@dataclass
class ResultWriter:
    """Writes each finished request's files (sidecar last) and its metrics row (columns: docs/outputs.md)."""

    cfg: RunConfig
    model_dir: Path
    metrics: MetricsWriter
    model_identity: str
    rank: int = 0
    weights: dict | None = None  # weights_report(): the sidecar says which math made the output
    loop_started: float = field(default_factory=time.time)  # queue_s counts from here
    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def __call__(self, job: RequestJob, result: Result | None, error: str | None) -> None:
        r = job.request
        output = ""
        if result is not None:
            try:
                output = self._write(job, result)
            except Exception as exc:  # disk full, encoder error: this request fails, the job goes on
                error = f"{type(exc).__name__}: {exc}"
        if error is None:
            self.ok.append(r.id)
        else:
            self.failed[r.id] = error
            log.warning("request %s failed: %s", r.id, error)
        self.row(job, "ok" if error is None else "failed", output, error)

    def row(self, job: RequestJob, status: str, output: str = "", error: str | None = None) -> None:
        r = job.request
        timings = job.timings
        try:
            self.metrics.row(
                id=r.id,
                status=status,
                kind=r.kind,
                width=r.width,
                height=r.height,
                num_frames=r.num_frames,
                steps=r.num_inference_steps,
                guidance=r.guidance_scale,
                seed=r.seed,
                tokens=job.tokens,
                queue_s=max(0.0, job.admitted_at - self.loop_started),
                latency_s=time.perf_counter() - job.admitted_perf,
                weight_bytes=round(job.weight_bytes),
                stall_s=job.stall_s,
                rank=self.rank,
                admitted_at=iso_time(job.admitted_at),
                finished_at=iso_time(time.time()),
                output=output,
                error=error,
                **{k: timings.get(k) for k in ("prepare_s", "denoise_s", "decode_s", "write_s")},
            )
        except OSError as exc:  # a full disk must fail this row, not the rank (its peers would hang)
            log.error("request %s: cannot append its metrics row: %s", r.id, exc)

    def _write(self, job: RequestJob, result: Result) -> str:
        r = job.request
        start = time.perf_counter()
        paths = outputs.paths_for(self.cfg.out, r.id, r.num_frames)
        frames = outputs.to_uint8(result.frames)
        audio = (result.sound, result.sample_rate) if result.sound is not None else None
        if r.num_frames == 1:
            size = outputs.write_png(paths.media, frames[0])
        else:
            size = outputs.write_mp4(paths.media, frames, r.fps, audio=audio)
        files = {"media": {"name": paths.media.name, "bytes": size}}
        if audio is not None:
            size = outputs.write_wav(paths.wav, *audio)
            files["wav"] = {"name": paths.wav.name, "bytes": size}
        if result.actions is not None:
            files.update(outputs.write_actions(paths, result.actions, r))
        if self.cfg.save_latents:
            size = outputs.write_latents(paths.latents, result.latents, sound=result.sound)
            files["latents"] = {"name": paths.latents.name, "bytes": size}
        job.timings["write_s"] = time.perf_counter() - start  # the media and latents; the sidecar is tiny
        sidecar = {
            "id": r.id,
            "status": "complete",
            "kind": r.kind,
            "request": r.resolved(),
            "request_hash": r.content_hash(),
            "output_key": output_key(r, self.model_identity, self.cfg.vae_tiling),
            "seed": r.seed,
            "tokens": job.tokens,
            "files": files,
            **outputs.media_facts(result),
            "timings": {k: round(v, 6) for k, v in job.timings.items()},
            **(self.cfg.model_source.record() if self.cfg.model_source else {"model": str(self.model_dir)}),
            "weights": self.weights,
            "versions": versions(),
        }
        outputs.write_json(paths.sidecar, sidecar)
        return paths.media.name
