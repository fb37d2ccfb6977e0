"""scripts/gpu/fetch_wheels.py without the network: the dry run lists what it would fetch, changes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "fetch_wheels.py"
sys.path.insert(0, str(SCRIPT.parent))
import fetch_wheels  # noqa: E402


def test_dry_run_lists_every_wheel_and_fetches_nothing(tmp_path):
    dest = tmp_path / "whl"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for name, version in fetch_wheels.WHEELS:
        assert f"  {name}=={version}  (cp312" in proc.stdout
    assert proc.stdout.count("$ ") == len(fetch_wheels.WHEELS) + 1  # one download each + the project
    assert "pip wheel --no-deps --no-build-isolation" in proc.stdout
    assert not dest.exists()


def test_download_targets_the_gpu_image():
    command = fetch_wheels.download_command("diffusers", "0.42.1", Path("/x"))
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--implementation") + 1] == "cp"
    assert "--no-deps" in command and "--only-binary=:all:" in command
    platforms = [command[i + 1] for i, arg in enumerate(command) if arg == "--platform"]
    assert {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(platforms)
    install = fetch_wheels.install_command([Path("/x/a.whl")], Path("/tmp/site"))
    assert {"--no-index", "--no-deps", "--target"} <= set(install)


def test_only_other_versions_of_a_wanted_wheel_are_stale(tmp_path):
    for name in (
        "diffusers-0.42.1-py3-none-any.whl",
        "diffusers-0.41.0-py3-none-any.whl",
        "imageio_ffmpeg-0.8.1-py3-none-manylinux_2_28_x86_64.whl",
        "imageio_ffmpeg-0.6.0-py3-none-manylinux2014_x86_64.whl",
    ):
        (tmp_path / name).touch()
    assert [p.name for p in fetch_wheels.stale(tmp_path, "diffusers", "0.42.1")] == [
        "diffusers-0.41.0-py3-none-any.whl"
    ]
    assert [p.name for p in fetch_wheels.stale(tmp_path, "imageio-ffmpeg", "0.6.0")] == [
        "imageio_ffmpeg-0.8.1-py3-none-manylinux_2_28_x86_64.whl"
    ]
