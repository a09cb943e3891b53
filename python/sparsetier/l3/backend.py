"""The interface an L3 backend implements, and the host-memory views it reads and writes.

A backend executes what the Rust core planned: it never decides what to store or fetch.
Every page is stored with all its pools (KV, Indexer-K, SWA, draft) as one unit, so a hit
is never reported for a page with a pool missing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

#: A page's byte ranges in host memory, ``(address, length)``, every pool, in store order
#: (from ``HiCache.host_segments``).
Segments = Sequence[tuple[int, int]]


def view(address: int, length: int) -> memoryview:
    """A writable byte view of host memory the cache owns (from ``host_segments``)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class StorageBackend(Protocol):
    """Batch exists / get-into / put-from over page keys."""

    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each page is stored complete (every pool, with its checksum)."""
        ...

    def put(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        """Stores each page's segments under its key; per page, whether it is stored."""
        ...

    def get(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        """Reads each page into its segments and verifies it; per page, whether it arrived
        complete and intact (a missing or corrupt object is ``False``, never bad data)."""
        ...

    def remove(self, keys: Sequence[str]) -> None:
        """Deletes the pages (missing ones are ignored)."""
        ...

    def register(self, address: int, length: int) -> None:
        """Host memory that plans will name (a zero-copy backend registers it)."""
        ...

    def healthy(self) -> bool:
        """Whether the store answers now."""
        ...

    def close(self) -> None:
        """Releases the store's resources."""
        ...
