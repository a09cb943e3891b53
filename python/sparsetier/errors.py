"""The exception hierarchy of sparsetier.

Every error the Rust core raises is one of these classes. Each carries its details as
attributes (``field``, ``value``, ``allowed`` for configuration and range errors), so callers can
react without parsing messages. All derive from :class:`SparsetierError`.
"""

from __future__ import annotations

from typing import Any


class SparsetierError(Exception):
    """Base class of every sparsetier error."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        for key, value in details.items():
            setattr(self, key, value)


class ConfigError(SparsetierError, ValueError):
    """A configuration value is outside what sparsetier supports.

    Attributes: ``field`` (as the user spells it), ``value`` (given), ``allowed``.
    """

    field: str
    value: str
    allowed: str

    @classmethod
    def of(cls, field: str, value: object, allowed: str) -> ConfigError:
        """The error for `field` = `value`, with the message the Rust core uses."""
        return cls(
            f"invalid {field} = {value}: allowed {allowed}",
            field=field,
            value=str(value),
            allowed=allowed,
        )


class OutOfRangeError(SparsetierError, ValueError):
    """An index or id lies outside its valid range. Attributes: ``field``, ``value``,
    ``allowed``."""

    field: str
    value: int
    allowed: str


class OutOfPagesError(SparsetierError, MemoryError):
    """An all-or-nothing allocation could not be satisfied; nothing was allocated.

    Attributes: ``requested``, ``free``, ``capacity``.
    """

    requested: int
    free: int
    capacity: int


class AllocatorError(SparsetierError, ValueError):
    """A page was freed twice, or freed by an allocator that does not own it.

    Attributes: ``field``, ``value`` (the page), ``allowed``.
    """

    field: str
    value: int
    allowed: str


class NotHeldError(AllocatorError, ConfigError):  # type: ignore[misc]  # value: the page (int)
    """A call named a page its caller does not hold: a page the cache already owns, a free
    page, or a page of another allocation (a stale list, a match inserted twice). Nothing
    changed. Attributes: ``field``, ``value`` (the page), ``allowed``, ``held_by``. It is a
    ``ConfigError`` too, which is what such pages raised before receipts.
    """

    held_by: str


class InvariantError(SparsetierError, AssertionError):
    """An internal invariant is broken: a bug in sparsetier, never a user error."""


class InternalError(InvariantError):
    """A call into the core panicked (a broken invariant, caught before it reached Python).
    The object it happened in (a step scheduler, its directory, a prefix cache) refuses every
    later call with this error; a copy engine fails the transfer instead and goes on.
    Attributes: ``site`` (where the call entered the core), ``detail`` (the panic's message).
    """

    site: str
    detail: str


class NotResidentError(SparsetierError, LookupError):
    """An object has no device copy and no ready host copy (or was never created).
    Attribute: ``key``."""

    key: str


class KeyExistsError(SparsetierError, ValueError):
    """``allocate`` was given a key that already exists. Attribute: ``key``."""

    key: str


class NamespaceDroppedError(SparsetierError, LookupError):
    """A key names a namespace that was dropped. Attribute: ``namespace``."""

    namespace: str


class InvalidTransitionError(SparsetierError, RuntimeError):
    """The operation is not a transition the residency state machine allows from the object's
    state. Attributes: ``op``, ``key``, ``state``."""

    op: str
    key: str
    state: str


class UnknownTransferError(SparsetierError, LookupError):
    """A transfer id that was never issued, or that finished and was forgotten. Attributes:
    ``field``, ``value``, ``allowed``."""

    field: str
    value: int
    allowed: str


class TransferStateError(SparsetierError, RuntimeError):
    """The transfer is not in the state the operation needs (completing a failed load, ending
    a transfer twice). Attributes: ``op``, ``transfer_id``, ``state``."""

    op: str
    transfer_id: int
    state: str


class TransferFailedError(SparsetierError, RuntimeError):
    """A transfer failed or was cancelled; its waiters get this. Attributes: ``transfer_id``,
    ``reason``."""

    transfer_id: int
    reason: str


class RequestFailedError(SparsetierError, RuntimeError):
    """A request could not be served: a load its prefill needed (or its prefix's Indexer-K
    restore) failed, and so did the retry. The request was ended with nothing leaked; the
    others go on. Attributes: ``rid``, ``reason``."""

    rid: int
    reason: str


class WaitTimeoutError(SparsetierError, TimeoutError):
    """A wait ran out of time. Attributes: ``transfer_id``, ``timeout_ms``."""

    transfer_id: int
    timeout_ms: int


class UnknownHandleError(SparsetierError, LookupError):
    """A pin handle that is unknown or was already released. Attributes: ``field``,
    ``value``, ``allowed``."""

    field: str
    value: int
    allowed: str


class PlanError(SparsetierError, ValueError):
    """A transfer plan is inconsistent: a destination listed twice, bindings of different
    geometry, overlapping buffers. Attributes: ``field``, ``value``, ``allowed``."""

    field: str
    value: str
    allowed: str


class CopyFailedError(SparsetierError, RuntimeError):
    """A copy engine did not write (all of) a transfer; later layers are unpublished.
    Attributes: ``engine``, ``layer`` (first layer not written), ``reason``."""

    engine: str
    layer: int
    reason: str


class CudaUnavailableError(SparsetierError, RuntimeError):
    """CUDA cannot be used here: a library is missing or the driver lacks an entry point.
    Attributes: ``what``, ``fix`` (what to install or change)."""

    what: str
    fix: str


class CudaError(SparsetierError, RuntimeError):
    """A CUDA driver or NVRTC call failed. Attributes: ``call``, ``detail``."""

    call: str
    detail: str


class UnknownNodeError(SparsetierError, LookupError):
    """A prefix-tree node id that is unknown or stale (split off, evicted or dropped since).
    Attributes: ``field``, ``value``, ``allowed``."""

    field: str
    value: int
    allowed: str


class NotLockedError(SparsetierError, RuntimeError):
    """``unlock`` of a node that is not locked. Attributes: ``field``, ``value``, ``allowed``."""

    field: str
    value: int
    allowed: str


class StoreUnavailableError(SparsetierError, ConnectionError):
    """The L3 store cannot be reached (master gone, timeout). The L3 tier turns itself off;
    L1/L2 keep serving. Attributes: ``backend``, ``detail``."""

    backend: str
    detail: str


__all__ = [
    "AllocatorError",
    "ConfigError",
    "CopyFailedError",
    "CudaError",
    "CudaUnavailableError",
    "InternalError",
    "InvalidTransitionError",
    "InvariantError",
    "KeyExistsError",
    "NamespaceDroppedError",
    "NotHeldError",
    "NotLockedError",
    "NotResidentError",
    "OutOfPagesError",
    "OutOfRangeError",
    "PlanError",
    "SparsetierError",
    "StoreUnavailableError",
    "TransferFailedError",
    "TransferStateError",
    "UnknownHandleError",
    "UnknownNodeError",
    "UnknownTransferError",
    "WaitTimeoutError",
]
