"""The block mover under the vLLM worker: DeepSeek-V3.2-shaped block tensors (MLA and
indexer groups) to host pools and back, byte for byte, on each engine: ``cpu`` here, and
``kernel`` and ``direct`` on a GPU (``scripts/gpu-check.sh`` runs this file there).
"""

from __future__ import annotations

import pytest
import torch
from block_layout import dsv32_caches, expected_pairs, stamp

import sparsetier as sp
from sparsetier import testing
from sparsetier._core import BlockMover
from sparsetier.errors import ConfigError, OutOfRangeError

ENGINES = ["cpu", "kernel", "direct"]
LAYERS, BLOCKS, CHUNKS = 3, 24, 10


def make(engine: str, bpc: int):
    if engine != "cpu" and not torch.cuda.is_available():
        pytest.skip("the kernel and direct engines need a CUDA GPU (scripts/gpu-check.sh)")
    device = "cpu" if engine == "cpu" else "cuda"
    tensors, pages, groups = dsv32_caches(LAYERS, BLOCKS, device)
    pin = engine != "cpu"
    host = [torch.zeros((CHUNKS, p * bpc), dtype=torch.int8, pin_memory=pin) for p in pages]
    e = sp.TransferEngine(engine)
    mover = BlockMover(tensors, host, groups, bpc, CHUNKS, e, sp.TransferEngine(engine))
    return mover, tensors, pages, host, e


def finish(mover) -> list:
    mover.wait([1, 2, 3, 4, 5])
    return mover.finished()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bpc", [1, 3])
def test_a_store_then_a_load_round_trips_both_groups(engine, bpc):
    mover, tensors, pages, host, _ = make(engine, bpc)
    # Group 0 (MLA): 4 blocks starting one block into a chunk; group 1 (indexer): 2 blocks.
    mla_blocks, idx_blocks = [5, 17, 2, 9], [11, 0]
    start0, start1 = 1, 0
    n0 = -(-(len(mla_blocks) + start0 % bpc) // bpc)
    n1 = -(-(len(idx_blocks) + start1 % bpc) // bpc)
    chunks0, chunks1 = [7, 2, 4, 9][:n0], [3, 8][:n1]
    mover.submit(
        1,
        True,
        mla_blocks + idx_blocks,
        [len(mla_blocks), len(idx_blocks)],
        [start0, start1],
        chunks0 + chunks1,
    )
    [(job, ok, size, seconds, error)] = finish(mover)
    assert (job, ok, error) == (1, True, None)
    assert size == LAYERS * (len(mla_blocks) * pages[0] + len(idx_blocks) * pages[-1])
    assert seconds > 0
    plan = [(range(LAYERS), expected_pairs(mla_blocks, start0, chunks0, bpc))]
    plan.append((range(LAYERS, 2 * LAYERS), expected_pairs(idx_blocks, start1, chunks1, bpc)))
    for ts, pairs in plan:
        for t in ts:
            rows = host[t].view(-1, pages[t])
            for b, h in pairs:
                assert torch.equal(rows[h], stamp(t, b, pages[t])), (t, b, h)
    # Load them back into other blocks, on the expedited engine.
    for t in tensors:
        t.zero_()
    back0, back1 = [20, 21, 22, 23], [1, 2]
    mover.submit(2, False, back0 + back1, [4, 2], [start0, start1], chunks0 + chunks1, True)
    [(job, ok, *_)] = finish(mover)
    assert (job, ok) == (2, True)
    for ts, blocks, back in [
        (range(LAYERS), mla_blocks, back0),
        (range(LAYERS, 2 * LAYERS), idx_blocks, back1),
    ]:
        for t in ts:
            for orig, b in zip(blocks, back, strict=True):
                assert torch.equal(tensors[t][b].cpu(), stamp(t, orig, pages[t])), (t, b)
    assert mover.pending == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_copy_is_reported_failed(engine):
    mover, _, _, _, e = make(engine, 1)
    testing.inject_copy_fault(e, 0, fail="injected by the test")
    mover.submit(1, True, [1, 2], [1, 1], [0, 0], [0, 1])
    [(job, ok, _, _, error)] = finish(mover)
    assert (job, ok) == (1, False) and "injected" in error
    mover.submit(2, True, [1, 2], [1, 1], [0, 0], [0, 1])
    [(job, ok, *_)] = finish(mover)
    assert (job, ok) == (2, True), "the engine serves on"


def test_bad_jobs_are_refused_before_anything_moves():
    mover, *_ = make("cpu", 2)
    good = dict(block_ids=[1, 2], group_sizes=[1, 1], block_indices=[0, 0], chunk_ids=[0, 1])
    cases = [
        (dict(group_sizes=[2]), ConfigError, "group_sizes"),
        (dict(group_sizes=[2**62, 2**62]), ConfigError, "group_sizes"),  # past int64 in all
        (dict(block_ids=[1, BLOCKS]), OutOfRangeError, "block_ids"),
        (dict(chunk_ids=[0, CHUNKS]), OutOfRangeError, "block_ids"),
        (dict(chunk_ids=[0]), ConfigError, "cpu_spec.block_ids"),
        (dict(block_indices=[0, -1]), ConfigError, "block_indices"),
        (dict(block_ids=[[1], [2]]), ConfigError, "block_ids"),
    ]
    for change, error, field in cases:
        args = {**good, **change}
        with pytest.raises(error, match=field):
            mover.submit(
                9,
                True,
                args["block_ids"],
                args["group_sizes"],
                args["block_indices"],
                args["chunk_ids"],
            )
    assert mover.pending == 0
    mover.submit(9, True, **good)
    with pytest.raises(ConfigError, match="job_id"):
        mover.submit(9, True, **good)
    mover.shutdown()


def test_pools_of_the_wrong_shape_or_memory_are_refused():
    tensors, pages, groups = dsv32_caches(1, 4)
    e = sp.TransferEngine("cpu")
    short = [torch.zeros((3, p), dtype=torch.int8) for p in pages]
    with pytest.raises(ConfigError, match="host_tensors"):
        BlockMover(tensors, short, groups, 1, 4, e)
    floats = [t.float() for t in tensors]
    with pytest.raises(ConfigError, match="dtype"):
        BlockMover(floats, short, groups, 1, 3, e)
    with pytest.raises(ConfigError, match="tensor_idx"):
        BlockMover(tensors, short, [[(5, 8)]], 1, 3, e)
    with pytest.raises(ConfigError, match="page_size_bytes"):
        BlockMover(tensors, short, [[(0, pages[0] + 1)]], 1, 3, e)
