"""`report OUT` on a finished run with images, videos and a failed request, opened in a real headless
Chromium (Debian's package, installed by the test as the Slurm tier does): every id is in the page,
thumbnails exist, the screenshot is not blank, and nothing outside OUT is referenced."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.pipeline.job.summary import clocks
from tests.conftest import write_jsonl

ROWS = [
    {"id": "pic", "prompt": "a red <b>cube</b> & friends", "num_frames": 1, "size": "32x32"},
    {"id": "clip", "prompt": "waves", "num_frames": 5, "size": "48x32", "fps": 8},
    {"id": "broken", "prompt": "this one fails to write", "num_frames": 1, "size": "32x32"},
    {"id": "pic2", "prompt": "a second image", "num_frames": 1, "size": "32x32", "guidance_scale": 1.0},
]
IDS = [row["id"] for row in ROWS]
BROWSER = "chromium-headless-shell"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def browser() -> str:
    """The headless shell from Debian's packages; installed here when missing (root, as in CI)."""
    path = shutil.which(BROWSER) or "/usr/lib/chromium/chromium-headless-shell"
    if Path(path).exists():
        return path
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]  # the Slurm tier may be installing at the same time
    for cmd in (
        [*apt, "update", "-qq"],
        [*apt, "install", "-y", "-qq", "--no-install-recommends", BROWSER],
    ):
        if subprocess.run(cmd, capture_output=True, env=env, timeout=600).returncode != 0:
            pytest.skip(f"cannot install {BROWSER} with apt here (not root, or no package mirror)")
    return shutil.which(BROWSER) or "/usr/lib/chromium/chromium-headless-shell"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_ckpt) -> Path:
    folder = tmp_path_factory.mktemp("report")
    prompts = write_jsonl(folder / "p.jsonl", [row | {"num_inference_steps": 2} for row in ROWS])
    out = folder / "out"
    (out / "broken.png").mkdir(parents=True)  # the PNG cannot be renamed over a folder: a write error
    result = invoke("run", prompts, "--model", tiny_ckpt, "--out", out, "--no-progress", "--max-active", "2")
    assert result.exit_code == 1, result.output
    return out


def test_report_lists_every_request_with_thumbnails(finished_run):
    out = finished_run
    result = invoke("report", out, "--no-progress", "--page-size", "3")
    assert result.exit_code == 0, result.output
    page1 = (out / "report.html").read_text()
    page2 = (out / "report" / "page-0002.html").read_text()
    both = page1 + page2
    for rid in IDS:
        assert f'id="{rid}"' in both, rid
    assert "a red &lt;b&gt;cube&lt;/b&gt; &amp; friends" in both  # prompts are escaped, never markup
    assert 'class="card failed"' in both and "broken.png" in both  # the failure and its error
    assert "this one fails to write" in both  # a failed request's prompt, read back from the JSONL
    for rid in ("pic", "clip", "pic2"):
        thumb = out / "report" / "thumbs" / f"{rid}.jpg"
        assert max(Image.open(thumb).size) <= 192, rid
    assert page1.count("<svg") == 4  # timeline, occupancy, stall, bytes per output
    assert "<script" not in both
    # Offline: every reference is relative and stays inside OUT.
    for page, base in ((page1, out), (page2, out / "report")):
        for ref in re.findall(r'(?:src|href)="([^"]+)"', page):
            assert "://" not in ref and (base / ref).resolve().is_relative_to(out.resolve()), ref
            assert (base / ref).exists(), ref
    # Thumbnails are made once: a second report keeps them.
    stamp = (out / "report" / "thumbs" / "clip.jpg").stat().st_mtime_ns
    assert invoke("report", out, "--no-progress").exit_code == 0
    assert (out / "report" / "thumbs" / "clip.jpg").stat().st_mtime_ns == stamp


def test_report_renders_in_a_headless_browser(finished_run, tmp_path):
    out = finished_run
    assert invoke("report", out, "--no-progress").exit_code == 0
    chrome = browser()
    page = (out / "report.html").resolve().as_uri()
    flags = ["--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1000"]
    dom = subprocess.run([chrome, *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for rid in IDS:
        assert f'id="{rid}"' in dom.stdout, rid
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [chrome, *flags, f"--screenshot={shot}", page], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert pixels.shape == (1000, 1200)
    assert pixels.std() > 10  # text, figures and thumbnails, not a blank page
    assert (pixels < 128).mean() > 0.01


def test_report_refuses_a_folder_without_a_run(tmp_path):
    result = invoke("report", tmp_path)
    assert result.exit_code == 2 and "no summary.json" in result.output


def test_summary_lists_the_prompts_file(finished_run):
    summary = json.loads((finished_run / "summary.json").read_text())
    assert [Path(p).name for p in summary["config"]["prompts"]] == ["p.jsonl"]


def test_summary_says_which_clock_each_time_comes_from(finished_run):
    summary = json.loads((finished_run / "summary.json").read_text())
    host = "host wall clock"
    assert summary["clocks"] == {
        "stall_s": host, "collective_s": host, "compute_s": host, "h2d_s": host, "pass_s": host,
        "passes_csv": {"duration_s": host, "stall_s": host},
    }  # fmt: skip
    on_gpu = clocks(torch.device("cuda"))
    assert on_gpu["stall_s"] == on_gpu["passes_csv"]["stall_s"] == "cuda events"
    assert (
        on_gpu["pass_s"] == on_gpu["passes_csv"]["duration_s"] == "host enqueue (the device may run behind)"
    )
