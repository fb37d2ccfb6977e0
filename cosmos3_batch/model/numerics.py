"""The CPU numerics in force: which MKL reproducibility mode the GEMMs actually ran under.

The policy is set in `cosmos3_batch/__init__.py` (strict CNR unless the user set MKL_CBWR). This module
reads back what MKL itself reports, so `summary.json` says the truth even when something loaded MKL
before us, and warns where an exactness promise depends on it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

import torch

import cosmos3_batch

log = logging.getLogger("cosmos3_batch")

# mkl_cbwr_get's branch codes (mkl_cbwr.h) and its strict flag.
_BRANCHES = {
    1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
    10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1", 16: "AVX512_E2",
}  # fmt: skip
_STRICT = 0x10000
_ALL = -1


def mkl_cnr_mode() -> str | None:
    """MKL's CNR mode as it reports it ("AUTO,STRICT", "OFF", ...); None where torch has no MKL we can ask.

    Asks torch's own statically linked MKL (the exported service call behind `mkl_cbwr_get`); the call
    also fixes the mode if MKL had not read it yet, exactly as its first GEMM would.
    """
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    mode = get(_ALL)
    name = _BRANCHES.get(mode & ~_STRICT, f"code {mode & ~_STRICT}")
    return f"{name},STRICT" if mode & _STRICT else name


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_numerics() -> dict:
    """For summary.json: what a comparison run must reproduce to get the same bits on CPU."""
    return {
        "cpu": cpu_name(),
        "mkl_cbwr": mkl_cnr_mode(),
        "mkl_cbwr_env": os.environ.get("MKL_CBWR"),
        "set_by": "cosmos3_batch" if cosmos3_batch.CNR_SET_BY_US else "user",
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def warn_unless_strict(what: str) -> bool:
    """One warning when `what` (--sp, batched branches) runs on CPU without strict CNR. True if warned."""
    mode = mkl_cnr_mode()
    if mode is None or mode.endswith(",STRICT"):
        return False
    log.warning(
        "%s on CPU with MKL_CBWR=%s (MKL reports CNR %s): outputs may differ from the reference pipeline in "
        "the last bits; unset MKL_CBWR (the project then uses %s) for bit-exact results",
        what,
        os.environ.get("MKL_CBWR", ""),
        mode,
        cosmos3_batch.STRICT_CNR,
    )
    return True
