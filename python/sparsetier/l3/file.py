"""``file``: the embedded L3 backend, one checksummed file per page in a local directory.

An object is a 64-byte header (magic, version, CRC-32 of the payload, payload length, the
page's key, and a fingerprint of the pool shape: the page's segment lengths) and the page's
segments back to back. Writes go to a temporary name and are renamed into place, so a reader
sees a whole object or none. A read that finds a bad header, a wrong length or a wrong
checksum is a miss (``corrupt``); one that finds another key's object or another pool shape
(files swapped or copied between stores) is a miss too (``foreign``), never data. Either way
the object is removed so that it is written again.

Every OS error while storing a page (its fan-out directory cannot be made, the disk is full,
a permission, the file size or open file limit) is a failed store of that page, counted in
``write_errors``; every OS error while reading one (a symlink loop, an I/O error) is a miss,
counted in ``read_errors``. Something other than a regular file where a page was (a FIFO,
which a plain open would wait on forever, or a directory) is a ``corrupt`` miss, never opened
for a blocking read. A missing root, or one the process may not reach (a permission on a
parent, an I/O error on the mount), is the store being gone (``StoreUnavailableError``).
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

from sparsetier.errors import ConfigError, StoreUnavailableError
from sparsetier.l3.backend import Segments, view

_HEADER = struct.Struct("<8sIIQ32sI4x")
_MAGIC = b"STIERL3\0"
_VERSION = 2


def _shape(segs: Segments) -> int:
    """A fingerprint of the page's layout: its segment lengths, in order."""
    return zlib.crc32(struct.pack(f"<{len(segs)}Q", *(n for _, n in segs)))


_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key_field(key: str) -> bytes:
    return key.encode()[:32]


class FileStore:
    """Pages as files under ``root`` (created if missing), fanned out by key prefix."""

    name = "file"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError.of(
                "root", str(root), f"a directory that can be created ({e.strerror})"
            ) from None
        self.corrupt = 0
        self.foreign = 0
        self.write_errors = 0
        self.read_errors = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.page"

    @staticmethod
    def _check_keys(keys: Sequence[str]) -> None:
        """A key names a file under the root: letters, digits, "-" and "_" only (the core's
        page keys are hex), so that none names a path outside it ("../x"). Checked for the
        whole call before any page is touched."""
        for i, key in enumerate(keys):
            if not (isinstance(key, str) and _KEY.fullmatch(key)):
                raise ConfigError.of(f"keys[{i}]", repr(key), "letters, digits, - and _")

    def _reachable(self) -> None:
        # A missing or unreachable root is an unmounted, removed or locked-out store, not a
        # miss per page.
        try:
            gone = not self.root.is_dir()
            why = "is gone"
        except OSError as e:  # EACCES on a parent, an I/O error on the mount
            gone, why = True, f"cannot be reached ({e.strerror})"
        if gone:
            raise StoreUnavailableError(
                f"L3 directory {self.root} {why}", backend="file", detail=str(self.root)
            )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._reachable()
        self._check_keys(keys)
        return [self._is_page(k) for k in keys]

    def _is_page(self, key: str) -> bool:
        try:
            return self._path(key).is_file()
        except OSError:  # a fan-out directory it may not search: a miss, counted
            self.read_errors += 1
            return False

    def put(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        self._reachable()
        self._check_keys(keys)
        return [self._put_one(k, segs) for k, segs in zip(keys, pages, strict=True)]

    def _put_one(self, key: str, segs: Segments) -> bool:
        path = self._path(key)
        try:
            if path.is_file():
                return True  # same key, same prefix: the stored page is this page
        except OSError:
            self.write_errors += 1
            return False
        views = [view(a, n) for a, n in segs]
        crc = 0
        for v in views:
            crc = zlib.crc32(v, crc)
        total = sum(n for _, n in segs)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _VERSION, crc, total, _key_field(key), _shape(segs)))
                for v in views:
                    f.write(v)
            os.replace(tmp, path)
        except OSError:
            self.write_errors += 1
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        return True

    def get(self, keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        self._reachable()
        self._check_keys(keys)
        return [self._get_one(k, segs) for k, segs in zip(keys, pages, strict=True)]

    def _get_one(self, key: str, segs: Segments) -> bool:
        path = self._path(key)
        try:
            # Non-blocking: a FIFO put in a page's place must not hold the reader forever.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        except OSError:
            self.read_errors += 1
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return self._bad(path)
            with os.fdopen(fd, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return self._bad(path)
                magic, version, crc, total, stored_key, shape = _HEADER.unpack(head)
                if (magic, version) != (_MAGIC, _VERSION):
                    return self._bad(path)
                if stored_key.rstrip(b"\0") != _key_field(key) or shape != _shape(segs):
                    self.foreign += 1
                    return self._bad(path, counted=True)
                if total != sum(n for _, n in segs):
                    return self._bad(path)
                got = 0
                for a, n in segs:
                    v = view(a, n)
                    r = f.readinto(v)
                    if r != n:
                        return self._bad(path)
                    got = zlib.crc32(v, got)
                if f.read(1) or got != crc:
                    return self._bad(path)
        except OSError:
            self.read_errors += 1
            return False
        return True

    def _bad(self, path: Path, counted: bool = False) -> bool:
        if not counted:
            self.corrupt += 1
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # removed the next time, or overwritten
        return False

    def remove(self, keys: Sequence[str]) -> None:
        self._reachable()
        self._check_keys(keys)
        for k in keys:
            try:
                self._path(k).unlink(missing_ok=True)
            except OSError:
                pass  # a page that cannot be removed is one the store keeps

    def register(self, address: int, length: int) -> None:
        del address, length  # plain file I/O needs no registration

    def healthy(self) -> bool:
        try:
            return self.root.is_dir() and os.access(self.root, os.W_OK | os.X_OK)
        except OSError:
            return False

    def close(self) -> None:
        pass
