"""sparsetier under vLLM 0.33: the KV offloading backend of its ``OffloadingConnector``.

vLLM loads it as an out-of-tree ``OffloadingSpec``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "SparsetierOffloadingSpec",
                                    "spec_module_path": "sparsetier.vllm",
                                    "cpu_bytes_to_use": 64000000000}}'

- :class:`SparsetierOffloadingSpec` reads the sizes and options and builds the two halves;
- :class:`SparsetierOffloadingManager` (scheduler side) is a drop-in for vLLM's
  ``CPUOffloadingManager``: the same calls and results, with the state (keys, chunks, pins,
  recency, store state, events) in sparsetier's Rust core;
- :class:`SparsetierOffloadingWorker` (worker side) moves blocks between vLLM's KV caches
  (every KV-cache group, each with its own bytes per block: DeepSeek-V3.2's MLA and indexer
  groups) and pinned host pools through sparsetier's copy engines.

Install with ``pip install sparsetier[vllm]``. ``docs/vllm.md`` maps vLLM's calls onto the core.
"""

from __future__ import annotations

try:
    import vllm.v1.kv_offload.base  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("sparsetier.vllm needs vLLM 0.33 (pip install 'sparsetier[vllm]')") from e

from sparsetier.vllm.manager import SparsetierOffloadingManager
from sparsetier.vllm.spec import SparsetierOffloadingSpec
from sparsetier.vllm.worker import SparsetierOffloadingWorker

__all__ = [
    "SparsetierOffloadingManager",
    "SparsetierOffloadingSpec",
    "SparsetierOffloadingWorker",
]
