"""vLLM's own manager tests, loaded from its released sdist (``make test`` fetches them).

``load()`` imports ``tests/v1/kv_offload/cpu/test_manager.py`` of vLLM 0.33.0 as a module. The
tests that use only the public manager API are the spec ``SparsetierOffloadingManager`` must
meet; those that reach into ``CPUOffloadingManager``'s internals (its policy object, private
counters and methods) are listed in ``INTERNAL`` with what they reach.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

VLLM_VERSION = "0.33.0"

INTERNAL = {
    "test_cpu_manager_reports_allocation_size_on_allocation_failure": "patches _allocate_chunks",
    "test_lru_batch_eviction_failure_is_atomic": "calls _policy.evict (LRUCachePolicy)",
    "test_lru_repeated_pin_cycles_compact_lazy_heap_entries": "reads _policy._heap",
    "test_reset_discards_stale_request_access_classification": "reads _policy.t1/t2 (ARC)",
    "TestARCPolicy": "reads and sets _policy's ARC lists and target",
    "test_evictable_cache_chunk_count": "reads _num_evictable_cache_chunks, patches _policy",
    "test_touch_forwards_req_context_to_policy": "patches _policy.touch",
    "test_arc_counts_reuse_once_and_keeps_insertions_in_t1": "reads _policy.t1/t2",
    "test_arc_reuse_wins_if_same_request_later_reinserts_key": "reads _policy.t1/t2",
    "test_request_finish_forwards_grouped_deduplicated_accesses": "patches _policy",
    "test_failed_store_records_access_once_and_uses_store_miss_hook": "patches _policy",
    "test_arc_ghost_hit_adapts_once_per_request_before_insertion": "reads _policy.b1",
    "test_arc_pending_chunk_is_not_a_frequency_hit": "reads _policy.t1/t2",
    "test_lru_insert_orders_positioned_chunks_without_followup_access": "LRUCachePolicy alone",
}


def tests_dir() -> Path:
    """Where ``scripts/fetch_vllm_tests.py`` put the tests: ``$SPARSETIER_VLLM_TESTS``, or
    beside the venv's packages."""
    default = Path(sys.prefix) / f"vllm-tests-{VLLM_VERSION}"
    return Path(os.environ.get("SPARSETIER_VLLM_TESTS", default))


def load() -> ModuleType:
    """vLLM's ``test_manager`` module; a clear error where it was not fetched."""
    path = tests_dir() / "tests/v1/kv_offload/cpu/test_manager.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: run `make test`, or "
            f"`python scripts/fetch_vllm_tests.py {VLLM_VERSION} {tests_dir()}`"
        )
    spec = importlib.util.spec_from_file_location("vllm_test_manager", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_names(module: ModuleType) -> set[str]:
    """The tests the module defines: ``test_*`` functions and ``Test*`` classes."""
    return {
        n
        for n, v in vars(module).items()
        if (n.startswith("test_") and callable(v)) or (n.startswith("Test") and isinstance(v, type))
    }
