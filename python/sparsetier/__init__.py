"""sparsetier: a tiered KV-cache runtime for sparse-attention LLM inference.

The Rust core (``sparsetier._core``) owns every decision about where cached data lives; this
package is the thin Python layer over torch tensors.
"""

from __future__ import annotations

from sparsetier._core import PageAllocator, Plan, PoolPlan, PoolSpec, __version__, plan_stack
from sparsetier.builder import DevicePool, SparseStack, build_sparse_stack
from sparsetier.errors import (
    AllocatorError,
    ConfigError,
    InvariantError,
    OutOfPagesError,
    OutOfRangeError,
    SparsetierError,
)

__all__ = [
    "AllocatorError",
    "ConfigError",
    "DevicePool",
    "InvariantError",
    "OutOfPagesError",
    "OutOfRangeError",
    "PageAllocator",
    "Plan",
    "PoolPlan",
    "PoolSpec",
    "SparseStack",
    "SparsetierError",
    "__version__",
    "build_sparse_stack",
    "plan_stack",
]
