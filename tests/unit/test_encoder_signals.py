"""A Ctrl-C in the terminal (SIGINT to the whole foreground process group) must not kill the encoder of the
output the job is finishing as it stops: ffmpeg runs in a session of its own (io/ffmpeg.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, threading, time
    from pathlib import Path
    from cosmos3_batch.io.ffmpeg import run_ffmpeg

    signal.signal(signal.SIGINT, lambda *a: None)  # the job's own handler: it stops at a pass boundary

    def ctrl_c():  # as a terminal does, once the encoder runs: the whole foreground group
        me = os.getpid()
        while True:
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    fields = stat.read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == me:
                    time.sleep(0.2)
                    os.killpg(0, signal.SIGINT)
                    return
            time.sleep(0.01)

    import imageio_ffmpeg
    imageio_ffmpeg.get_ffmpeg_exe()  # its first call may run a child of its own: not the one under test
    threading.Thread(target=ctrl_c, daemon=True).start()
    frames = bytes(320 * 240 * 3) * 400
    args = ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "320x240", "-r", "24", "-i", "pipe:0"]
    args += ["-c:v", "libx264", "-preset", "veryslow", "-f", "mp4", os.environ["OUT"]]
    run_ffmpeg(args, "encode", stdin=frames)
    print("encoded", os.path.getsize(os.environ["OUT"]))
    """
)


def test_ctrl_c_to_the_process_group_does_not_kill_the_encoder(tmp_path):
    out = tmp_path / "v.mp4"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**__import__("os").environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own group, so the SIGINT reaches only it and what it starts there
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("encoded") and out.stat().st_size > 0
