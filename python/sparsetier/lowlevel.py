"""The pieces `StepScheduler` and `HiCache` are built from, for those who build their own
runtime: the residency directory and its results, the page allocator, prepared page
transfers, object keys, trace replay and the CUDA kernels' cubins.

An engine that uses `StepScheduler`, `HiCache` or `sparsetier.vllm` needs none of this. Here
the caller owns what the core owns there: it completes the transfers it starts and releases
the pins it takes (`docs/api.md`, "Low level").
"""

from __future__ import annotations

from sparsetier._core import (
    BackupPlan,
    LoadPlan,
    PageAllocator,
    PageTransferGroup,
    PinHandle,
    PreparedPageTransfer,
    ResidencyDirectory,
    ResolveResult,
    TransferHandle,
    compile_cuda_kernels,
    kernel_cubin,
    replay_trace,
    token_pages,
    trace_peak_live,
)
from sparsetier.keys import ALL_LAYERS, object_keys

__all__ = [
    "ALL_LAYERS",
    "BackupPlan",
    "LoadPlan",
    "PageAllocator",
    "PageTransferGroup",
    "PinHandle",
    "PreparedPageTransfer",
    "ResidencyDirectory",
    "ResolveResult",
    "TransferHandle",
    "compile_cuda_kernels",
    "kernel_cubin",
    "object_keys",
    "replay_trace",
    "token_pages",
    "trace_peak_live",
]
