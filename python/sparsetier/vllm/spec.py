"""``SparsetierOffloadingSpec``: what vLLM's ``OffloadingSpecFactory`` loads.

It reads the sizes from vLLM's ``OffloadingConfig`` (``cpu_bytes_to_use``, the KV bytes one
worker keeps per block, blocks per chunk, the KV-cache groups) and its options from
``kv_connector_extra_config``, each checked with a ``ConfigError`` that names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo

from sparsetier.errors import ConfigError
from sparsetier.vllm.manager import SparsetierOffloadingManager
from sparsetier.vllm.worker import SparsetierOffloadingWorker, check_engine_options

# Keys of kv_connector_extra_config that vLLM's connector itself reads (passed through).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "sync_load_budget_bytes",
        "canonical_layout",
    }
)


@dataclass(frozen=True)
class SpecOptions:
    """The checked options of ``kv_connector_extra_config``."""

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    io_backend: str = "auto"
    copy_threads: int | None = None
    sm_limit: int | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> SpecOptions:
        own = {
            "cpu_bytes_to_use",
            "eviction_policy",
            "cache_policy_module_path",
            "store_threshold",
            "max_tracker_size",
            "io_backend",
            "copy_threads",
            "sm_limit",
        }
        for key in extra:
            if key not in own and key not in VLLM_KEYS:
                raise ConfigError.of(
                    f"kv_connector_extra_config[{key!r}]",
                    extra[key],
                    "a known option: " + ", ".join(sorted(own | VLLM_KEYS)),
                )

        def integer(key: str, default: int | None, lo: int) -> int | None:
            value = extra.get(key, default)
            if value is None and default is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ConfigError.of(key, value, f"an integer >= {lo}")
            try:
                number = int(value)
                # (An int is exact as it is: float() would round one past 2^53.)
                exact = isinstance(value, int) or number == float(value)
            except (ValueError, OverflowError):  # (OverflowError: an infinite float)
                raise ConfigError.of(key, value, f"an integer >= {lo}") from None
            if not exact or number < lo:
                raise ConfigError.of(key, value, f"an integer >= {lo}")
            return number

        if extra.get("cpu_bytes_to_use") is None:
            raise ConfigError.of(
                "cpu_bytes_to_use", None, "the host bytes to use, in kv_connector_extra_config"
            )
        policy = extra.get("eviction_policy", "lru")
        if policy not in ("lru", "arc"):
            raise ConfigError.of("eviction_policy", policy, "'lru' or 'arc'")
        if extra.get("cache_policy_module_path") is not None:
            raise ConfigError.of(
                "cache_policy_module_path",
                extra["cache_policy_module_path"],
                "None: sparsetier runs 'lru' and 'arc' in its core, not a Python CachePolicy",
            )
        if extra.get("canonical_layout"):
            raise ConfigError.of(
                "canonical_layout",
                extra["canonical_layout"],
                "False: sparsetier keeps each worker's blocks in its own pools",
            )
        io_backend = extra.get("io_backend", "auto")
        check_engine_options(io_backend, extra.get("copy_threads"), extra.get("sm_limit"))
        return cls(
            cpu_bytes_to_use=integer("cpu_bytes_to_use", None, 1),
            eviction_policy=policy,
            store_threshold=integer("store_threshold", 0, 0),
            max_tracker_size=integer("max_tracker_size", 64_000, 1),
            io_backend=io_backend,
            copy_threads=integer("copy_threads", None, 1),
            sm_limit=integer("sm_limit", None, 1),
        )


class SparsetierOffloadingSpec(OffloadingSpec):
    """The spec vLLM's ``OffloadingConnector`` loads (``spec_name``/``spec_module_path``).

    The host pool holds ``cpu_bytes_to_use // (kv_bytes_per_block * world_size *
    blocks_per_chunk)`` chunks, as vLLM's CPU spec counts them (without its shared-memory
    alignment: each worker keeps its own pools).
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        # The manager reports vLLM's CPU metrics under vLLM's names.
        return CPUOffloadingSpec.build_metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options = SpecOptions.parse(self.extra_config)
        copies = max(config.parallel.world_size, 1)
        per_chunk = config.worker_kv_bytes_per_block * copies * self.blocks_per_chunk
        self.num_chunks = self.options.cpu_bytes_to_use // per_chunk if per_chunk > 0 else 0
        self.kv_bytes_per_chunk = per_chunk
        self.info = CPUOffloadingInfo.from_config(config, self.num_chunks, per_chunk)
        self._manager: SparsetierOffloadingManager | None = None
        self._worker: SparsetierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            o = self.options
            self._manager = SparsetierOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=o.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=o.store_threshold,
                max_tracker_size=o.max_tracker_size,
                info=self.info,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if self.num_chunks == 0:
                raise ConfigError.of(
                    "cpu_bytes_to_use",
                    self.options.cpu_bytes_to_use,
                    f"at least one chunk: {self.kv_bytes_per_chunk} bytes or more",
                )
            groups = len(kv_caches.group_data_refs)
            if groups != len(self.config.groups):
                raise ConfigError.of(
                    "kv_caches.group_data_refs",
                    f"{groups} groups",
                    f"{len(self.config.groups)}: one per KV-cache group of the config",
                )
            # Bytes one block takes in every group, for the record (the config has only
            # their sum): DeepSeek-V3.2's MLA and indexer groups differ.
            self.group_bytes_per_block = [
                sum(ref.page_size_bytes for ref in refs) for refs in kv_caches.group_data_refs
            ]
            per_block = sum(t.page_size_bytes for t in kv_caches.tensors)
            if per_block > self.config.worker_kv_bytes_per_block > 0:
                raise ConfigError.of(
                    "kv_caches",
                    f"{per_block} bytes per block",
                    f"at most worker_kv_bytes_per_block = "
                    f"{self.config.worker_kv_bytes_per_block}, which sized the pool",
                )
            o = self.options
            self._worker = SparsetierOffloadingWorker(
                kv_caches,
                self.blocks_per_chunk,
                self.num_chunks,
                io_backend=o.io_backend,
                copy_threads=o.copy_threads,
                sm_limit=o.sm_limit,
            )
        return self._worker
