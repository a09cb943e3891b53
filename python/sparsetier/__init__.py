"""sparsetier: a tiered KV-cache runtime for sparse-attention LLM inference.

The Rust core (``sparsetier._core``) owns every decision about where cached data lives; this
package is the thin Python layer over torch tensors.
"""

from __future__ import annotations

from sparsetier._core import (
    BackupPlan,
    LoadPlan,
    PageAllocator,
    PinHandle,
    Plan,
    PoolPlan,
    PoolSpec,
    ResidencyDirectory,
    ResolveResult,
    __version__,
    plan_stack,
    token_pages,
)
from sparsetier.builder import DevicePool, SparseStack, build_sparse_stack
from sparsetier.errors import (
    AllocatorError,
    ConfigError,
    InvalidTransitionError,
    InvariantError,
    KeyExistsError,
    NamespaceDroppedError,
    NotResidentError,
    OutOfPagesError,
    OutOfRangeError,
    SparsetierError,
    TransferFailedError,
    TransferStateError,
    UnknownHandleError,
    UnknownTransferError,
    WaitTimeoutError,
)
from sparsetier.keys import ALL_LAYERS, object_keys

__all__ = [
    "ALL_LAYERS",
    "AllocatorError",
    "BackupPlan",
    "ConfigError",
    "DevicePool",
    "InvalidTransitionError",
    "InvariantError",
    "KeyExistsError",
    "LoadPlan",
    "NamespaceDroppedError",
    "NotResidentError",
    "OutOfPagesError",
    "OutOfRangeError",
    "PageAllocator",
    "PinHandle",
    "Plan",
    "PoolPlan",
    "PoolSpec",
    "ResidencyDirectory",
    "ResolveResult",
    "SparseStack",
    "SparsetierError",
    "TransferFailedError",
    "TransferStateError",
    "UnknownHandleError",
    "UnknownTransferError",
    "WaitTimeoutError",
    "__version__",
    "build_sparse_stack",
    "object_keys",
    "plan_stack",
    "token_pages",
]
