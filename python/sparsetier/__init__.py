"""sparsetier: a tiered KV-cache runtime for sparse-attention LLM inference.

The Rust core (``sparsetier._core``) owns every decision about where cached data lives; this
package is the thin Python layer over torch tensors. The names here are the API an engine
uses (``docs/api.md``): build the pools (``build_sparse_stack``), run decode steps
(``StepScheduler``), keep prefixes (``HiCache``). ``sparsetier.lowlevel`` holds the pieces
those are built from; ``sparsetier.vllm`` plugs into vLLM; ``sparsetier.tools`` holds the
command line, the demo and the benchmarks.
"""

from __future__ import annotations

import warnings
from typing import Any

from sparsetier import lowlevel as _lowlevel
from sparsetier._core import (
    Admission,
    DeviceResolver,
    HiCache,
    JoinedStepScheduler,
    LayerCounts,
    LayerPlan,
    PageAllocation,
    PageTransferBinding,
    Plan,
    PoolPlan,
    PoolSpec,
    PrefixInsert,
    PrefixMatch,
    ResidencyView,
    StepRecord,
    StepScheduler,
    TransferEngine,
    __version__,
    cuda_status,
    plan_stack,
)
from sparsetier.builder import DevicePool, SparseStack, build_sparse_stack
from sparsetier.errors import (
    AllocatorError,
    ConfigError,
    CopyFailedError,
    CudaError,
    CudaUnavailableError,
    InternalError,
    InvalidTransitionError,
    InvariantError,
    KeyExistsError,
    NamespaceDroppedError,
    NotHeldError,
    NotLockedError,
    NotResidentError,
    OutOfPagesError,
    OutOfRangeError,
    PlanError,
    RequestFailedError,
    SparsetierError,
    StoreUnavailableError,
    TransferFailedError,
    TransferStateError,
    UnknownHandleError,
    UnknownNodeError,
    UnknownTransferError,
    WaitTimeoutError,
)

__all__ = [
    "Admission",
    "AllocatorError",
    "ConfigError",
    "CopyFailedError",
    "CudaError",
    "CudaUnavailableError",
    "DevicePool",
    "DeviceResolver",
    "HiCache",
    "InternalError",
    "InvalidTransitionError",
    "InvariantError",
    "JoinedStepScheduler",
    "KeyExistsError",
    "LayerCounts",
    "LayerPlan",
    "NamespaceDroppedError",
    "NotHeldError",
    "NotLockedError",
    "NotResidentError",
    "OutOfPagesError",
    "OutOfRangeError",
    "PageAllocation",
    "PageTransferBinding",
    "Plan",
    "PlanError",
    "PoolPlan",
    "PoolSpec",
    "PrefixInsert",
    "PrefixMatch",
    "RequestFailedError",
    "ResidencyView",
    "SparseStack",
    "SparsetierError",
    "StepRecord",
    "StepScheduler",
    "StoreUnavailableError",
    "TransferEngine",
    "TransferFailedError",
    "TransferStateError",
    "UnknownHandleError",
    "UnknownNodeError",
    "UnknownTransferError",
    "WaitTimeoutError",
    "__version__",
    "build_sparse_stack",
    "cuda_status",
    "plan_stack",
]


def __getattr__(name: str) -> Any:
    # The low-level names lived here until this release; they stay one more, with a warning.
    if name in _lowlevel.__all__:
        warnings.warn(
            f"sparsetier.{name} moved to sparsetier.lowlevel.{name}; the old name goes in "
            "the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_lowlevel, name)
    raise AttributeError(f"module 'sparsetier' has no attribute {name!r}")
