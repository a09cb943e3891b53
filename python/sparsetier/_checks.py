"""Argument checks for the Python layer's own options: each refuses a bad value with a
`ConfigError` naming the field, the value and what is allowed, before anything changes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Container
from typing import Any

from sparsetier.errors import ConfigError


def count(field: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
    """An integer in [lo, hi] (numpy's too; a bool or a float is no count)."""
    allowed = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError.of(field, repr(value), allowed)
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ConfigError.of(field, value, allowed)
    return value


def real(field: str, value: Any, lo: float = 0.0, hi: float = math.inf) -> float:
    """A finite number in [lo, hi] (an int is taken; a bool, a string or NaN is not)."""
    allowed = f"a finite number >= {lo}" + (f" and <= {hi}" if hi != math.inf else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError.of(field, repr(value), allowed)
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ConfigError.of(field, value, allowed)
    return float(value)


def positive(field: str, value: Any) -> float:
    """A finite number > 0 (a size or a rate: 0 would divide, or mean nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError.of(field, repr(value), "a finite number > 0")
    if not (math.isfinite(float(value)) and value > 0):
        raise ConfigError.of(field, value, "a finite number > 0")
    return float(value)


def text(field: str, value: Any, *, empty: bool = True) -> str:
    """A string (None is not the string "None")."""
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError.of(field, repr(value), "a string" + ("" if empty else ", not empty"))
    return value


def describe(x: Any) -> str:
    """A value as an error names it: a tensor or an array by dtype and shape, else its type."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"{x.dtype} {list(x.shape)}"
    return type(x).__name__


def tensor(field: str, x: Any, dtypes: Container, shape: tuple, allowed: str) -> None:
    """`x` a tensor of one of `dtypes` and of `shape` (None: any size there): a wrong dtype
    or size would be read as other bytes, or broadcast, not refused."""
    ok = hasattr(x, "dtype") and hasattr(x, "dim") and x.dtype in dtypes
    if not (ok and x.dim() == len(shape)):
        raise ConfigError.of(field, describe(x), allowed)
    if not all(n is None or n == m for n, m in zip(shape, x.shape, strict=True)):
        raise ConfigError.of(field, describe(x), allowed)
