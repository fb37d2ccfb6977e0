"""Joint audio through the real `run`: `<id>.wav`, an AAC track in `<id>.mp4` as long as the video, the
waveform in the latents file, the sidecar and resume covering the new file."""

from __future__ import annotations

import csv
import json
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.io.audio import PCM_SCALE, decode_audio_track, ffmpeg, read_wav
from tests.conftest import write_jsonl

ROW = {"id": "rain", "prompt": "rain on a tin roof", "size": "32x32", "num_frames": 9, "fps": 12}
ROW |= {"num_inference_steps": 2, "sound": True, "seed": 5}


def run(ckpt, prompts, out, *extra):
    args = ["run", str(prompts), "--model", str(ckpt), "--out", str(out), "--no-progress", *extra]
    return CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_av_ckpt):
    folder = tmp_path_factory.mktemp("sound")
    prompts = write_jsonl(folder / "p.jsonl", [ROW])
    out = folder / "out"
    result = run(tiny_av_ckpt, prompts, out, "--save-latents")
    assert result.exit_code == 0, result.output
    return prompts, out


def test_wav_decodes_back_to_the_saved_waveform(job):
    _, out = job
    waveform = load_file(out / "rain.latents.safetensors")["sound"]
    assert waveform.dtype == torch.float32 and waveform.shape[0] == 2
    decoded, rate = read_wav(out / "rain.wav")
    assert rate == 48000 and decoded.shape == tuple(waveform.shape)
    # 16-bit PCM: each sample within half a quantisation step of the float waveform.
    assert np.abs(decoded - waveform.numpy()).max() <= 0.5 / PCM_SCALE + 1e-7
    assert np.abs(waveform.numpy()).max() > 0.01  # not silence, or the comparison above proves little


def test_mp4_has_an_aac_track_as_long_as_the_video(job):
    _, out = job
    probe = subprocess.run([ffmpeg(), "-i", str(out / "rain.mp4")], capture_output=True, text=True).stderr
    streams = [line for line in probe.splitlines() if "Stream #" in line]
    assert any("Video: h264" in s for s in streams) and any("Audio: aac" in s for s in streams), probe
    samples = decode_audio_track(out / "rain.mp4", 48000, 2).shape[0]
    video_s = ROW["num_frames"] / ROW["fps"]
    assert abs(samples / 48000 - video_s) <= 1024 / 48000  # within one AAC frame of the video's length


def test_sidecar_metrics_and_resume_cover_the_wav(job, tiny_av_ckpt):
    prompts, out = job
    sidecar = json.loads((out / "rain.json").read_text())
    assert sidecar["kind"] == "t2v+sound"
    assert sidecar["files"]["wav"] == {"name": "rain.wav", "bytes": (out / "rain.wav").stat().st_size}
    assert sidecar["sound"]["sample_rate"] == 48000 and sidecar["sound"]["wav_format"] == "pcm_s16le"
    with open(out / "metrics.csv") as f:
        assert [row["kind"] for row in csv.DictReader(f)] == ["t2v+sound"]
    assert "1 already complete" in run(tiny_av_ckpt, prompts, out, "--save-latents").output
    (out / "rain.wav").unlink()  # a missing file listed by the sidecar: generated again
    result = run(tiny_av_ckpt, prompts, out, "--save-latents")
    assert "1 generated" in result.output, result.output
    assert (out / "rain.wav").is_file()
