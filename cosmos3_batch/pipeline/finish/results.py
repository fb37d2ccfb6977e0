"""What each finished request leaves on disk: its files (sidecar last) and its metrics row."""

from __future__ import annotations

import contextlib
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
from cosmos3_batch.io.catalog import complete_outputs
from cosmos3_batch.io.ffmpeg import EncoderInterrupted
from cosmos3_batch.io.inputs import input_record
from cosmos3_batch.io.metrics import MetricsWriter, ids_with_ok_rows, iso_time
from cosmos3_batch.io.shards import Pending, ShardLost, ShardWriter, sample_key, shard_kind
from cosmos3_batch.io.space import describe_refusal, disk_errno
from cosmos3_batch.io.text_outputs import chain_facts, reason_facts, write_text
from cosmos3_batch.parallel.exit_codes import ExitCode
from cosmos3_batch.parallel.stop import JobFault, StopRequest
from cosmos3_batch.pipeline.finish.blocked import Blocked, record_blocked
from cosmos3_batch.pipeline.finish.guardrail import (
    VIDEO_BLOCKED,
    Guardrails,
    check_result,
    withhold_unsafe_answers,
)
from cosmos3_batch.pipeline.finish.samples import INDEXED, files_record, stage_media, stage_texts
from cosmos3_batch.pipeline.kinds.denoise import RequestJob, Result
from cosmos3_batch.pipeline.kinds.reason import TextResult
from cosmos3_batch.pipeline.kinds.step_cache.cache import cache_report, forward_counts
from cosmos3_batch.pipeline.kinds.transfer.controls import controls_record
from cosmos3_batch.requests.parse import Request

log = logging.getLogger("cosmos3_batch")
STOP_NOTICE_S = 5.0  # how long a signal-killed encode waits for the job's own stop to show (`_stopping`)


def output_key(r: Request, model_identity: str, vae_tiling: bool, content_hash: str | None = None) -> str:
    """What besides the request decides the output bytes: the model and how we decode. (`content_hash`:
    the request's, when the caller has it.)"""
    text = json.dumps([content_hash or r.content_hash(), model_identity, vae_tiling])
    return hashlib.sha256(text.encode()).hexdigest()


