"""Output files: PNG / MP4 (+ AAC) / WAV / latents / JSON sidecar, each written to a temporary name, renamed.

A request is complete when its sidecar exists: the sidecar is written last and records the size of
every other file, so a crash between files never leaves something that looks finished.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from cosmos3_batch.io.ffmpeg import EncoderError, run_ffmpeg
from cosmos3_batch.io.inputs import inputs_changed
from cosmos3_batch.io.space import check_folder, disk_errno

# The sidecar's `files` keys besides the media, and the suffix of each one's file.
_SUFFIXES = {"latents": "latents.safetensors", "wav": "wav", "actions": "actions.safetensors",
             "actions_json": "actions.json"}  # fmt: skip


@dataclass(frozen=True)
class OutputPaths:
    """A request's files: `folder` / `<id>.<suffix>`, each path made when asked for (a rerun over 100,000
    complete requests checks their names and sizes, and needs few Path objects)."""

    folder: Path
    request_id: str
    media_suffix: str  # png (1 frame), mp4, or txt (0 frames: a reasoner request's text)

    def names(self) -> dict[str, str]:
        """The sidecar's `files` keys and the one file name each may name."""
        names = {"media": f"{self.request_id}.{self.media_suffix}"}
        return names | {key: f"{self.request_id}.{suffix}" for key, suffix in _SUFFIXES.items()}

    def by_key(self) -> dict[str, Path]:
        return {key: self.folder / name for key, name in self.names().items()}

    @property
    def media(self) -> Path:
        return self.folder / f"{self.request_id}.{self.media_suffix}"

    @property
    def sidecar(self) -> Path:
        return self.folder / f"{self.request_id}.json"

    @property
    def latents(self) -> Path:
        return self.folder / f"{self.request_id}.latents.safetensors"

    @property
    def wav(self) -> Path:  # joint audio (sound requests)
        return self.folder / f"{self.request_id}.wav"

    @property
    def actions(self) -> Path:  # predicted actions (inverse dynamics, policy): safetensors, key `actions`
        return self.folder / f"{self.request_id}.actions.safetensors"

    @property
    def actions_json(self) -> Path:  # the same, readable
        return self.folder / f"{self.request_id}.actions.json"


def bucket(request_id: str) -> str:
    """`--layout nested`: a request's subfolder, 2 hex digits of SHA-256 of its id (256, evenly filled)."""
    return hashlib.sha256(request_id.encode("utf-8")).hexdigest()[:2]


def request_dir(out: Path, request_id: str, layout: str = "flat") -> Path:
    return _bucket_dir(out, bucket(request_id)) if layout == "nested" else out


@functools.lru_cache(maxsize=1024)
def _bucket_dir(out: Path, name: str) -> Path:
    return out / name


def paths_for(out_dir: Path, request_id: str, num_frames: int, layout: str = "flat") -> OutputPaths:
    """File names carry the request id; the id was validated, and we still refuse anything that escapes:
    a name without a separator (or NUL) stays in its folder, whatever dots it holds."""
    if "/" in request_id or os.sep in request_id or "\0" in request_id:
        raise ValueError(f"request id {request_id!r} would write outside {out_dir}")
    suffix = {0: "txt", 1: "png"}.get(num_frames, "mp4")  # 0 frames: a reasoner's text
    return OutputPaths(request_dir(_resolved(out_dir), request_id, layout), request_id, suffix)


def _resolved(out_dir: Path) -> Path:
    """--out as an absolute path without links, once per folder and working directory (a rerun asks for
    every request's paths)."""
    return _resolve(out_dir, os.getcwd())


@functools.lru_cache(maxsize=16)
def _resolve(out_dir: Path, cwd: str) -> Path:
    return out_dir.resolve()


def media_facts(result) -> dict:
    """What the sidecar says about the audio and the predicted actions beyond the file list."""
    facts = {}
    if getattr(result, "sound", None) is not None:
        channels, samples = result.sound.shape
        audio = {"sample_rate": result.sample_rate, "channels": channels, "samples": samples}
        facts["sound"] = {**audio, "wav_format": "pcm_s16le", "mp4_codec": "aac"}
    if getattr(result, "actions", None) is not None:
        facts["actions"] = {"shape": list(result.actions.shape), "dtype": "float32"}
    return facts


def mode_files(request) -> tuple[str, ...]:
    """Sidecar `files` keys a complete output of this request must list besides its media."""
    files = ("wav",) if getattr(request, "sound", False) else ()
    action = getattr(request, "action", None)
    if action is not None and action.mode in PREDICTS_ACTIONS:
        files += ("actions", "actions_json")
    return files


PREDICTS_ACTIONS = ("inverse_dynamics", "policy")  # forward dynamics is given its actions


def write_actions(paths: OutputPaths, actions, request) -> dict[str, dict]:
    """`<id>.actions.safetensors` (the reference's tensor) and `<id>.actions.json`; their `files` entries."""
    size = atomic_write(paths.actions, lambda tmp: render_actions(tmp, actions))
    json_size = write_json(paths.actions_json, readable_actions(actions, request))
    return {
        "actions": {"name": paths.actions.name, "bytes": size},
        "actions_json": {"name": paths.actions_json.name, "bytes": json_size},
    }


