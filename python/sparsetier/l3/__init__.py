"""L3: a storage tier under host memory (see ``docs/architecture.md``, "L3").

The Rust core plans what is written and fetched and keeps the tier states; the backends here
execute the plans: :class:`FileStore` (a local directory, the embedded default) and
:class:`MooncakeStore` (Mooncake Store). :class:`StorageController` connects one ``HiCache``
to one backend.
"""

from __future__ import annotations

import os
from typing import Any

from sparsetier.errors import ConfigError
from sparsetier.l3.backend import StorageBackend
from sparsetier.l3.controller import POLICIES, Prefetch, StorageController
from sparsetier.l3.file import FileStore
from sparsetier.l3.mooncake import MooncakeMaster, MooncakeStore

#: Where the file backend stores pages unless ``storage_config["path"]`` says otherwise.
DEFAULT_FILE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sparsetier", "l3")


def make_backend(kind: str, config: dict[str, Any]) -> StorageBackend:
    """The backend `kind` ("file" or "mooncake") from its part of ``storage_config``."""
    if kind == "file":
        extra = sorted(set(config) - {"path"})
        if extra:
            raise ConfigError.of("storage_config", extra, "for 'file': path")
        path = config.get("path", os.environ.get("SPARSETIER_L3_DIR", DEFAULT_FILE_DIR))
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise ConfigError.of("path", repr(path), "a directory path (not empty)")
        return FileStore(path)
    if kind == "mooncake":
        for need in ("master", "metadata_server"):
            if need not in config:
                raise ConfigError.of(
                    "storage_config",
                    sorted(config),
                    "for 'mooncake': master and metadata_server (and optionally "
                    "local_hostname, protocol, device_name, global_segment_size, "
                    "local_buffer_size)",
                )
        return MooncakeStore(**config)
    raise ConfigError.of("storage_backend", repr(kind), "None, 'file' or 'mooncake'")


__all__ = [
    "DEFAULT_FILE_DIR",
    "POLICIES",
    "FileStore",
    "MooncakeMaster",
    "MooncakeStore",
    "Prefetch",
    "StorageBackend",
    "StorageController",
    "make_backend",
]
