"""Joint audio on disk: `<id>.wav` (16-bit PCM) and the same audio muxed into `<id>.mp4` as AAC.

The WAV is 16-bit PCM, the format every tool reads: the waveform (the reference's float samples in [-1, 1])
is scaled by 32767 and rounded, so it decodes back within half a step (1/65534). The exact float waveform
is in `<id>.latents.safetensors` (key `sound`) with `--save-latents`. Muxing uses the ffmpeg binary that
imageio-ffmpeg bundles, so nothing outside the venv is needed.
"""

from __future__ import annotations

import subprocess
import wave
from pathlib import Path

import numpy as np

from cosmos3_batch.io.ffmpeg import run_ffmpeg

PCM_SCALE = 32767


def to_pcm16(waveform) -> np.ndarray:
    """[channels, samples] floats in [-1, 1] -> interleaved [samples, channels] int16 (little-endian)."""
    samples = np.asarray(waveform, dtype=np.float32)
    scaled = np.clip(samples, -1.0, 1.0) * PCM_SCALE
    return np.ascontiguousarray(np.round(scaled).astype("<i2").T)


def write_wav_file(path: Path, waveform, sample_rate: int) -> None:
    pcm = to_pcm16(waveform)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(pcm.shape[1])
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """A 16-bit PCM WAV as [channels, samples] float32 in [-1, 1] (inverse of `to_pcm16`), and its rate."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit PCM, got {8 * wav.getsampwidth()}-bit samples")
        channels, rate = wav.getnchannels(), wav.getframerate()
        data = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    return data.reshape(-1, channels).T.astype(np.float32) / PCM_SCALE, rate


def ffmpeg() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def mux_audio(video: Path, out: Path, waveform, sample_rate: int, duration_s: float) -> None:
    """Copy `video`'s H.264 stream into `out` with the waveform as an AAC track, cut to the video's length
    (the tokenizer decodes whole latents, up to one hop longer than the clip)."""
    pcm = to_pcm16(waveform)
    keep = min(pcm.shape[0], int(duration_s * sample_rate))
    args = ["-i", str(video), "-f", "s16le", "-ar", str(sample_rate), "-ac", str(pcm.shape[1])]
    args += ["-i", "pipe:0", "-map", "0:v", "-map", "1:a", "-c:v", "copy", "-c:a", "aac", "-b:a", "192k"]
    args += ["-f", "mp4", str(out)]
    run_ffmpeg(args, "mux the audio", stdin=pcm[:keep].tobytes())


def decode_audio_track(path: Path, sample_rate: int, channels: int) -> np.ndarray:
    """The AAC track of an MP4, decoded to [samples, channels] int16 (for checks and tests)."""
    cmd = [ffmpeg(), "-nostdin", "-loglevel", "error", "-i", str(path), "-map", "0:a"]
    cmd += ["-f", "s16le", "-ar", str(sample_rate), "-ac", str(channels), "pipe:1"]
    proc = subprocess.run(cmd, capture_output=True, check=True, start_new_session=True)  # as io/ffmpeg.py
    return np.frombuffer(proc.stdout, dtype="<i2").reshape(-1, channels)
