"""``SparsetierOffloadingManager``: vLLM's scheduler-side offloading manager, in the core.

It is a drop-in for vLLM's ``CPUOffloadingManager``: the same constructor, the same calls and
the same results (chunk ids in vLLM's order, evictions, events, metrics). What it tracks lives
in sparsetier's Rust core (``sparsetier._core.ChunkDirectory``); a call converts vLLM's keys
and context once, crosses into Rust once for the whole batch, and builds vLLM's result types.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import (
    CPULoadStoreSpec,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sparsetier._core import ChunkDirectory
from sparsetier.errors import ConfigError

_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING)


class _TrackerView(Mapping[OffloadKey, int]):
    """Read-only view of the reuse tracker: key -> offers counted, least recent first."""

    def __init__(self, directory: ChunkDirectory) -> None:
        self._dir = directory

    def __getitem__(self, key: OffloadKey) -> int:
        count = self._dir.tracked_count(key)
        if count is None:
            raise KeyError(key)
        return count

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._dir.tracked_count(key) is not None

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._dir.tracked_keys() or ())

    def __len__(self) -> int:
        return len(self._dir.tracked_keys() or ())


class SparsetierOffloadingManager(OffloadingManager):
    """vLLM's ``CPUOffloadingManager`` with its state in sparsetier's core.

    ``cache_policy`` is ``"lru"`` or ``"arc"`` (both run in the core); an out-of-tree policy
    (``cache_policy_module_path``) is refused with a ``ConfigError``, because a Python
    ``CachePolicy`` cannot drive the core's structures.
    """

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
    ) -> None:
        if cache_policy_module_path is not None:
            raise ConfigError.of(
                "cache_policy_module_path",
                cache_policy_module_path,
                "None: sparsetier runs 'lru' and 'arc' in its core, not a Python CachePolicy",
            )
        if not isinstance(enable_events, bool):
            raise ConfigError.of("enable_events", repr(enable_events), "True or False")
        if not isinstance(cache_policy, str):
            raise ConfigError.of("cache_policy", repr(cache_policy), "'lru' or 'arc'")
        if info is not None and not callable(getattr(info, "as_config_info", None)):
            raise ConfigError.of("info", repr(info), "None or a CPUOffloadingInfo")
        self.medium: Medium = Medium.CPU
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._dir = ChunkDirectory(
            num_chunks,
            results=_RESULTS,
            cache_policy=cache_policy,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            enable_events=enable_events,
            base_position=ReqContext.get_offload_key_position,
        )
        self._counts = _TrackerView(self._dir) if store_threshold >= 2 else None
        # The connector looks keys up one at a time (thousands a request): the instance's
        # `lookup` is the core's own method, with no Python frame in between. It returns
        # the `LookupResult` members above, as the method below does.
        self.lookup = self._dir.lookup  # type: ignore[method-assign]
        self._lock = threading.Lock()

    @property
    def lock(self) -> threading.Lock:
        """A real lock, not vLLM's default no-op: every call is atomic in the core, but a
        sequence (a `lookup` hit and the `prepare_load` that pins it) is not, and this
        manager may be shared by threads (`docs/reliability.md`, "Threads"). vLLM's
        scheduler enters it once a step."""
        return self._lock

    # --- lookups and loads ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._dir.lookup(key)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return CPULoadStoreSpec(self._dir.prepare_load(keys, req_context))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._dir.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._dir.complete_load(keys)

    # --- stores ---

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self._dir.prepare_store(keys, req_context)
        if out is None:
            return None
        stored, chunks, evicted = out
        return PrepareStoreOutput(
            keys_to_store=stored,
            store_spec=CPULoadStoreSpec(chunks),
            evicted_keys=evicted,
        )

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        success: bool = True,
    ) -> None:
        if not isinstance(success, bool):
            raise ConfigError.of("success", repr(success), "True or False")
        self._dir.complete_store(keys, success)

    # --- requests ---

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._dir.on_new_request(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._dir.finish_request(req_context)

    # --- events, reset, metrics ---

    def take_events(self) -> Iterable[OffloadingEvent]:
        # A generator, as vLLM's: the batch is detached at the first step, so a partly
        # consumed drain is not replayed; a failed store's cleanup names only keys that no
        # retry has stored since.
        events = self._dir.take_events()
        if events is None:
            return
        for keys, removed, metadata_only in events:
            if metadata_only:
                keys = self._dir.absent(keys)
                if not keys:
                    continue
            yield OffloadingEvent(
                keys=keys, medium=self.medium, removed=removed, metadata_only=metadata_only
            )

    def reset_cache(self) -> None:
        self._dir.reset()

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats | None:
        usage, write, read, sizes, skipped = self._dir.take_stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read)
        if skipped is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, skipped)
        return stats

    # --- what vLLM's manager exposes beyond the interface ---

    @property
    def counts(self) -> Mapping[OffloadKey, int] | None:
        """The reuse tracker (key -> offers), or None without a store threshold."""
        return self._counts

    @property
    def stores_skipped_in_current_batch(self) -> int:
        """Store candidates below the threshold since the last ``get_stats``."""
        return self._dir.stores_skipped

    def validate(self) -> None:
        """Checks the core's invariants (``InvariantError`` if one is broken)."""
        self._dir.validate()

    def core_counts(self) -> dict[str, object]:
        """Stored and storing keys, load pins, live request records (tests, monitoring)."""
        return self._dir.counts()
