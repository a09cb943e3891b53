"""Object keys as arrays: the form the residency directory takes them in.

A key is ``(namespace, version, page, layer)``; ``layer = -1`` means all layers (prefix
tiering), a layer index means per-layer sparse residency. A batch is an int64 array of shape
``(N, 4)``, so one call moves the whole batch across the boundary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from sparsetier.errors import ConfigError

ALL_LAYERS = -1


def object_keys(
    namespace: Any, pages: Any, layer: Any = ALL_LAYERS, version: Any = 0
) -> npt.NDArray[np.int64]:
    """Builds an ``(N, 4)`` key array; scalars broadcast against ``pages``.

    >>> object_keys(7, [17, 42, 81], layer=3).tolist()
    [[7, 0, 17, 3], [7, 0, 42, 3], [7, 0, 81, 3]]
    """
    named = {
        "namespace": _ints(namespace, "namespace"),
        "version": _ints(version, "version"),
        "pages": _ints(pages, "pages"),
        "layer": _ints(layer, "layer"),
    }
    shape: tuple[int, ...] = ()
    for field, a in named.items():
        try:
            shape = np.broadcast_shapes(shape, a.shape)
        except ValueError:  # numpy's own error names no argument
            allowed = f"a shape that broadcasts with {list(shape)}"
            raise ConfigError.of(field, list(a.shape), allowed) from None
    cols = np.broadcast_arrays(*named.values())
    return np.ascontiguousarray(np.stack([c.reshape(-1) for c in cols], axis=1))


def _ints(value: Any, field: str) -> npt.NDArray[np.int64]:
    """`value` as int64 by value; floats, bools, strings and values past int64 are refused
    (``ConfigError`` naming `field`), never truncated or wrapped."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        a = None
    ok = a is not None and (a.size == 0 or a.dtype.kind in "iu")
    if ok and a is not None and a.size and a.dtype.kind == "u" and a.dtype.itemsize == 8:
        ok = int(a.max()) <= np.iinfo(np.int64).max
    if not ok or a is None:
        raise ConfigError.of(field, _short(value), "integers (int64)")
    return a.astype(np.int64, copy=False)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
