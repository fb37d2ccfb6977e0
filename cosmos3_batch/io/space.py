"""Room on the output filesystem: which errors mean it is full or read-only, how much is free, and about how
many bytes one request's outputs take (checked before any weight is loaded).

A full disk is not one request's fault: every request after it would fail the same way, after its whole
denoise. So these errors stop the job (exit 75, EX_TEMPFAIL: free space and rerun) instead of failing
requests one by one. Libraries report them in different clothes: an OSError with its errno (Python), the
Rust io error text "(os error 28)" (safetensors), the C library's message (ffmpeg's stderr).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

DISK_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT", errno.EROFS: "EROFS"}


def disk_errno(exc: BaseException | None) -> int | None:
    """The errno of a full or read-only filesystem behind `exc` (or its causes), else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return exc.errno
        text = str(exc)
        for code in DISK_ERRNOS:
            if f"(os error {code})" in text or os.strerror(code) in text:
                return code
        exc = exc.__cause__ or exc.__context__
    return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_space(path: Path) -> tuple[int, int] | None:
    """(bytes free to an unprivileged writer, filesystem size) of the filesystem holding `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def describe_free(path: Path) -> str:
    room = free_space(path)
    if room is None:
        return "free space unknown"
    return f"{human_bytes(room[0])} free of {human_bytes(room[1])}"


def describe_refusal(code: int, path: Path | str, out: Path) -> str:
    """One line for a write that a full or read-only filesystem refused: the errno, the file, the room."""
    refused = f"{DISK_ERRNOS[code]} ({os.strerror(code)}) writing {path}"
    return f"{refused}: {describe_free(out)} on the filesystem of {out}"


# Upper-end guesses, not promises: H.264 at our quality (crf 10) stays well under a byte per pixel per
# frame for generated video; PNG can reach its raw size on noise. The check only has to catch a job that
# could not write even its largest output, before hours of compute.
MP4_BYTES_PER_PIXEL = 0.5
SIDECAR_BYTES = 16 << 10
AUDIO_RATE, AUDIO_CHANNELS = 48_000, 2


def output_bytes(request, save_latents: bool, latent_channels: int, spatial: int, temporal: int) -> int:
    """About how many bytes `request`'s files take on disk (media, audio, latents, actions, sidecar)."""
    pixels = request.width * request.height
    total = SIDECAR_BYTES
    if request.num_frames == 1:
        total += pixels * 3 + 4096
    else:
        video = int(pixels * request.num_frames * MP4_BYTES_PER_PIXEL)
        total += 2 * video if request.sound else video  # a mux holds the silent video beside the final one
    if request.sound:
        total += int(request.num_frames / request.fps * AUDIO_RATE) * AUDIO_CHANNELS * 2 * 2  # WAV + AAC
    if save_latents:
        latent_frames = (request.num_frames - 1) // temporal + 1
        cells = (request.height // spatial) * (request.width // spatial)
        total += 4 * latent_channels * latent_frames * cells
    return total


def check_room(out: Path, needed: int, what: str) -> None:
    """ValueError naming --out when its filesystem has less than `needed` bytes free."""
    room = free_space(out)
    if room is not None and room[0] < needed:
        raise ValueError(
            f"--out {out}: {describe_free(out)}, but {what} needs about {human_bytes(needed)}: "
            "free space or choose another --out"
        )


def check_folder(out_dir: Path) -> None:
    """ValueError when --out, or the nearest of its parents that exists, is not a folder (mkdir would say
    only "File exists" or "Not a directory")."""
    for path in (out_dir, *out_dir.parents):
        if path.exists() or path.is_symlink():
            if path.is_dir():
                return
            where = "is a file" if path == out_dir else f"cannot be made: {path} is a file"
            raise ValueError(f"--out {out_dir}: {where}, not a folder")
