"""What every benchmark rank runs to measure itself: peak host memory from /proc (VmHWM, and RssAnon
sampled by a thread) and peak device memory, written to one JSON file per rank; `cli_worker` is one rank of
the real CLI under that probe. `bench/offload_modes.py` launches the ranks and reads their files."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def _proc_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak host memory of this process from /proc. VmHWM is the kernel's own peak RSS (it includes mapped
    checkpoint pages that the page cache shares between ranks); RssAnon (private memory) has no kernel
    high-water mark, so a thread samples it."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.anon_peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="bench-peak-memory")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.anon_peak_kb = max(self.anon_peak_kb, _proc_kb("RssAnon"))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def write(self, path: Path) -> None:
        import torch

        self.anon_peak_kb = max(self.anon_peak_kb, _proc_kb("RssAnon"))
        device = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        report = {
            "vm_hwm": _proc_kb("VmHWM") * 1024,
            "anon_peak": self.anon_peak_kb * 1024,
            "device_peak": device,
        }
        path.write_text(json.dumps(report))


def peaks_path(prefix: str) -> Path:
    return Path(f"{prefix}.rank{os.environ.get('RANK', '0')}.json")


def cli_worker(prefix: str, cli_args: list[str]) -> int:
    """One rank of the real CLI, in this process, so that the rank can report its own peaks."""
    # The typer app, not cli.main(): under torchrun main() leaves the process with os._exit at the end of the
    # job, before this rank could write its peaks.
    from cosmos3_batch.cli import app

    code = 0
    with PeakMemory() as peaks:
        try:
            app(cli_args, prog_name="cosmos3_batch")
        except SystemExit as exc:  # typer ends every command with SystemExit
            code = exc.code if isinstance(exc.code, int) else 1
    peaks.write(peaks_path(prefix))
    return code
