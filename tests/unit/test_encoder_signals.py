"""A Ctrl-C in the terminal (SIGINT to the whole foreground process group) must not kill the encoder of the
output the job is finishing as it stops: ffmpeg runs in a session of its own (io/ffmpeg.py). Where a signal
reaches the encoder all the same (before its session exists, or sent to it), the request is interrupted when
the job is stopping and failed otherwise (pipeline/finish/results.py)."""

from __future__ import annotations

import subprocess
import textwrap

from tests.dist.jobs import JOB_PYTHON

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
        [JOB_PYTHON, "-c", CHILD],
        env={**__import__("os").environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own group, so the SIGINT reaches only it and what it starts there
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("encoded") and out.stat().st_size > 0


VIDEOS = [
    {"id": f"v{i}", "prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
    for i in range(3)
]


def killed_encoder(signal_us: bool):
    """An encoder stand-in for the first video: ended by SIGINT (and, as a terminal's Ctrl-C does, the
    SIGINT reaches this process too when `signal_us`); the others encode for real."""
    import os
    import signal

    from cosmos3_batch.io import outputs
    from cosmos3_batch.io.ffmpeg import EncoderInterrupted

    real, calls = outputs.run_ffmpeg, []

    def encode(args, what, stdin=None):
        calls.append(what)
        if len(calls) > 1:
            return real(args, what, stdin=stdin)
        if signal_us:
            os.kill(os.getpid(), signal.SIGINT)
        raise EncoderInterrupted(f"ffmpeg ({what}) was ended by SIGINT")

    return encode


def test_an_encoder_killed_by_the_stopping_signal_interrupts_its_request_and_otherwise_fails_it(
    tmp_path, tiny_ckpt, monkeypatch
):
    import json

    from typer.testing import CliRunner

    from cosmos3_batch.cli import app
    from cosmos3_batch.io import outputs
    from cosmos3_batch.pipeline.finish import results
    from tests.conftest import write_jsonl

    prompts = write_jsonl(tmp_path / "v.jsonl", VIDEOS)
    args = ["run", str(prompts), "--model", str(tiny_ckpt), "--no-progress", "--max-active", "1"]
    monkeypatch.setattr(outputs, "run_ffmpeg", killed_encoder(signal_us=True))
    stopped = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a")], catch_exceptions=False)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert stopped.exit_code == 130, stopped.output
    assert summary["failed"] == [] and "v0" in summary["ranks"][0]["unwritten"]
    assert not (tmp_path / "a" / "v0.json").exists()
    # No stop under way: an encoder that was ended by a signal fails its request, as any encoder error does.
    monkeypatch.setattr(results, "STOP_NOTICE_S", 0.05)
    monkeypatch.setattr(outputs, "run_ffmpeg", killed_encoder(signal_us=False))
    failed = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b")], catch_exceptions=False)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert failed.exit_code == 1, failed.output
    assert [f["id"] for f in summary["failed"]] == ["v0"] and "ended by SIGINT" in summary["failed"][0][
        "error"
    ]
