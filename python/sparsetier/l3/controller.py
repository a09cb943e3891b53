"""``StorageController``: runs the L3 plans of one ``HiCache`` on a backend (or of a joined
step scheduler's prefix cache: ``JoinedStepScheduler.enable_storage()``).

The Rust core decides what is written and fetched (write plans under the write policy,
prefetch plans into host pages it allocates); this class only executes them on a worker
thread and reports back on the caller's thread, so the cache is only ever called from one
thread. Under write-back the core also plans writes of the coldest host pages ahead of need
(``write_ahead`` of the host tier), so that host eviction finds pages it can drop at once. A
store that stops answering turns L3 off (one log line, the ``offline_events``
counter); L1/L2 are untouched and requests keep being served. It is probed again every
``retry_interval`` seconds and used again once it answers.

Prefetch policies (SGLang's names): ``best_effort`` takes what arrived when the request is
scheduled, ``wait_complete`` waits for the whole prefetch, ``timeout`` waits up to
``prefetch_timeout`` seconds. Only a leading run of pages that arrived complete and verified
is inserted into the tree.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sparsetier import _checks
from sparsetier._core import HiCache, JoinedStorage
from sparsetier.errors import ConfigError, InvariantError, StoreUnavailableError
from sparsetier.l3.backend import Segments, StorageBackend
from sparsetier.lowlevel import L3Protocol

log = logging.getLogger("sparsetier.l3")

POLICIES = ("best_effort", "wait_complete", "timeout")
BACKEND_CALLS = ("exists", "put", "get", "register", "healthy", "close")


@dataclass
class Prefetch:
    """A prefetch in flight: ``arrived`` leading pages are in host memory and verified."""

    plan_id: int
    start_page: int
    pages: int
    arrived: int = 0
    cancelled: bool = False
    failed: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    committed: int | None = None


class StorageController:
    """Executes ``cache``'s L3 plans on ``backend``."""

    def __init__(
        self,
        cache: HiCache | JoinedStorage,
        backend: StorageBackend,
        *,
        prefetch_policy: str = "best_effort",
        prefetch_timeout: float = 0.5,
        chunk_pages: int = 16,
        retry_interval: float = 1.0,
        host_buffers: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.check_settings(
            prefetch_policy=prefetch_policy, prefetch_timeout=prefetch_timeout,
            chunk_pages=chunk_pages, retry_interval=retry_interval,
        )  # fmt: skip
        missing = [m for m in BACKEND_CALLS if not callable(getattr(backend, m, None))]
        if missing:
            raise ConfigError.of(
                "backend", repr(backend), "a StorageBackend (it lacks " + ", ".join(missing) + ")"
            )
        if cache.storage_stats() is None:
            raise ConfigError.of("cache", "a HiCache without L3", "cache.enable_storage() first")
        self.cache = cache
        self._l3 = L3Protocol(cache)  # the cache's side of the protocol
        self.backend = backend
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout = prefetch_timeout
        self.chunk_pages = chunk_pages
        self.retry_interval = retry_interval
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsetier-l3")
        self._writes: dict[int, Future[list[bool]]] = {}
        self._prefetches: dict[int, Prefetch] = {}
        self._lost: list[str] = []  # why the store went away, reported on the caller's thread
        self._next_probe = 0.0
        self._closed = False
        for address, length in host_buffers:
            backend.register(address, length)

    @staticmethod
    def check_settings(
        *,
        prefetch_policy: Any = "best_effort",
        prefetch_timeout: Any = 0.5,
        chunk_pages: Any = 16,
        retry_interval: Any = 1.0,
    ) -> None:
        """Refuses a bad setting (`ConfigError` naming it), as the constructor does: for a
        caller that checks them before it changes anything."""
        if prefetch_policy not in POLICIES:
            raise ConfigError.of("prefetch_policy", repr(prefetch_policy), " | ".join(POLICIES))
        _checks.count("chunk_pages", chunk_pages, 1)
        _checks.real("prefetch_timeout", prefetch_timeout)
        _checks.real("retry_interval", retry_interval)

    # -- what the caller's loop calls ---------------------------------------------------

    def match_prefix(self, tokens: Any, namespace: int | None = None, **kw: Any) -> dict[str, Any]:
        """``HiCache.match_prefix`` as a dict, plus ``storage_pages``: how many further whole
        pages the store holds right after the cached prefix (0 while L3 is off)."""
        m = self.cache.match_prefix(tokens, namespace, **kw)
        d = m.to_dict()
        d["storage_pages"] = self.storage_pages(tokens, m.device_len + m.host_len, namespace)
        return d

    def storage_pages(self, tokens: Any, cached_tokens: int, namespace: int | None = None) -> int:
        """The leading run of whole pages after `cached_tokens` that the store holds."""
        cached_tokens = _checks.count("cached_tokens", cached_tokens)
        if not self.online:
            return 0
        keys = self.cache.storage_keys(tokens, namespace)
        start = cached_tokens // self._page_size()
        rest = keys[start:]
        if not rest:
            return 0
        try:
            have = self.backend.exists(rest)
        except StoreUnavailableError as e:
            self._go_offline(str(e))
            return 0
        except Exception as e:
            self._go_offline(repr(e))
            return 0
        n = 0
        for h in have:
            if not h:
                break
            n += 1
        return n

    def prefetch(
        self, tokens: Any, start_page: int, n_pages: int, namespace: int | None = None
    ) -> Prefetch | None:
        """Starts fetching pages `start_page..start_page + n_pages` of `tokens` into host
        pages. None when nothing can be fetched now (L3 off, no host page)."""
        self._check_open()
        plan = self._l3.plan_prefetch(tokens, start_page, n_pages, namespace)
        if plan is None:
            return None
        plan_id, keys, pages = plan
        p = Prefetch(plan_id=plan_id, start_page=start_page, pages=len(keys))
        self._prefetches[plan_id] = p
        try:
            segs = [self._l3.host_segments(int(h)) for h in pages]
            self._pool.submit(self._run_prefetch, p, keys, segs)
        except BaseException:
            # Nothing will fetch it: it ends with nothing arrived, its host pages freed.
            p.failed = True
            p.done.set()
            p.committed = self._l3.prefetch_commit(plan_id, 0)
            self._end_prefetch(p)
            raise
        return p

    def finish_prefetch(self, p: Prefetch, policy: str | None = None) -> int:
        """Applies the prefetch policy at scheduling time and inserts the pages that arrived.
        Returns the pages inserted into the tree (now host hits)."""
        policy = policy or self.prefetch_policy
        if policy not in POLICIES:
            raise ConfigError.of("policy", repr(policy), " | ".join(POLICIES))
        if p.committed is not None:
            return p.committed
        if policy == "wait_complete":
            p.done.wait()
        elif policy == "timeout":
            p.done.wait(self.prefetch_timeout)
        p.cancelled = True  # the worker stops after the chunk it is reading
        p.committed = self._l3.prefetch_commit(p.plan_id, p.arrived)
        if p.done.is_set():
            self._end_prefetch(p)
        return p.committed

    def flush(self) -> int:
        """Hands the write plans queued by the cache to the worker; returns how many."""
        self._check_open()
        return len(self._hand_over_writes())

    def _hand_over_writes(self) -> list:
        """Takes the cache's queued write plans and submits them to the worker. A plan that
        cannot be submitted is reported failed at once (its pages let go), with the rest."""
        plans = self._l3.take_writes()
        for i, (plan_id, keys, pages) in enumerate(plans):
            try:
                segs = [self._l3.host_segments(int(h)) for h in pages]
                self._writes[plan_id] = self._pool.submit(self._run_write, keys, segs)
            except BaseException:
                for pid, ks, _ in plans[i:]:
                    self._l3.write_done(pid, [False] * len(ks))
                raise
        return plans

    def poll(self) -> int:
        """Settles finished writes and prefetches, handles a lost store, and probes an
        offline one. Asks the core for its write-ahead (under write-back it keeps a share of the
        host tier clean so that host eviction never waits for a write). Returns the plans
        settled."""
        self._check_open()  # (before write-ahead plans writes no one would take)
        if self.online:
            self._l3.write_ahead()
        self.flush()
        # A backend call on the caller's thread that fails otherwise than going away is the
        # store misbehaving: L3 goes off as for a lost store, and is probed again later.
        settled = 0
        for plan_id, fut in list(self._writes.items()):
            if fut.done():
                del self._writes[plan_id]
                self._l3.write_done(plan_id, fut.result())
                settled += 1
        for p in list(self._prefetches.values()):
            if p.done.is_set() and p.committed is not None:
                self._end_prefetch(p)
                settled += 1
        while self._lost:
            self._go_offline(self._lost.pop())
        if not self.online and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + self.retry_interval
            if self._healthy():
                self._l3.set_online(True)
                log.warning("sparsetier L3: %s store answers again; L3 on", self.backend.name)
        return settled

    def drain(self) -> None:
        """Waits for every write and prefetch, commits what the prefetches fetched, and
        settles everything, until nothing is in flight (settling can plan more: write-ahead
        after a store comes back, write-through of what just landed). It always ends: when
        nothing is left here to wait for, whatever the core still counts in flight is an
        invariant broken, raised as ``InvariantError``."""
        self._check_open()
        while True:
            self.flush()
            for p in list(self._prefetches.values()):
                if p.committed is None:
                    self.finish_prefetch(p, "wait_complete")
            for fut in list(self._writes.values()):
                fut.result()
            for p in list(self._prefetches.values()):
                p.done.wait()
            self.poll()
            stats = self.cache.storage_stats() or {}
            if not stats.get("writes_in_flight") and not stats.get("prefetches_in_flight"):
                return
            if not self._writes and not self._prefetches and not self.cache_has_queued():
                raise InvariantError(
                    f"L3 drain: the core counts {stats.get('writes_in_flight')} writes and "
                    f"{stats.get('prefetches_in_flight')} prefetches in flight, none of "
                    "which this controller runs"
                )

    def cache_has_queued(self) -> bool:
        """Whether the cache queued write plans not yet handed to the worker."""
        self._check_open()
        return bool(self._hand_over_writes())

    def close(self) -> None:
        """Drains, turns L3 off in the cache, stops the worker and closes the backend. Later
        calls that would hand the worker a plan are refused; closing again does nothing."""
        if self._closed:
            return
        self.drain()
        # L3 off in the cache too: it plans no more writes or prefetches that no one would
        # run (their host pages pinned for good); host eviction drops pages as without L3.
        self._l3.set_online(False)
        self._closed = True
        self._pool.shutdown(wait=True)
        self.backend.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError.of("storage", "a closed StorageController", "one not closed yet")

    @property
    def online(self) -> bool:
        stats = self.cache.storage_stats()
        return bool(stats and stats["online"])

    def stats(self) -> dict[str, Any]:
        """The core's L3 counters plus what is in flight here."""
        s = dict(self.cache.storage_stats() or {})
        s["backend"] = self.backend.name
        s["prefetch_policy"] = self.prefetch_policy
        return s

    # -- internals ------------------------------------------------------------------------

    def _page_size(self) -> int:
        return int(self.cache.page_size)

    def _go_offline(self, why: str) -> None:
        if self.online:
            self._l3.set_online(False)
            log.warning(
                "sparsetier L3: %s store unreachable (%s); L3 off, serving from L1/L2",
                self.backend.name,
                why,
            )
        self._next_probe = time.monotonic() + self.retry_interval

    def _healthy(self) -> bool:
        try:
            return bool(self.backend.healthy())
        except Exception:
            return False

    def _end_prefetch(self, p: Prefetch) -> None:
        if p.plan_id in self._prefetches:
            del self._prefetches[p.plan_id]
            self._l3.prefetch_end(p.plan_id)

    # Worker thread: backend calls only; the cache is never touched here.

    def _run_write(self, keys: list[str], segs: list[Segments]) -> list[bool]:
        # Whatever the backend does, the plan is reported: a page it did not say it stored
        # is a failed store (counted by the core), so no plan is lost and its pins go.
        try:
            ok = [bool(x) for x in self.backend.put(keys, segs)]
        except StoreUnavailableError as e:
            self._lost.append(str(e))
            return [False] * len(keys)
        except Exception as e:
            log.warning("sparsetier L3: %s put failed: %r", self.backend.name, e)
            return [False] * len(keys)
        if len(ok) != len(keys):
            log.warning("sparsetier L3: %s put answered for %d of %d pages",
                        self.backend.name, len(ok), len(keys))  # fmt: skip
            return [False] * len(keys)
        return ok

    def _run_prefetch(self, p: Prefetch, keys: list[str], segs: list[Segments]) -> None:
        try:
            for at in range(0, len(keys), self.chunk_pages):
                if p.cancelled:
                    break
                end = min(at + self.chunk_pages, len(keys))
                ok = self.backend.get(keys[at:end], segs[at:end])
                run = next((i for i, good in enumerate(ok) if not good), len(ok))
                p.arrived = at + run
                if run < len(ok):
                    break
        except StoreUnavailableError as e:
            p.failed = True
            self._lost.append(str(e))
        except Exception as e:
            # The pages that arrived before stay; the rest are not fetched.
            p.failed = True
            log.warning("sparsetier L3: %s get failed: %r", self.backend.name, e)
        finally:
            p.done.set()
