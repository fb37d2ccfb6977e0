"""`convert --fp8` streams: its private memory peaks at a few copies of one tensor, not at the model."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cosmos3_batch.model.tiny import TinySpec, write_tiny
from tests.dist.jobs import JOB_PYTHON

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
from scripts.tools.mem_probe import PeakSampler, snapshot
from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.model.loading import build_transformer_on_meta, decoder_linear_weights
# Lazy imports (diffusers' transformer module, ~75 MB) are not part of the figure: load them first.
build_transformer_on_meta(Checkpoint.open(sys.argv[1]).config("transformer"))
before = snapshot()["rss_anon"]
sampler = PeakSampler()
convert_fp8(sys.argv[1], sys.argv[2], decoder_linear_weights)
print(json.dumps({"peak_delta": sampler.stop() - before}))
"""


def test_convert_peak_memory_is_one_tensor_not_the_model(tmp_path: Path) -> None:
    # ~200 MB of float32 layer weights; the largest tensor is one 1024 x 256 MLP matrix (1 MiB).
    spec = TinySpec(layers=24, hidden=256, heads=4, kv_heads=2, intermediate=1024)
    src = write_tiny(tmp_path / "src", spec)
    model_bytes = (src / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [JOB_PYTHON, "-c", PROBE, str(src), str(tmp_path / "dst")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_delta"]
    print(f"convert: model {model_bytes / 2**20:.0f} MiB, peak private memory +{peak / 2**20:.1f} MiB")
    assert peak <= 0.1 * model_bytes, (peak, model_bytes)
