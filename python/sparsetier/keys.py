"""Object keys as arrays: the form the residency directory takes them in.

A key is ``(namespace, version, page, layer)``; ``layer = -1`` means all layers (prefix
tiering), a layer index means per-layer sparse residency. A batch is an int64 array of shape
``(N, 4)``, so one call moves the whole batch across the boundary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

ALL_LAYERS = -1


def object_keys(
    namespace: Any, pages: Any, layer: Any = ALL_LAYERS, version: Any = 0
) -> npt.NDArray[np.int64]:
    """Builds an ``(N, 4)`` key array; scalars broadcast against ``pages``.

    >>> object_keys(7, [17, 42, 81], layer=3).tolist()
    [[7, 0, 17, 3], [7, 0, 42, 3], [7, 0, 81, 3]]
    """
    cols = np.broadcast_arrays(
        np.asarray(namespace, dtype=np.int64),
        np.asarray(version, dtype=np.int64),
        np.asarray(pages, dtype=np.int64),
        np.asarray(layer, dtype=np.int64),
    )
    return np.ascontiguousarray(np.stack([c.reshape(-1) for c in cols], axis=1))
