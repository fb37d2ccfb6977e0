"""Wheels the GPU test image lacks, fetched here into `.whl/`, installed there from it (no network there).

The image (nvidia-h200) has Python 3.12, torch 2.11 (a CUDA build, which cannot travel), transformers
5.17, tokenizers, safetensors, typer, imageio, pillow, numpy, pytest; it lacks diffusers, its
importlib-metadata, and imageio-ffmpeg. This project travels as a wheel built from the working tree.

    python scripts/gpu/fetch_wheels.py [--dry-run] [--dest .whl]     # here: download + build
    python3 scripts/gpu/fetch_wheels.py --install /tmp/cosmos3-site  # there: install what .whl holds

Installs use --no-deps: every wheel the image lacks is named below (one version each), nothing else is
resolved, so the image's torch is never replaced.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (distribution, version): the bit-exactness tests are written against diffusers 0.42.1. imageio-ffmpeg
# 0.8.1 exists only as a 68 MB manylinux_2_28 wheel, over what a device call can carry (64 MiB in all);
# 0.6.0 (29 MB, manylinux2014) writes and reads our MP4s the same way (checked with io/outputs.write_mp4).
WHEELS = [("diffusers", "0.42.1"), ("importlib-metadata", "10.2.0"), ("imageio-ffmpeg", "0.6.0")]
CARRY_LIMIT = 64 * 2**20  # bytes a device call carries with the working tree
PYTHON = "3.12"
# pip matches manylinux tags exactly: name each one the image's glibc accepts.
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def normalized(name: str) -> str:
    """A distribution's name as wheel files spell it (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def download_command(name: str, version: str, dest: Path) -> list[str]:
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", PYTHON, "--implementation", "cp", *platforms,
        "-d", str(dest), f"{name}=={version}",
    ]  # fmt: skip


def project_command(dest: Path) -> list[str]:
    # A pure-Python wheel (py3-none-any): fine for cp312. No build isolation: setuptools from this venv.
    return [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(dest),
        str(ROOT),
    ]


def install_command(wheels: list[Path], target: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels),
    ]  # fmt: skip


def stale(dest: Path, name: str, version: str) -> list[Path]:
    """Wheels of `name` in `dest` at another version: two versions of one package stop the install."""
    wheels = [(path, path.name.split("-")) for path in sorted(dest.glob("*.whl"))]
    return [
        path for path, (dist, have, *_) in wheels if normalized(dist) == normalized(name) and have != version
    ]


def fetch(dest: Path, dry_run: bool) -> int:
    commands = [download_command(name, version, dest) for name, version in WHEELS]
    commands.append(project_command(dest))
    print(f"would fetch into {dest}:" if dry_run else f"fetching into {dest}:")
    for name, version in WHEELS:
        print(f"  {name}=={version}  (cp{PYTHON.replace('.', '')}, {' / '.join(PLATFORMS[:3])}, ...)")
    print(f"  cosmos3_batch (this working tree, {ROOT})")
    for command in commands:
        print("$ " + shlex.join(command))
    if dry_run:
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    for path in [p for name, version in WHEELS for p in stale(dest, name, version)]:
        path.unlink()
    for path in dest.glob("cosmos3_batch-*.whl"):
        path.unlink()  # always rebuilt: the working tree may have changed under the same version
    for command in commands:
        subprocess.run(command, check=True)
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {dest}")
    if total > 0.9 * CARRY_LIMIT:
        print(
            f"warning: {total / 2**20:.1f} MiB leaves little of the 64 MiB a device call carries",
            file=sys.stderr,
        )
        return 1
    return 0


def install(source: Path, target: Path) -> int:
    wheels = sorted(source.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {source}: nothing to install", file=sys.stderr)
        return 0
    subprocess.run(install_command(wheels, target), check=True)
    print(target)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder of wheels (default .whl/)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be fetched; fetch nothing")
    parser.add_argument("--install", type=Path, metavar="DIR", help="install the wheels in --dest into DIR")
    args = parser.parse_args(argv)
    if args.install is not None:
        return install(args.dest, args.install)
    return fetch(args.dest, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
