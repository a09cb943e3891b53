"""The hierarchical prefix cache: exact round trips of every pool through host memory, and the
behaviours inference engines rely on."""

import numpy as np
import pytest
import torch

import sparsetier as st
from sparsetier import testing

PS = 4  # tokens per page


def stack(device_pages=32, host_ratio=2.0, swa=None, layout="layer_page_first", io="cpu"):
    pools = [
        st.PoolSpec("KV", 2, 2, 8, "bf16", PS, device_pages),
        st.PoolSpec("INDEXER", 2, 1, 16, "bf16", PS, device_pages),
        st.PoolSpec("DRAFT", 1, 1, 8, "fp32", PS, device_pages),
    ]
    if swa:
        pools.append(st.PoolSpec("SWA", 2, 1, 8, "bf16", PS, device_pages))
    return st.build_sparse_stack(
        pools,
        hicache_ratio=host_ratio,
        layout=layout,
        io_backend=io,
        swa_window=swa,
        device_reserve=1,
    )


def write_pages(s, pages, seed):
    """Fills `pages` of every device pool with random data; returns a copy per component."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.as_tensor(pages, dtype=torch.long)
    out = {}
    for comp, t in s.device_pools.items():
        data = torch.randn(t[:, :, idx].shape, generator=g).to(t.dtype)
        t[:, :, idx.to(t.device)] = data.to(t.device)
        out[comp] = data
    return out


def read_pages(s, pages):
    idx = torch.as_tensor(pages, dtype=torch.long)
    return {comp: t[:, :, idx.to(t.device)].cpu() for comp, t in s.device_pools.items()}


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(1, 30000, size=n)


GPU = torch.cuda.is_available() and st.cuda_status()[0]


@pytest.mark.parametrize("layout", ["layer_first", "layer_page_first"])
@pytest.mark.parametrize("io", ["cpu", "kernel", "direct"])
def test_round_trip_is_exact_for_every_pool(layout, io):
    if io != "cpu" and not GPU:
        pytest.skip(f"the {io} engine needs a CUDA GPU: {st.cuda_status()[1]}")
    s = stack(swa=2 * PS, layout=layout, io=io)
    c = s.hicache
    toks = tokens(10 * PS)
    pages = c.alloc_device(10)
    original = write_pages(s, pages, seed=1)
    r = c.insert(toks, pages)
    assert r["prefix_len"] == 0
    c.flush()  # one backup transfer for the step
    c.drain()
    assert c.stats()["host_in_tree"] == 10
    assert c.evict_device(10) == 10
    for t in s.device_pools.values():
        t.fill_(-3)  # poison: stale device data must never be read back
    m = c.match_prefix(toks)
    assert (m["device_len"], m["host_len"]) == (0, 10 * PS)
    lb = c.load_back(m["last_node"])
    assert lb["tokens"] == 10 * PS
    c.flush()
    c.wait(lb["transfer_id"], layer=0)
    c.drain()
    m = c.match_prefix(toks)
    assert (m["device_len"], m["host_len"]) == (10 * PS, 0)
    got = read_pages(s, m["device_pages"])
    for comp in ("KV", "INDEXER", "DRAFT"):
        assert torch.equal(got[comp], original[comp]), comp
    # SWA: exact within its window (the last 2 pages); outside it nothing was restored.
    assert torch.equal(got["SWA"][:, :, -2:], original["SWA"][:, :, -2:])
    assert (got["SWA"][:, :, :-2] == -3).all()
    c.validate()


def test_shared_prefix_is_stored_once():
    s = stack()
    c = s.hicache
    prompt = tokens(6 * PS, seed=5)
    for i in range(4):
        seq = np.concatenate([prompt, tokens(2 * PS, seed=10 + i)])
        m = c.match_prefix(seq)
        fresh = c.alloc_device(len(seq) // PS - m["device_len"] // PS)
        r = c.insert(seq, np.concatenate([m["device_pages"], fresh]))
        assert r["prefix_len"] == (0 if i == 0 else 6 * PS)
        assert len(r["duplicates"]) == 0
    assert c.stats()["device_in_tree"] == 6 + 4 * 2
    c.validate()


def test_duplicate_pages_are_freed_not_leaked():
    s = stack()
    c = s.hicache
    seq = tokens(4 * PS)
    c.insert(seq, c.alloc_device(4))
    free = c.stats()["device_free"]
    again = c.alloc_device(4)
    r = c.insert(seq, again)  # a second request computed the same pages
    assert sorted(r["duplicates"].tolist()) == sorted(again.tolist())
    assert c.stats()["device_free"] == free
    c.validate()


def test_partial_eviction_matches_device_then_host_in_order():
    s = stack()
    c = s.hicache
    a = tokens(4 * PS, seed=1)
    b = np.concatenate([a, tokens(4 * PS, seed=2)])
    ra = c.insert(a, c.alloc_device(4))
    c.insert(b, np.concatenate([c.path_device_pages(ra["last_node"]), c.alloc_device(4)]))
    c.flush()
    c.drain()
    assert c.evict_device(4) == 4  # the LRU leaf: b's own 4 pages
    m = c.match_prefix(b)
    assert (m["device_len"], m["host_len"]) == (4 * PS, 4 * PS)
    assert len(m["device_pages"]) == 4


def test_only_whole_pages_match():
    s = stack()
    c = s.hicache
    seq = tokens(3 * PS + 2)
    r = c.insert(seq, c.alloc_device(3))
    assert r["prefix_len"] == 0
    m = c.match_prefix(np.concatenate([seq[: 2 * PS + 3], [7, 7, 7]]))
    assert m["device_len"] == 2 * PS


def test_eviction_never_takes_a_locked_node():
    s = stack(device_pages=9)  # 8 usable
    c = s.hicache
    a, b = tokens(4 * PS, 1), tokens(4 * PS, 2)
    ra = c.insert(a, c.alloc_device(4))
    c.insert(b, c.alloc_device(4))
    c.flush()
    c.drain()
    c.lock(ra["last_node"])
    assert c.evict_device(8) == 4  # only b's pages can go
    assert c.match_prefix(a)["device_len"] == 4 * PS
    with pytest.raises(st.OutOfPagesError):
        c.alloc_device(5)
    c.unlock(ra["last_node"])
    with pytest.raises(st.NotLockedError):
        c.unlock(ra["last_node"])
    c.alloc_device(8)
    c.validate()


def test_load_back_is_all_or_nothing():
    s = stack(device_pages=9)
    c = s.hicache
    a, b = tokens(6 * PS, 1), tokens(4 * PS, 2)
    c.insert(a, c.alloc_device(6))
    c.flush()
    c.drain()
    c.evict_device(6)
    rb = c.insert(b, c.alloc_device(4))
    c.lock(rb["last_node"])  # b pins 4 of 8 usable pages: a's 6 cannot come back
    m = c.match_prefix(a)
    assert c.load_back(m["last_node"]) is None
    assert c.match_prefix(a)["device_len"] == 0
    assert c.stats()["totals"]["loads_refused"] == 1
    c.validate()


def test_load_back_racing_eviction_is_safe():
    s = stack()
    c = s.hicache
    seq = tokens(5 * PS)
    pages = c.alloc_device(5)
    original = write_pages(s, pages, seed=4)
    c.insert(seq, pages)
    c.flush()
    c.drain()
    c.evict_device(5)
    testing.inject_copy_fault(s.engine, 1, delay=0.05)  # submission 0 was the backup
    lb = c.load_back(c.match_prefix(seq)["last_node"])
    c.flush()
    assert c.evict_device(100) == 0  # pages being loaded are not evictable
    assert c.match_prefix(seq)["device_len"] == 0  # not readable until the load completes
    c.wait(lb["transfer_id"])
    c.poll()
    m = c.match_prefix(seq)
    assert m["device_len"] == 5 * PS
    assert torch.equal(read_pages(s, m["device_pages"])["KV"], original["KV"])
    c.validate()


def test_failed_load_frees_pages_after_the_copy_ends_and_never_publishes():
    s = stack()
    c = s.hicache
    seq = tokens(5 * PS)
    c.insert(seq, c.alloc_device(5))
    c.flush()
    c.drain()
    c.evict_device(5)
    free = c.stats()["device_free"]
    testing.inject_copy_fault(s.engine, 1, layer=1, fail="injected")
    lb = c.load_back(c.match_prefix(seq)["last_node"])
    c.flush()
    with pytest.raises(st.CopyFailedError):
        c.wait(lb["transfer_id"])
    c.poll()
    m = c.match_prefix(seq)
    assert (m["device_len"], m["host_len"]) == (0, 5 * PS)  # host copy kept, nothing mapped
    assert c.stats()["device_free"] == free
    assert c.stats()["totals"]["failed_transfers"] == 1
    c.validate()
    # a retry succeeds
    c.load_back(m["last_node"])
    c.flush()
    c.drain()
    assert c.match_prefix(seq)["device_len"] == 5 * PS


def test_failed_backup_is_not_a_hit_source():
    s = stack()
    c = s.hicache
    seq = tokens(3 * PS)
    testing.inject_copy_fault(s.engine, 0, fail="disk full")
    c.insert(seq, c.alloc_device(3))
    c.flush()
    c.drain()
    assert c.stats()["host_in_tree"] == 0
    assert c.evict_device(3) == 0  # no host copy: kept on the device
    c.validate()


def test_bad_input():
    c = stack().hicache
    with pytest.raises(st.OutOfRangeError):
        c.match_prefix([-1, 2, 3, 4])
    with pytest.raises(st.ConfigError):
        c.insert(tokens(2 * PS), c.alloc_device(3))
    with pytest.raises(st.UnknownNodeError):
        c.lock(123456789)
    with pytest.raises(st.ConfigError):
        c.insert(tokens(PS), [9999])
    with pytest.raises(st.ConfigError):
        st.HiCache(0, 10)
    dev_only = st.HiCache(PS, 10)
    with pytest.raises(st.ConfigError):
        dev_only.load_back(dev_only.match_prefix(tokens(PS))["last_node"])


def test_drop_namespace_frees_a_model_version():
    s = stack()
    c = s.hicache
    seq = tokens(4 * PS)
    c.insert(seq, c.alloc_device(4), namespace=1)  # model version 1
    r = c.insert(seq, c.alloc_device(4), namespace=2)  # version 2: the same tokens, other KV
    c.flush()
    c.drain()
    c.lock(r["last_node"])
    with pytest.raises(st.ConfigError):
        c.drop_namespace(2)  # locked: refused, nothing changes
    assert c.drop_namespace(1) == 8  # 4 device + 4 host pages
    assert c.match_prefix(seq, namespace=1)["device_len"] == 0
    assert c.match_prefix(seq, namespace=2)["device_len"] == 4 * PS
    c.unlock(r["last_node"])
    assert c.drop_namespace(2) == 8
    st_ = c.stats()
    assert (st_["device_in_tree"], st_["host_in_tree"]) == (0, 0)
    c.validate()
