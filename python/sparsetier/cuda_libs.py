"""Finding the CUDA libraries that the Rust core loads at run time.

The core dlopens ``libcuda.so.1`` (the driver) and ``libnvrtc.so.13`` (the runtime compiler)
by name. The driver comes with the machine; NVRTC can come from the ``nvidia-cuda-nvrtc``
wheel, whose directory is not on the loader's path. ``preload_nvrtc`` loads it by full path
first, so the core's later load by name finds it already in the process.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

NVRTC_SONAME = "libnvrtc.so.13"


def nvrtc_candidates() -> list[Path]:
    """Where to look, in order: ``$SPARSETIER_NVRTC_DIR``, then the nvidia wheels on sys.path."""
    dirs: list[Path] = []
    env = os.environ.get("SPARSETIER_NVRTC_DIR")
    if env:
        dirs.append(Path(env))
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        dirs += [base / "cu13" / "lib", base / "cuda_nvrtc" / "lib"]
    return [d / NVRTC_SONAME for d in dirs if (d / NVRTC_SONAME).exists()]


def preload_nvrtc() -> Path | None:
    """Loads the first NVRTC found (globally, so the core's dlopen by name reuses it).
    Returns its path, or None when none is found (the system loader may still find one)."""
    for path in nvrtc_candidates():
        # NVRTC opens its builtins library by name at compile time: load it first, from the
        # same directory, so that lookup finds it in the process.
        for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        return path
    return None


def nvrtc_version() -> tuple[int, int]:
    """The (major, minor) version of the NVRTC loaded in this process."""
    lib = ctypes.CDLL(NVRTC_SONAME, mode=ctypes.RTLD_GLOBAL)
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        raise RuntimeError("nvrtcVersion failed")
    return major.value, minor.value
