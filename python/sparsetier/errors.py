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


class InvariantError(SparsetierError, AssertionError):
    """An internal invariant is broken: a bug in sparsetier, never a user error."""


__all__ = [
    "AllocatorError",
    "ConfigError",
    "InvariantError",
    "OutOfPagesError",
    "OutOfRangeError",
    "SparsetierError",
]
