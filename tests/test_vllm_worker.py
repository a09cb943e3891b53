"""The spec and the worker under vLLM 0.33: the spec loads through vLLM's
``OffloadingSpecFactory`` from a real ``OffloadingConfig``; the worker moves DeepSeek-V3.2-shaped
KV caches (MLA and indexer groups, 64-token blocks) to host and back through the manager's
chunks, as the connector drives them, on the cpu engine; failed stores and loads are reported
failed and leave nothing pinned.
"""

from __future__ import annotations

import pytest
import torch
from block_layout import INDEXER_PAGE, MLA_PAGE, TOKENS_PER_BLOCK, dsv32_caches, stamp
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from sparsetier import testing
from sparsetier.errors import ConfigError
from sparsetier.vllm import (
    SparsetierOffloadingManager,
    SparsetierOffloadingSpec,
    SparsetierOffloadingWorker,
)

LAYERS, BLOCKS = 3, 32


def config(extra: dict | None = None, *, bpc: int = 1, world_size: int = 1) -> OffloadingConfig:
    groups = (
        OffloadingGroupConfig(TOKENS_PER_BLOCK, tuple(f"mla.{i}" for i in range(LAYERS)), 0),
        OffloadingGroupConfig(TOKENS_PER_BLOCK, tuple(f"indexer.{i}" for i in range(LAYERS)), 1),
    )
    options = {
        "spec_name": "SparsetierOffloadingSpec",
        "spec_module_path": "sparsetier.vllm",
        "cpu_bytes_to_use": 12 * LAYERS * (MLA_PAGE + INDEXER_PAGE),
        **(extra or {}),
    }
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=LAYERS * (MLA_PAGE + INDEXER_PAGE),
        enable_kv_cache_events=True,
        extra_config=options,
        engine_id="test",
        model=OffloadingModelConfig(name="dsv32-shaped", dtype="fp8", max_model_len=8192),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def kv_caches() -> CanonicalKVCaches:
    tensors, pages, groups = dsv32_caches(LAYERS, BLOCKS)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(tensors, pages, strict=True)],
        group_data_refs=[[CanonicalKVCacheRef(t, b) for t, b in g] for g in groups],
    )


def test_the_spec_loads_through_vllms_factory():
    cfg = config()
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert isinstance(spec, SparsetierOffloadingSpec)
    assert spec.num_chunks == 12
    manager = spec.get_manager()
    assert isinstance(manager, SparsetierOffloadingManager)
    assert manager is spec.get_manager()
    info = manager.config_info()[0]
    assert set(info) == set(SparsetierOffloadingSpec.config_info_keys({}))
    assert info["cpu_num_chunks"] == 12 and info["cpu_blocks_per_chunk"] == 1
    assert info == CPUOffloadingInfo.from_config(cfg, 12, spec.kv_bytes_per_chunk).as_config_info()
    metrics = SparsetierOffloadingSpec.build_metric_definitions({"store_threshold": 2})
    assert "vllm:kv_offload_cpu_cache_usage_perc" in metrics
    assert "vllm:kv_offload_stores_skipped" in metrics
    worker = spec.get_worker(kv_caches())
    assert isinstance(worker, SparsetierOffloadingWorker) and worker.io_backend == "cpu"
    assert spec.group_bytes_per_block == [LAYERS * MLA_PAGE, LAYERS * INDEXER_PAGE]
    worker.shutdown()
    one_group = kv_caches()
    one_group.group_data_refs = one_group.group_data_refs[:1]
    with pytest.raises(ConfigError, match="group_data_refs"):
        OffloadingSpecFactory.create_spec(cfg).get_worker(one_group)
    # Tensor parallel: the budget is shared by every rank's copy, as vLLM's CPU spec counts it.
    assert OffloadingSpecFactory.create_spec(config(world_size=2)).num_chunks == 6


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"cache_policy_module_path": "my.policy"}, "cache_policy_module_path"),
        ({"store_threshold": -1}, "store_threshold"),
        ({"store_threshold": 1.5}, "store_threshold"),
        ({"store_threshold": True}, "store_threshold"),
        ({"max_tracker_size": 0}, "max_tracker_size"),
        ({"io_backend": "dma"}, "io_backend"),
        ({"copy_threads": 0}, "copy_threads"),
        ({"io_backend": "cpu", "sm_limit": 4}, "sm_limit"),
        ({"io_backend": "direct", "sm_limit": 4}, "sm_limit"),
        ({"io_backend": "kernel", "copy_threads": 4}, "copy_threads"),
        ({"canonical_layout": True}, "canonical_layout"),
        ({"evction_policy": "lru"}, "evction_policy"),
    ],
)
def test_each_option_is_checked_naming_its_field(extra, field):
    with pytest.raises(ConfigError) as e:
        OffloadingSpecFactory.create_spec(config(extra))
    assert field in e.value.field