def shard_writer(cfg: RunConfig, held, rank: int) -> ShardWriter | None:
    """This rank's shard writer under --format webdataset (it opens nothing until a sample comes)."""
    if held.format != "webdataset":
        return None
    return ShardWriter(cfg.out, rank, cfg.tag, cfg.shard_bytes, cfg.shard_samples)


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
    stop: StopRequest = field(default_factory=StopRequest)  # a full disk stops the job through it
    layout: str = "flat"  # --format files: flat, or nested (io/outputs.request_dir)
    shards: ShardWriter | None = None  # --format webdataset: samples go to tar shards instead
    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unwritten: list[str] = field(default_factory=list)  # decoded, not written: the job was stopping
    guard: Guardrails | None = None  # the video guardrail, run on the frames before encoding (guardrail.py)
    guardrails: bool = False  # whether this job runs them: in every sidecar (--no-guardrails on record)
    blocked: dict[str, str] = field(default_factory=dict)  # id -> the guardrail's reason (blocked.py)

    def __call__(self, job: RequestJob, result: Result | None, error: str | None) -> None:
        r = job.request
        output = ""
        if isinstance(result, Blocked):  # found by the loop: nothing was generated
            return self.block(r, result.reason, result.stage, job)
        if result is not None and self.stop.fault is not None and self.stop.fault.kind == "disk":
            # The job is stopping for a full disk: this decoded request is not written (a rerun generates
            # it), and does not add one more failed write to the log. (After a changed checkpoint, what is
            # decoded still is: the runner submits nothing computed from the changed files.)
            self.unwritten.append(r.id)
            self.row(job, "interrupted", error=f"not written: {self.stop.fault.message}")
            return
        if result is not None and self.guard is not None and not self._guarded(job, result):
            return
        if result is not None:
            try:
                if self.shards is not None:  # its row and its count come when its shard is final
                    return self._shard_done(self._append(job, result))
                output = self._write(job, result)
            except Exception as exc:  # an encoder error on its frames: this request fails, the job goes on
                lost = exc.pending if isinstance(exc, ShardLost) else []
                if (code := disk_errno(exc)) is not None:  # ... but nothing after a full disk can succeed
                    self._disk_full(code, exc)
                    self._shard_lost(lost, f"not written: {self.stop.fault.message}")
                    if r.id not in {p.sample["id"] for p in lost}:
                        self.unwritten.append(r.id)
                        self.row(job, "interrupted", error=f"not written: {self.stop.fault.message}")
                    return
                if isinstance(exc, EncoderInterrupted) and self._stopping():
                    self.unwritten.append(r.id)  # the signal that stops the job reached its encoder
                    self.row(job, "interrupted", error=f"not written: {exc}")
                    return
                error = f"{type(exc).__name__}: {exc}"
                self._shard_lost([p for p in lost if p.sample["id"] != r.id], error, failed=True)
        if error is None:
            self.ok.append(r.id)
        else:
            self.failed[r.id] = error
            log.warning("request %s failed: %s", r.id, error)
        self.row(job, "ok" if error is None else "failed", output, error)

    def _guarded(self, job: RequestJob, result: Result | TextResult) -> bool:
        """The guardrails at the finish (guardrail.py): a reasoner's reply through the text check, decoded
        frames through the video check, their captions' texts through the text check; False: blocked (and
        recorded)."""
        if isinstance(result, TextResult):
            if (why := self.guard.text(result.text)) is not None:
                self.block(job.request, why, "reply", job)
                return False
            return True
        if result.texts:
            withhold_unsafe_answers(self.guard, result.texts)
        if (checked := check_result(self.guard, job.request.id, result, job.timings)) is None:
            self.block(job.request, VIDEO_BLOCKED, "video", job)
            return False
        result.frames = checked.frames  # what the reference encodes: the guardrail's uint8 frames
        return True

    def block(self, r: Request, reason: str, stage: str, job: RequestJob | None = None) -> None:
        """A request the guardrails blocked: its record (blocked.py), nothing under its media's name."""
        key = output_key(r, self.model_identity, self.cfg.vae_tiling)
        try:
            record_blocked(self, r, reason, stage, key, versions(), job)
        except OSError as exc:  # its sidecar: a full disk stops the job (a rerun checks the prompt again)
            if (code := disk_errno(exc)) is None:
                raise
            self._disk_full(code, exc)

    def _stopping(self) -> bool:
        """Whether the job is stopping. A signal to the process group reaches the encoder and us at once, but
        our handler runs on the main thread between two bytecodes, possibly after a long kernel: wait a
        little for it."""
        deadline = time.monotonic() + STOP_NOTICE_S
        while not self.stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.stop.requested

    def finish(self) -> None:
        """The end of the run: finalize the open shards (their samples' rows follow); a full disk now still
        stops the job (exit 75), the shard's samples counted as not written."""
        if self.shards is None:
            return
        done, lost = self.shards.close()
        self._shard_done(done)
        for exc in lost:
            if (code := disk_errno(exc)) is not None:
                self._disk_full(code, exc)
                self._shard_lost(exc.pending, f"not written: {self.stop.fault.message}")
            else:
                self._shard_lost(exc.pending, f"{type(exc).__name__}: {exc}", failed=True)

    def _shard_done(self, done: list[Pending]) -> None:
        for pending in done:
            self.ok.append(pending.sample["id"])
            self._append_row(pending.row)

    def _shard_lost(self, lost: list[Pending], error: str, failed: bool = False) -> None:
        """Samples of a shard that could not be finalized: generated again by the next run."""
        for pending in lost:
            rid = pending.sample["id"]
            if failed:
                self.failed[rid] = error
            else:
                self.unwritten.append(rid)
            self._append_row({**pending.row, "status": "failed" if failed else "interrupted", "error": error})

    def recover_rows(self, complete: list[Request]) -> int:
        """A metrics row for each complete output that has none: a crash (or a full disk) between its sidecar
        (or its shard) and its row. Taken from the sidecar or the shard index, so metrics.csv still holds one
        ok row per output."""
        have = ids_with_ok_rows(self.cfg.out)
        missing = {r.id: r for r in complete if r.id not in have}
        if not missing:
            return 0
        found = complete_outputs(self.cfg.out, lambda rid, _: rid not in missing)  # reads only those
        recovered = 0
        for rid, r in missing.items():
            if (output := found.get(rid)) is None:
                continue
            timings = output.record.get("timings") or {}
            fields = {k: timings.get(k) for k in ("prepare_s", "denoise_s", "decode_s", "write_s")}
            fields.update(kind=r.kind, width=r.width, height=r.height, num_frames=r.num_frames, seed=r.seed)
            fields.update(steps=r.num_inference_steps, guidance=r.guidance_scale)
            fields.update(tokens=output.record.get("tokens"), rank=self.rank)
            fields.update(finished_at=iso_time(output.finished))
            fields.update(output=f"{output.path}/{output.member}" if output.member else output.path)
            try:
                self.metrics.row(id=rid, status="ok", **fields)
            except OSError as exc:  # still no room: the next run tries again
                log.warning("cannot recover metrics rows: %s", exc)
                break
            recovered += 1
        return recovered

    def _disk_full(self, code: int, exc: BaseException) -> None:
        where = getattr(exc, "filename", None) or self.cfg.out
        self.stop.fail(JobFault(ExitCode.DISK, "disk", describe_refusal(code, where, self.cfg.out)))

    def row(self, job: RequestJob, status: str, output: str = "", error: str | None = None) -> None:
        self._append_row(self._row_fields(job, status, output, error))

    def _row_fields(self, job: RequestJob, status: str, output: str = "", error: str | None = None) -> dict:
        r = job.request
        timings = job.timings
        return dict(
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
            **forward_counts(job.cache),
        )

    def _append_row(self, fields: dict) -> None:
        try:
            self.metrics.row(**fields)
        except OSError as exc:  # a full disk must not fail the rank (its peers would hang): it stops the job
            if (code := disk_errno(exc)) is not None:
                self._disk_full(code, exc)
            log.error("request %s: cannot append its metrics row: %s", fields["id"], exc)

    def _write(self, job: RequestJob, result: Result) -> str:
        """Every file of the request, the sidecar last; on any failure none of this attempt's files is left
        under a final name (a rerun generates the request from scratch)."""
        paths = outputs.paths_for(self.cfg.out, job.request.id, job.request.num_frames, self.layout)
        paths.sidecar.parent.mkdir(exist_ok=True)  # --layout nested: its folder, made on first use
        written: list[Path] = []
        try:
            return self._write_files(job, result, paths, written)
        except BaseException:
            for path in written:
                if not path.is_dir():  # what was in the way of a write is not ours to remove
                    with contextlib.suppress(OSError):
                        path.unlink(missing_ok=True)
            raise

    def _write_files(self, job: RequestJob, result: Result, paths: outputs.OutputPaths, written: list) -> str:
        r = job.request
        start = time.perf_counter()
        if r.reason is not None:  # a reasoner's text (kinds/reason.py TextResult): <id>.txt, then the sidecar
            written.append(paths.media)
            files = {"media": {"name": paths.media.name, "bytes": write_text(paths.media, result.text)}}
            job.timings["write_s"] = time.perf_counter() - start
            outputs.write_json(paths.sidecar, self._sidecar(job, result, files) | reason_facts(result))
            return str(paths.media.relative_to(self.cfg.out.resolve()))
        frames = outputs.to_uint8(result.frames)
        audio = (result.sound, result.sample_rate) if result.sound is not None else None
        written.append(paths.media)
        if r.num_frames == 1:
            size = outputs.write_png(paths.media, frames[0])
        else:
            size = outputs.write_mp4(paths.media, frames, r.fps, audio=audio)
        files = {"media": {"name": paths.media.name, "bytes": size}}
        if audio is not None:
            written.append(paths.wav)
            size = outputs.write_wav(paths.wav, *audio)
            files["wav"] = {"name": paths.wav.name, "bytes": size}
        if result.actions is not None:
            written += [paths.actions, paths.actions_json]
            files.update(outputs.write_actions(paths, result.actions, r))
        if self.cfg.save_latents:
            written.append(paths.latents)
            size = outputs.write_latents(paths.latents, result.latents, sound=result.sound)
            files["latents"] = {"name": paths.latents.name, "bytes": size}
        job.timings["write_s"] = time.perf_counter() - start  # the media and latents; the sidecar is tiny
        outputs.write_json(paths.sidecar, self._sidecar(job, result, files))
        return str(paths.media.relative_to(self.cfg.out.resolve()))

    def _sidecar(self, job: RequestJob, result: Result, files: dict) -> dict:
        r = job.request
        return {
            "id": r.id,
            "status": "complete",
            "kind": r.kind,
            "request": r.resolved(),
            **({} if r.sample is None else {"sample": {"name": r.sample, "file": r.source}}),  # NVIDIA's
            "request_hash": r.content_hash(),
            "output_key": output_key(r, self.model_identity, self.cfg.vae_tiling),
            "inputs": input_record(r, getattr(job, "input_stats", None)),  # as read: resume compares them
            "seed": r.seed,
            "tokens": job.tokens,
            "files": files,
            **outputs.media_facts(result),
            **chain_facts(r, result.texts if isinstance(result, Result) else None),
            "timings": {k: round(v, 6) for k, v in job.timings.items()},
            **(self.cfg.model_source.record() if self.cfg.model_source else {"model": str(self.model_dir)}),
            "model_digest": self.model_identity,
            "rank": self.rank,
            "weights": self.weights,
            "guardrails": self.guardrails,
            **({} if job.cache is None else {"cache": cache_report(self.cfg.cache, job.cache)}),
            **(
                {}
                if r.transfer is None
                else {"controls": controls_record(r.transfer), "chunks": job.vae_calls}
            ),
            "versions": versions(),
        }

    def _append(self, job: RequestJob, result: Result) -> list[Pending]:
        """--format webdataset: encode the members into this writer's staging folder (finish/samples.py), then
        append them to the open shard of the request's kind; returns the samples of a shard this closed."""
        r, shards = job.request, self.shards
        key, kind = sample_key(r.id), shard_kind(r, self.cfg.save_latents)
        start = time.perf_counter()
        staged: list[tuple[str, Path]] = []
        try:
            media = stage_media(shards, key, r, result, self.cfg.save_latents, staged)
            job.timings["write_s"] = time.perf_counter() - start
            shard = shards.shard_of(kind)
            sidecar = self._sidecar(job, result, files_record(key, staged))
            sidecar |= (reason_facts(result) if r.reason is not None else {}) | {"shard": shard}
            stage_texts(shards, key, r, sidecar, staged)
        except BaseException:
            for _, path in staged:
                path.unlink(missing_ok=True)
            raise
        sample = {k: sidecar[k] for k in INDEXED if k in sidecar}
        row = self._row_fields(job, "ok", f"{shard}/{key}.{media}")
        return shards.add(kind, key, staged, sample, row)
