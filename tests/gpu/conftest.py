"""GPU tests on an image that lacks some packages (diffusers, imageio-ffmpeg): when `.whl/` holds wheels
(made elsewhere by scripts/gpu/fetch_wheels.py), install them into a scratch folder before any test needs
them. No network: pip installs from those files only. Nothing happens where diffusers is importable."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bring_wheels() -> None:
    if importlib.util.find_spec("diffusers") is not None or not list((ROOT / ".whl").glob("*.whl")):
        return
    site = Path(os.environ.get("COSMOS3_GPU_SITE", "/tmp/cosmos3-site"))
    script = ROOT / "scripts" / "gpu" / "fetch_wheels.py"
    subprocess.run(
        [sys.executable, str(script), "--dest", str(ROOT / ".whl"), "--install", str(site)], check=True
    )
    # After the working tree (what is tested) and before nothing else: only fills in what the image lacks.
    sys.path.append(str(site))
    importlib.invalidate_caches()
    parts = [str(ROOT), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)  # the CLI subprocesses the tests start


_bring_wheels()