def test_a_budget_below_one_chunk_is_refused_at_the_worker():
    spec = OffloadingSpecFactory.create_spec(config({"cpu_bytes_to_use": 10}))
    assert spec.num_chunks == 0
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        spec.get_worker(kv_caches())


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"num_chunks": -1}, "num_chunks"), ({"num_chunks": 2.0}, "num_chunks"),
     ({"blocks_per_chunk": -1}, "blocks_per_chunk"), ({"copy_threads": 0}, "copy_threads"),
     ({"io_backend": "cpu", "sm_limit": "junk"}, "sm_limit"),
     ({"io_backend": "cpu", "sm_limit": 4}, "sm_limit")],
)  # fmt: skip
def test_the_workers_sizes_and_options_are_checked_before_any_allocation(kw, field):
    # (Before: torch's RuntimeError or TypeError from inside the allocation, and an sm_limit
    # the cpu engine never used accepted.)
    args = {"blocks_per_chunk": 1, "num_chunks": 4, **kw}
    with pytest.raises(ConfigError) as e:
        SparsetierOffloadingWorker(kv_caches(), args.pop("blocks_per_chunk"),
                                   args.pop("num_chunks"), **args)  # fmt: skip
    assert e.value.field == field


def test_a_size_past_2_to_the_53_is_read_exactly():
    # (Before: compared through float(), it was refused as "not an integer".)
    spec = OffloadingSpecFactory.create_spec(config({"cpu_bytes_to_use": 2**53 + 1}))
    assert spec.num_chunks > 0


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_an_infinite_size_is_a_config_error(value):
    for key in ("cpu_bytes_to_use", "store_threshold"):
        with pytest.raises(ConfigError) as e:
            OffloadingSpecFactory.create_spec(config({key: value}))
        assert e.value.field == key


def test_cuda_engines_are_refused_for_cpu_tensors():
    with pytest.raises(ConfigError, match="io_backend"):
        SparsetierOffloadingWorker(kv_caches(), 1, 4, io_backend="kernel")


class Connector:
    """The calls vLLM's OffloadingConnector makes, for one request, on the spec's halves."""

    def __init__(self, extra: dict | None = None) -> None:
        self.spec = OffloadingSpecFactory.create_spec(config(extra))
        self.manager = self.spec.get_manager()
        self.caches = kv_caches()
        self.worker = self.spec.get_worker(self.caches)
        self.jobs = 0

    def run(self, submit) -> object:
        self.jobs += 1
        assert submit(self.jobs)
        self.worker.wait({self.jobs})
        [result] = self.worker.get_finished()
        assert result.job_id == self.jobs
        return result

    def keys(self, blocks: list[int], group: int) -> list[bytes]:
        return [make_offload_key(f"hash-{b}".encode(), group) for b in blocks]

    def store(self, ctx, blocks: list[int]):
        """Offers `blocks` (their hashes) of both groups; stores what the manager takes."""
        keys = self.keys(blocks, 0) + self.keys(blocks, 1)
        out = self.manager.prepare_store(keys, ctx)
        n = len(out.keys_to_store) // 2
        gpu = GPULoadStoreSpec(blocks[:n] + blocks[:n], group_sizes=(n, n), block_indices=(0, 0))
        result = self.run(lambda job: self.worker.submit_store(job, gpu, out.store_spec))
        self.manager.complete_store(out.keys_to_store, ctx, success=result.success)
        return result

    def load(self, ctx, blocks: list[int], into: list[int]):
        keys = self.keys(blocks, 0) + self.keys(blocks, 1)
        assert all(self.manager.lookup(k, ctx) is LookupResult.HIT for k in keys)
        src = self.manager.prepare_load(keys, ctx)
        n = len(into)
        gpu = GPULoadStoreSpec(into + into, group_sizes=(n, n), block_indices=(0, 0))
        result = self.run(lambda job: self.worker.submit_load(job, src, gpu))
        self.manager.complete_load(keys, ctx)
        return result