def readable_actions(actions, request) -> dict:
    """`<id>.actions.json`: the rows as decimals that read back to the same float32 values."""
    spec = request.action
    return {
        "id": request.id,
        "mode": spec.mode,
        "domain": spec.domain,
        "chunk_size": spec.chunk_size,
        "shape": list(actions.shape),
        # float32 values printed as the shortest decimals that read back to the same float32
        "actions": [[float(str(np.float32(x))) for x in row] for row in actions.tolist()],
    }


def check_writable(out_dir: Path) -> None:
    """Fail before any weight is loaded if --out cannot take files."""
    check_folder(out_dir)  # a file in the way is said so (mkdir says only "File exists")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # mkstemp creates a new file (O_EXCL): a planted symlink is never followed.
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=out_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"--out {out_dir}: cannot write there ({exc.strerror or exc})") from exc


# mkstemp makes 0600 files; finished outputs get the permissions a plain open() would give (others on a
# shared cluster read the dataset). Read once at import, while still single-threaded: umask() sets it too.
_UMASK = os.umask(0o022)
os.umask(_UMASK)

_TEMPORARY = re.compile(r"^\.(?P<stem>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp\.[^.]+$")
# What follows the id in a temporary's stem: `<id>.latents.safetensors`, the silent video a mux starts from.
_STEM_SUFFIXES = (".latents", ".silent", ".actions")


def remove_stale_temporaries(out_dir: Path, ids: set[str], layout: str = "flat") -> int:
    """Delete temporaries that a killed run left for *these* requests. Other jobs (array tasks of other
    shards) may share --out and be writing their own requests' temporaries right now: never touch those."""
    removed = 0
    folders = {out_dir} if layout == "flat" else {request_dir(out_dir, i, layout) for i in ids}
    for path in (p for folder in sorted(folders) for p in folder.glob(".*.tmp.*")):
        match = _TEMPORARY.match(path.name)
        stem = match["stem"] if match else ""
        for suffix in _STEM_SUFFIXES:
            stem = stem.removesuffix(suffix)
        if match and stem in ids:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def atomic_write(path: Path, write: Callable[[Path], None]) -> int:
    """Let `write` fill a temporary sibling, fsync it, rename it over `path`; return the final size.

    The temporary is created fresh and exclusive (mkstemp), so nothing planted at a predictable name,
    a symlink included, is ever written through; the rename replaces `path` itself, never its target.
    """
    fd, name = tempfile.mkstemp(
        prefix=f".{path.stem}.{os.getpid()}.", suffix=f".tmp{path.suffix}", dir=path.parent
    )
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        code = disk_errno(exc)
        if code is not None and not (isinstance(exc, OSError) and exc.filename):
            # A library's own error for it (safetensors, ffmpeg): say which file could not be written.
            raise OSError(code, os.strerror(code), str(path)) from exc
        raise
    _fsync_dir(path.parent)  # the rename itself must survive a power loss, not only the bytes
    return path.stat().st_size


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """[T, H, W, 3] floats in [0, 1] -> uint8, rounded as diffusers' `numpy_to_pil` does (uint8: as it is)."""
    return frames if frames.dtype == np.uint8 else (frames * 255).round().astype(np.uint8)


