"""What this machine is: CPU, cores, BLAS, memory and library versions.

Measured costs are cached per machine (``pacing.costs.machine_fingerprint``, from ``cpu_name`` and
``blas_in_use``); a benchmark header records ``machine_info()``. On Linux, MLX's CPU matmuls run on whichever
BLAS the process resolves ``cblas_sgemm`` to (``blas_in_use``); ``find_fast_blas`` finds an installed
multithreaded OpenBLAS to preload.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np

#: Paths where distributions put a multithreaded OpenBLAS (``{arch}`` = ``platform.machine()``).
FAST_BLAS_CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def machine_info() -> dict:
    """Everything a benchmark header should say about this machine."""
    info = {
        "system": platform.system(),
        "arch": platform.machine(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
    }
    info["memory_gb"] = _memory_gb()
    info["platform"] = platform.platform()
    info["python"] = platform.python_version()
    info["versions"] = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "numpy": np.__version__,
                        "mlxspec": _package_version("mlxspec")}
    info["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return info


def cpu_name() -> str:
    """The CPU's marketing name, e.g. ``"Apple M2 Pro"`` or ``"AMD EPYC 7B13"``."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
            if out.stdout.strip():
                return out.stdout.strip()
        except OSError:
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_in_use() -> dict:
    """Which BLAS MLX's CPU matmuls resolve to in this process.

    On Linux, a BLAS in the global symbol scope (``LD_PRELOAD``) wins over the
    reference BLAS bundled with the ``mlx[cpu]`` wheel; otherwise the bundled one is used.

    Returns:
        dict: ``name`` (``"OpenBLAS"``, ``"reference BLAS"``, ``"Accelerate"``, ...),
        ``path`` (the library, when found) and ``detail`` (OpenBLAS's build string).
    """
    if sys.platform == "darwin":
        return {"name": "Accelerate", "path": None, "detail": "macOS"}
    path = _global_symbol_library("cblas_sgemm")
    if path is None:
        # numpy's own OpenBLAS has renamed (scipy_*64_) symbols that MLX never calls
        mapped = [p for p in _mapped_libraries() if re.search(r"blas|mkl|blis", Path(p).name, re.I)
                  and "scipy_openblas" not in p]
        path = next((p for p in mapped if "mlx" in p), mapped[0] if mapped else None)
    if path is None:
        return {"name": "unknown", "path": None, "detail": None}
    real = os.path.realpath(path).lower()
    name = ("OpenBLAS" if "openblas" in real else "Intel MKL" if "mkl" in real
            else "BLIS" if "blis" in real else "reference BLAS")
    detail = _openblas_config() if name == "OpenBLAS" else None
    return {"name": name, "path": path, "detail": detail}


def find_fast_blas() -> str | None:
    """Path of an installed multithreaded OpenBLAS to preload on Linux, or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    arch = platform.machine()
    return next((p for p in (c.format(arch=arch) for c in FAST_BLAS_CANDIDATES) if os.path.isfile(p)), None)


def _global_symbol_library(symbol: str) -> str | None:
    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p)
        info = DlInfo()
        if process.dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return info.dli_fname.decode()
    except (AttributeError, OSError):
        pass
    return None


def _mapped_libraries() -> list[str]:
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return list(dict.fromkeys(line.split()[-1] for line in lines if ".so" in line and "/" in line))


def _openblas_config() -> str | None:
    try:
        get_config = ctypes.CDLL(None).openblas_get_config
        get_config.restype = ctypes.c_char_p
        return get_config().decode().strip()
    except (AttributeError, OSError):
        return None


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None
