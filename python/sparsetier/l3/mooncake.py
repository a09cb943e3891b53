"""``mooncake``: Mooncake Store, the distributed KV-cache store SGLang HiCache and vLLM use.

Each page is stored as one object ``<key>`` gathered from its segments (every pool and layer
of the page, put from and got into host memory registered with the store: zero copy) and,
written last, a manifest ``<key>.m`` with the segment lengths and CRC-32s. A page exists once
its manifest does, and is read only whole and verified. Return codes below zero other than
"not found" mean the store is unreachable: :class:`~sparsetier.errors.StoreUnavailableError`,
which turns L3 off.

``MooncakeMaster`` starts a real ``mooncake_master`` (with its HTTP metadata server) on free
localhost ports, for tests, benchmarks and single-machine use. Across machines, point
``master`` and ``metadata_server`` at the shared master and set ``protocol="rdma"``.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparsetier._checks import count, text
from sparsetier.errors import ConfigError, StoreUnavailableError
from sparsetier.l3.backend import Segments, view

# Mooncake's ErrorCode values that mean "no such object" rather than "store unreachable".
_NOT_FOUND = {-704, -703, -706}
_EXISTS = -705


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_master() -> str | None:
    """The ``mooncake_master`` installed beside the running interpreter (the one its wheel put
    in this environment's ``bin``, found even when the environment is not activated), else
    the first on ``PATH``."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mooncake_master")


