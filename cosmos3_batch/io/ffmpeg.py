"""The ffmpeg binary imageio-ffmpeg bundles, run as a subprocess whose own messages go to our log.

A terminal full of ffmpeg's lines for one failed write helps nobody: its stderr is logged at DEBUG and a
failure is one line. A full or read-only disk stays recognisable as one (an OSError with its errno), so
the job stops instead of failing every request that follows (io/space.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

from cosmos3_batch.io.space import DISK_ERRNOS

log = logging.getLogger("cosmos3_batch")


class EncoderError(RuntimeError):
    """ffmpeg refused or failed: its last line of stderr (the whole of it goes to the log at DEBUG)."""


class EncoderInterrupted(EncoderError):
    """ffmpeg was ended by a signal: not its frames' fault. A terminal's Ctrl-C can still reach it in the
    moment between its fork and its own session (and anyone may signal it): during a stop the request is
    interrupted, not failed (pipeline/finish/results.py)."""


def run_ffmpeg(args: list[str], what: str, stdin: bytes | memoryview | None = None) -> None:
    """Run the bundled ffmpeg with `args`; its own messages go to the log at DEBUG, never to the terminal.
    A failure is one EncoderError line; a full or read-only disk keeps its errno (io/space.py reads it)."""
    import imageio_ffmpeg

    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-y", "-loglevel", "error", *args]
    # Its own session: a Ctrl-C in the terminal signals the whole foreground process group, and an encoder
    # killed mid-write would fail the request the job is finishing as it stops (the chaos chain caught
    # it). If we die, it reads EOF on its input and exits; the temporary it wrote is never renamed.
    proc = subprocess.run(cmd, input=stdin, capture_output=True, check=False, start_new_session=True)
    err = proc.stderr.decode(errors="replace").strip()
    if err:
        log.debug("ffmpeg (%s): %s", what, err)
    if proc.returncode < 0:
        raise EncoderInterrupted(f"ffmpeg ({what}) was ended by {signal.Signals(-proc.returncode).name}")
    if proc.returncode != 0:
        last = err.splitlines()[-1] if err else f"exit status {proc.returncode}"
        for code in DISK_ERRNOS:
            if os.strerror(code) in err:
                raise OSError(code, f"{os.strerror(code)} ({what}; ffmpeg: {last})")
        raise EncoderError(f"ffmpeg could not {what}: {last}")


def pin_encoder() -> str:
    """Find ffmpeg once, before any request runs, and pin it for this process (IMAGEIO_FFMPEG_EXE).

    imageio-ffmpeg otherwise validates its binary on first use by running `ffmpeg -version` in our process
    group: a Ctrl-C to the group, or a failed fork on a loaded node, at that moment makes the first MP4 of
    the run fail with "No ffmpeg exe could be found". RuntimeError when there is none at all."""
    import imageio_ffmpeg

    exe = imageio_ffmpeg.get_ffmpeg_exe()
    os.environ.setdefault("IMAGEIO_FFMPEG_EXE", exe)
    return exe