def blocks_hold(caches: CanonicalKVCaches, where: list[int], stamps_of: list[int]) -> bool:
    for t, ct in enumerate(caches.tensors):
        for b, s in zip(where, stamps_of, strict=True):
            if not torch.equal(ct.tensor[b], stamp(t, s, ct.page_size_bytes)):
                return False
    return True


def test_a_request_round_trips_through_the_manager_and_the_worker():
    c = Connector()
    ctx = ReqContext(req_id="a")
    c.manager.on_new_request(ctx)
    result = c.store(ctx, [3, 9, 4])
    assert result.success
    assert result.transfer_size == 3 * LAYERS * (MLA_PAGE + INDEXER_PAGE)
    assert result.transfer_time > 0
    for t in c.caches.tensors:
        t.tensor.zero_()
    assert c.load(ctx, [3, 9, 4], [20, 21, 22]).success
    assert blocks_hold(c.caches, [20, 21, 22], [3, 9, 4])
    c.manager.on_request_finished(ctx)
    assert c.manager.core_counts()["pinned"] == 0
    c.manager.validate()
    c.worker.shutdown()


def test_a_worker_refuses_jobs_after_shutdown_and_a_non_bool_expedited():
    # (Before: a job submitted after shutdown() was accepted and ran.)
    c = Connector()
    ctx = ReqContext(req_id="a")
    c.manager.on_new_request(ctx)
    c.store(ctx, [3])
    src = c.manager.prepare_load(c.keys([3], 0) + c.keys([3], 1), ctx)
    gpu = GPULoadStoreSpec([5, 5], group_sizes=(1, 1), block_indices=(0, 0))
    with pytest.raises(ConfigError, match="expedited"):
        c.worker.submit_load(99, src, gpu, expedited="yes")
    c.worker.shutdown()
    with pytest.raises(ConfigError, match="shut down"):
        c.worker.submit_load(100, src, gpu)
    assert c.worker.pending_jobs == 0


def test_a_failed_store_and_a_failed_load_are_reported_and_leave_nothing_pinned():
    c = Connector()
    ctx = ReqContext(req_id="a")
    engine = c.worker.engines[0]
    testing.inject_copy_fault(engine, 0, fail="store failure injected by the test")
    result = c.store(ctx, [1, 2])
    assert not result.success
    counts = c.manager.core_counts()
    assert (counts["stored"], counts["storing"], counts["pinned"]) == (0, 0, 0)
    assert c.manager.lookup(c.keys([1], 0)[0], ctx) is LookupResult.MISS
    assert c.store(ctx, [1, 2]).success, "stored on the retry"
    testing.inject_copy_fault(
        engine, engine_submissions(engine), fail="load failure injected by the test"
    )
    result = c.load(ctx, [1, 2], [30, 31])
    assert not result.success
    counts = c.manager.core_counts()
    assert (counts["stored"], counts["pinned"]) == (4, 0)
    # The chunks are intact: a second load reads them.
    assert c.load(ctx, [1, 2], [30, 31]).success
    assert blocks_hold(c.caches, [30, 31], [1, 2])
    # The failed store's cleanup names keys the retry stored again: vLLM drops it too.
    events = list(c.manager.take_events())
    assert [(e.removed, len(e.keys)) for e in events] == [(False, 4)]
    c.manager.validate()
    c.worker.shutdown()


def engine_submissions(engine) -> int:
    """The number the engine's next submission gets (stores and regular loads share it)."""
    return engine.submitted