def render_png(path: Path, frame: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(frame).save(path, format="PNG")


def write_png(path: Path, frame: np.ndarray) -> int:
    return atomic_write(path, lambda tmp: render_png(tmp, frame))


def write_mp4(path: Path, frames: np.ndarray, fps: float, audio: tuple | None = None) -> int:
    """H.264 MP4; with `audio` = (waveform [channels, samples], sample rate), also an AAC track as long as
    the video."""
    return atomic_write(path, lambda tmp: render_mp4(tmp, frames, fps, audio, final=path))


def render_mp4(tmp: Path, frames: np.ndarray, fps: float, audio: tuple | None, final: Path) -> None:
    """The MP4 into `tmp` (`final`: the name its silent intermediate is named after)."""
    if audio is None:
        _write_h264(tmp, frames, fps)
        return
    from cosmos3_batch.io.audio import mux_audio

    # The mux starts from a silent video beside the final file.
    fd, name = tempfile.mkstemp(
        prefix=f".{final.stem}.silent.{os.getpid()}.", suffix=".tmp.mp4", dir=final.parent
    )
    os.close(fd)
    silent = Path(name)
    try:
        _write_h264(silent, frames, fps)
        mux_audio(silent, tmp, audio[0], audio[1], duration_s=len(frames) / fps)
    finally:
        silent.unlink(missing_ok=True)


def _write_h264(tmp: Path, frames: np.ndarray, fps: float) -> None:
    """H.264 in yuv420p at crf 10 (the flags imageio's writer passes for quality 8), from raw RGB frames on
    ffmpeg's stdin, with ffmpeg's exit status checked.

    On one thread, x264 and the RGB -> YUV conversion both: the same frames give the same bytes on every run,
    whatever the load and the node's CPU count. By default x264 takes 1.5 threads per CPU, and its output
    depends on that count (a 5-frame clip gave five different files at 1, 2, 3, 4 and 6 threads) and, rarely,
    on the threads' timing under load (5 encodes in 3,800 here: docs/outputs.md "MP4 bytes")."""
    from fractions import Fraction

    count, height, width, _ = frames.shape
    if width % 16 or height % 16:  # sizes are multiples of the latent cell (requests/fields.py)
        raise EncoderError(f"cannot encode {width}x{height}: not a multiple of 16")
    rate = str(Fraction(fps).limit_denominator())
    source = ["-filter_threads", "1", "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}"]
    source += ["-pix_fmt", "rgb24"]
    encode = ["-an", "-vcodec", "libx264", "-threads", "1", "-pix_fmt", "yuv420p", "-crf", "10"]
    encode += ["-f", "mp4", str(tmp)]
    data = memoryview(np.ascontiguousarray(frames, dtype=np.uint8)).cast("B")  # no copy of the whole clip
    run_ffmpeg([*source, "-r", rate, "-i", "-", *encode], f"encode {count} frames", stdin=data)


def write_wav(path: Path, waveform, sample_rate: int) -> int:
    from cosmos3_batch.io.audio import write_wav_file

    return atomic_write(path, lambda tmp: write_wav_file(tmp, waveform, sample_rate))


def render_latents(path: Path, latents, sound=None) -> None:
    """`latents` [1, C, T, H, W]; with joint audio also `sound`: the waveform as the reference returns it."""
    from safetensors.torch import save_file

    tensors = {"latents": latents.contiguous()}
    if sound is not None:
        tensors["sound"] = sound.contiguous()
    save_file(tensors, str(path))


def write_latents(path: Path, latents, sound=None) -> int:
    return atomic_write(path, lambda tmp: render_latents(tmp, latents, sound))


def render_actions(path: Path, actions) -> None:
    """`<id>.actions.safetensors`: key `actions`, float32 [T, D], the reference's tensor."""
    from safetensors.torch import save_file

    save_file({"actions": actions.contiguous()}, str(path))


def write_json(path: Path, data: dict) -> int:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def is_complete(
    paths: OutputPaths,
    content_hash: str,
    output_key: str,
    need_latents: bool,
    required: tuple[str, ...] = (),
    recorded: tuple[tuple, dict] | None = None,
) -> tuple[bool, str]:
    """(complete, why not). Complete = the sidecar says so, for this request, model and decode settings,
    with every file it lists present at its recorded size (and latents when they are asked for).
    `recorded`: (the sidecar's `sidecar_stamp`, its content) as the last manifest.parquet has them: used
    instead of reading the sidecar while its stamp is still that one (a rerun over 100,000 outputs stats
    them)."""
    sidecar = _sidecar_now(paths.sidecar, recorded)
    if sidecar is None:
        return False, "no readable sidecar"
    if sidecar.get("status") != "complete":
        return False, "sidecar not complete"
    if sidecar.get("request_hash") != content_hash:
        return False, "request changed since it was generated"
    if sidecar.get("output_key") != output_key:
        return False, "model or decode settings changed since it was generated"
    if (changed := inputs_changed(sidecar.get("inputs"))) is not None:
        return False, changed
    files = sidecar.get("files")
    # Only our own file names count, each inside --out with the size the sidecar recorded; anything
    # else (no media entry, a path, a malformed entry) means "not complete", never a crash.
    expected = paths.names()
    if not isinstance(files, dict) or "media" not in files:
        return False, "sidecar lists no media file"
    if need_latents and "latents" not in files:
        return False, "latents were not saved"
    for key in required:
        if key not in files:
            return False, f"sidecar lists no {key} file"
    folder = str(paths.folder)
    for key, entry in files.items():
        if not isinstance(entry, dict) or entry.get("name") != expected.get(key):
            return False, f"sidecar entry {key!r} is not one of this request's files"
        try:
            st = os.stat(os.path.join(folder, entry["name"]))
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry.get("bytes"):
            return False, f"{entry['name']} missing or of the wrong size"
    return True, ""


def sidecar_stamp(st: os.stat_result) -> tuple[str, int, int]:
    """What says a sidecar is the one the manifest recorded: its mtime, inode and size (every write of a
    sidecar is a rename, so a new one has a new inode even when the mtime is set back)."""
    return iso_time(st.st_mtime), st.st_ino, st.st_size


def iso_time(seconds: float) -> str:
    """A Unix time as ISO-8601 UTC with microseconds: readable, and sorts as text in time order."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds")


def _sidecar_now(path: Path, recorded: tuple[tuple, dict] | None) -> dict | None:
    if recorded is not None:
        try:
            stamp = sidecar_stamp(os.stat(path))
        except OSError:
            return None
        if stamp == recorded[0]:
            return recorded[1]
    try:
        sidecar = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return sidecar if isinstance(sidecar, dict) else None