class MooncakeMaster:
    """A ``mooncake_master`` process on localhost with its built-in HTTP metadata server."""

    def __init__(self) -> None:
        exe = find_master()
        if exe is None:
            raise ConfigError.of(
                "storage_backend",
                "'mooncake'",
                "an installed mooncake_master (pip install mooncake-transfer-engine-non-cuda)",
            )
        self.rpc_port = _free_port()
        self.http_port = _free_port()
        self.metrics_port = _free_port()
        self._cmd = [
            exe,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout: float = 20.0) -> None:
        """Starts (or restarts) the master and waits until both ports accept connections."""
        self.proc = subprocess.Popen(
            self._cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        for port in (self.rpc_port, self.http_port):
            while True:
                if self.proc.poll() is not None:
                    raise StoreUnavailableError(
                        f"mooncake_master exited with {self.proc.returncode}",
                        backend="mooncake",
                        detail=" ".join(self._cmd),
                    )
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise StoreUnavailableError(
                            f"mooncake_master did not listen on {port}",
                            backend="mooncake",
                            detail=" ".join(self._cmd),
                        ) from None
                    time.sleep(0.05)

    def kill(self) -> None:
        """Kills the master at once (a crash, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """Stops the master."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MooncakeStore:
    """A Mooncake Store client (``MooncakeDistributedStore``) over TCP by default.

    ``global_segment_size`` is the memory this client lends to the store (the store's
    capacity on one machine); ``local_buffer_size`` its transfer buffer.
    """

    name = "mooncake"

    def __init__(
        self,
        *,
        master: str,
        metadata_server: str,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 64 << 20,
        **extra: Any,
    ) -> None:
        if extra:
            raise ConfigError.of(
                "storage_config",
                sorted(extra),
                "master, metadata_server, local_hostname, protocol, device_name, "
                "global_segment_size, local_buffer_size",
            )
        # A wrong type fails inside setup() as a TypeError, or (a bool) as a setup failure,
        # which reads as an unreachable store.
        for field, value in (("master", master), ("metadata_server", metadata_server),
                             ("local_hostname", local_hostname), ("protocol", protocol),
                             ("device_name", device_name)):  # fmt: skip
            text(field, value, empty=field == "device_name")
        count("global_segment_size", global_segment_size)
        count("local_buffer_size", local_buffer_size)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError.of(
                "storage_backend",
                "'mooncake'",
                "an installed mooncake wheel (pip install mooncake-transfer-engine-non-cuda)",
            ) from e
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_hostname,
            metadata_server,
            global_segment_size,
            local_buffer_size,
            protocol,
            device_name,
            master,
        )
        if rc != 0:
            raise StoreUnavailableError(
                f"Mooncake Store setup failed ({rc}) with master {master}",
                backend="mooncake",
                detail=f"setup returned {rc}",
            )
        self._registered: list[tuple[int, int]] = []

    def _check(self, rc: int, what: str) -> None:
        if rc < 0 and rc not in _NOT_FOUND and rc != _EXISTS:
            raise StoreUnavailableError(
                f"Mooncake Store {what} failed ({rc})", backend="mooncake", detail=str(rc)
            )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        _check_keys(keys)
        if not keys:
            return []
        rcs = self._store.batch_is_exist([f"{k}.m" for k in keys])
        for rc in rcs:
            self._check(rc, "exists")
        return [rc == 1 for rc in rcs]

    def put(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        _check_keys(keys, pages)
        if not keys:
            return []
        ptrs = [[a for a, _ in segs] for segs in pages]
        sizes = [[n for _, n in segs] for segs in pages]
        # One object per page, gathered from its segments (zero copy from registered memory).
        rcs = self._store.batch_put_from_multi_buffers(list(keys), ptrs, sizes)
        for rc in rcs:
            self._check(rc, "put")
        ok = [rc == 0 or rc == _EXISTS for rc in rcs]
        done = [i for i, good in enumerate(ok) if good]
        if done:
            # The manifests last: a page exists once its manifest does.
            manifests = [_manifest(pages[i], keys[i]) for i in done]
            rc = self._store.put_batch([f"{keys[i]}.m" for i in done], manifests)
            self._check(rc, "put")
            if rc < 0 and rc != _EXISTS:
                return [False] * len(keys)
        return ok

    def get(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        _check_keys(keys, pages)
        if not keys:
            return []
        manifests = self._store.get_batch([f"{k}.m" for k in keys])
        if len(manifests) != len(keys):
            raise StoreUnavailableError(
                "Mooncake Store get_batch failed", backend="mooncake", detail="short answer"
            )
        ptrs = [[a for a, _ in segs] for segs in pages]
        sizes = [[n for _, n in segs] for segs in pages]
        rcs = self._store.batch_get_into_multi_buffers(list(keys), ptrs, sizes)
        for rc in rcs:
            self._check(rc, "get")
        return [
            rc == sum(sz) and m == _manifest(segs, k)
            for rc, sz, m, segs, k in zip(rcs, sizes, manifests, pages, keys, strict=True)
        ]

    def remove(self, keys: Sequence[str]) -> None:
        _check_keys(keys)
        if not keys:
            return
        # The manifests first: a page without its manifest no longer exists.
        for names in ([f"{k}.m" for k in keys], list(keys)):
            for rc in self._store.batch_remove(names, True):
                self._check(rc, "remove")

    def register(self, address: int, length: int) -> None:
        for field, value in (("address", address), ("length", length)):
            if not _positive(value):  # else a TypeError, or "unreachable" for address 0
                raise ConfigError.of(field, repr(value), "a positive Python int")
        rc = self._store.register_buffer(address, length)
        if rc != 0:
            raise StoreUnavailableError(
                f"Mooncake Store register_buffer failed ({rc})",
                backend="mooncake",
                detail=str(rc),
            )
        self._registered.append((address, length))

    def healthy(self) -> bool:
        # health_check() reports the local client; a round trip to the master says more.
        try:
            rc = self._store.batch_is_exist(["sparsetier-health-probe"])[0]
        except Exception:
            return False
        return rc >= 0

    def close(self) -> None:
        for a, _ in self._registered:
            self._store.unregister_buffer(a)
        self._registered.clear()
        self._store.close()


def _check_keys(keys: Sequence[str], pages: Sequence[Segments] | None = None) -> None:
    """Refuses a caller's mistake before the store sees it, where it would come back as a
    store failure (which turns L3 off) or name other objects: a str as the keys (a key per
    character), a key ending ".m" (another page's manifest), pages not one per key, a page of
    no segment or one not `(address, length)` of positive integers."""
    if isinstance(keys, (str, bytes)):
        raise ConfigError.of("keys", repr(keys)[:80], "a sequence of keys, not one string")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k or k.endswith(".m"):
            raise ConfigError.of(f"keys[{i}]", repr(k)[:80], 'a string, not ending in ".m"')
    if pages is None:
        return
    if len(pages) != len(keys):
        raise ConfigError.of("pages", f"{len(pages)} pages", f"one per key ({len(keys)})")
    for i, segs in enumerate(pages):
        if not segs or not all(
            isinstance(seg, tuple | list) and len(seg) == 2 and all(_positive(x) for x in seg)
            for seg in segs
        ):
            raise ConfigError.of(
                f"pages[{i}]", repr(segs)[:80], "(address, length) pairs of positive Python ints"
            )


def _positive(x: object) -> bool:
    # Python ints, as the core hands them: the client and ctypes take no other.
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _manifest(segs: Segments, key: str) -> bytes:
    """The page's key, then the segment count and (length, CRC-32) per segment of the page in
    host memory: an object read under another key (swapped, copied) is a miss, never data."""
    out = [len(segs)]
    for a, n in segs:
        out += [n, zlib.crc32(view(a, n))]
    return key.encode() + b"\0" + struct.pack(f"<I{2 * len(segs)}Q", *out)
