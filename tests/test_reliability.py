"""Reliability: faults at every layer of the stack, cancellation in each phase, threads
against one stack, and a bounded fuzz pass over the entry points."""

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import sparsetier as st
from sparsetier import lowlevel, testing
from sparsetier.lowlevel import object_keys

FUZZ = Path(__file__).parent / "fuzz" / "fuzz_entry_points.py"


def test_bounded_fuzz_pass_raises_only_typed_errors(tmp_path):
    # Through `sh`, which forks it: libFuzzer's out-of-memory check reads the peak RSS
    # (`ru_maxrss`), and a process exec'd straight from this one starts with this process's
    # peak (Linux keeps it across fork and exec), which the test session may have taken past
    # libFuzzer's 2 GB limit by itself. sh's child starts from sh's size instead.
    # A failing input is written under tmp_path (reported below), not into the checkout.
    fuzz = [sys.executable, str(FUZZ), "-runs=100000", "-max_len=512", "-seed=7",
            f"-artifact_prefix={tmp_path}/"]  # fmt: skip
    r = subprocess.run(
        ["sh", "-c", '"$0" "$@"', *fuzz],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Done 100000 runs" in r.stderr


def host_only(d, ns, pages):
    for p in pages:
        k = object_keys(ns, [p])
        d.allocate(k)
        d.backup_complete(d.backup(k).transfer_id)
        d.evict(1)


def test_abort_in_each_phase_releases_exactly_once_and_spares_sharers():
    d = lowlevel.ResidencyDirectory(8, 16, object_bytes=64)
    host_only(d, 0, [0, 1, 2, 3])  # a shared prefix: namespace 0
    # before submit: resolved, loads planned but never submitted -> cancel the load
    a = d.resolve(object_keys(0, [0, 1]))
    b = d.resolve(object_keys(0, [1]))  # a sharer joins the in-flight load of page 1
    assert b.joined == [a.loads[0].transfer_id]
    d.fail(a.loads[0].transfer_id, "aborted", ended=True)  # nothing was submitted: ended
    d.release(a.handle)
    with pytest.raises(st.TransferFailedError):  # the sharer's waiter gets a typed error
        d.wait(b.joined[0])
    d.release(b.handle)
    # with loads in flight: the abort cancels, the copy may still write -> quarantine
    c = d.resolve(object_keys(0, [2]))
    t = c.loads[0].transfer_id
    d.fail(t, "aborted", ended=False)
    assert d.stats()["device_quarantined"] == 1
    d.release(c.handle)
    d.transfer_ended(t)  # the engine reports the copy ended: the slot returns, once
    with pytest.raises((st.TransferStateError, st.UnknownTransferError)):
        d.transfer_ended(t)
    # after Ready, pins held: releasing the handle is the whole abort
    e = d.resolve(object_keys(0, [3]))
    d.complete(e.loads[0].transfer_id)
    d.release(e.handle)
    with pytest.raises(st.UnknownHandleError):
        d.release(e.handle)
    # a retry succeeds
    r = d.resolve(object_keys(0, [0, 1, 2, 3]))
    for lp in r.loads:
        d.complete(lp.transfer_id)
    d.release(r.handle)
    d.validate()
    s = d.stats()
    assert (s["pins"], s["handles"], s["device_quarantined"]) == (0, 0, 0)
    assert s["totals"]["failed_transfers"] == 2


def test_abort_while_waiting_on_a_layer_event():
    spec = st.PoolSpec("KV", 4, 1, 8, "bf16", 4, 8)
    import torch

    host = torch.ones(spec.shape("layer_page_first"), dtype=torch.bfloat16)
    dev = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    e = st.TransferEngine("cpu", threads=1)
    testing.inject_copy_fault(e, 0, layer=2, delay=0.05)
    t = lowlevel.PreparedPageTransfer(
        st.PageTransferBinding(host, spec, "layer_page_first"),
        st.PageTransferBinding(dev, spec),
        [1],
        [2],
    )
    h = e.submit(lowlevel.PageTransferGroup([t]))
    with pytest.raises(st.WaitTimeoutError):
        h.wait(layer=2, timeout=0.001)  # the waiter gives up (aborts) ...
    h.wait(layer=1)  # ... earlier layers were published
    h.wait()  # the transfer still ends; its buffers were kept alive meanwhile
    assert h.finished and e.in_flight == 0


def test_allocation_failure_is_typed_and_changes_nothing():
    c = st.HiCache(4, 5, drop_unbacked=True)
    r = c.insert(np.arange(1, 17), c.alloc_device(4))
    c.lock(r["last_node"])
    before = c.stats()
    with pytest.raises(st.OutOfPagesError):
        c.alloc_device(2)  # only one page is free and nothing is evictable
    assert c.stats()["device_free"] == before["device_free"]
    c.unlock(r["last_node"])
    c.alloc_device(2)  # a retry succeeds once the lock is gone
    c.validate()


def test_threads_against_one_cache_and_one_directory():
    c = st.HiCache(4, 64, drop_unbacked=True)
    d = lowlevel.ResidencyDirectory(24, 128, object_bytes=64)
    host_only(d, 0, range(32))
    lock = threading.Lock()  # HiCache is one object behind a mutex; calls interleave freely
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                seq = np.concatenate(
                    [np.arange(1, 9), rng.integers(1, 4, size=rng.integers(0, 12))]
                )
                seq = seq[: len(seq) // 4 * 4].astype(np.uint32)
                try:
                    m = c.match_prefix(seq, lock=True, alloc=True)
                    r = c.insert(seq, np.concatenate([m["device_pages"], m["new_pages"]]),
                                 lock=True, unlock=m["device_node"])  # fmt: skip
                    c.unlock(r["last_node"])
                except st.OutOfPagesError:
                    pass
                try:
                    res = d.resolve(object_keys(0, rng.integers(0, 32, size=3)))
                except st.OutOfPagesError:
                    continue
                for lp in res.loads:
                    if rng.random() < 0.2:
                        d.fail(lp.transfer_id, "stress", ended=True)
                    else:
                        d.complete(lp.transfer_id)
                if rng.random() < 0.1:
                    d.evict(2)
                d.release(res.handle)
        except Exception as e:
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    c.validate()
    d.validate()
    assert d.stats()["pins"] == 0
    assert c.stats()["device_outstanding"] == 0


def test_injected_allocation_failure_recomputes_and_retry_succeeds():
    s = st.build_sparse_stack(
        [st.PoolSpec("KV", 2, 1, 8, "bf16", 4, 17), st.PoolSpec("INDEXER", 2, 1, 8, "bf16", 4, 17)],
        hicache_ratio=2.0,
    )
    c = s.hicache
    seq = np.arange(1, 25, dtype=np.uint32)
    c.insert(seq, c.alloc_device(6))
    c.flush()
    c.drain()
    c.evict_device(6)
    m = c.match_prefix(seq)
    testing.inject_alloc_failures(c, 1)
    assert c.load_back(m["last_node"]) is None  # nothing half-restored: recompute
    assert c.match_prefix(seq)["device_len"] == 0
    c.validate()
    testing.inject_alloc_failures(c, 1)
    with pytest.raises(st.OutOfPagesError):
        c.alloc_device(1)
    lb = c.load_back(m["last_node"])  # the retry succeeds
    c.flush()
    c.wait(lb["transfer_id"])
    c.poll()
    assert c.match_prefix(seq)["device_len"] == 24
    c.validate()


def _cache():
    return st.HiCache(4, 16, drop_unbacked=True)


def _dir():
    return lowlevel.ResidencyDirectory(4, 4, object_bytes=8)


def _runtime(**kw):
    from sparsetier.tools.model import TinySparseModel
    from sparsetier.tools.runtime import DecodeRuntime

    return DecodeRuntime(TinySparseModel(), device_slots=64, host_pages=64, indexer_pages=64, **kw)


BAD_INPUT = [
    # (entry point, call, expected error, field or None)
    ("HiCache.match_prefix 2-D tokens", lambda: _cache().match_prefix(np.zeros((2, 4))), st.ConfigError, "tokens"),
    ("HiCache.match_prefix namespace", lambda: _cache().match_prefix([1, 2, 3, 4], namespace=-1), st.OutOfRangeError, "namespace"),
    ("HiCache.insert negative page", lambda: _cache().insert([1, 2, 3, 4], [-1]), st.OutOfRangeError, "device_pages"),
    ("HiCache.insert page not allocated", lambda: _cache().insert([1, 2, 3, 4], [3]), st.ConfigError, "device_pages"),
    ("HiCache.alloc_device negative", lambda: _cache().alloc_device(-2), st.ConfigError, "n"),
    ("HiCache.alloc_device huge", lambda: _cache().alloc_device(1 << 40), st.OutOfPagesError, None),
    ("PageAllocator pages huge", lambda: lowlevel.PageAllocator(1 << 31), st.ConfigError, "pages"),
    ("ResidencyDirectory pages huge", lambda: lowlevel.ResidencyDirectory(1 << 31, 4, object_bytes=8), st.ConfigError, "device_pages"),
    ("HiCache pages huge", lambda: st.HiCache(4, 1 << 31), st.ConfigError, "pages"),
    ("PageAllocator.alloc huge", lambda: lowlevel.PageAllocator(8).alloc(1 << 40), st.OutOfPagesError, None),
    ("HiCache.lock stale", lambda: _cache().lock(1 << 40), st.UnknownNodeError, "node"),
    ("HiCache.lock negative", lambda: _cache().lock(-1), st.UnknownNodeError, "node"),
    ("HiCache.free_device foreign", lambda: _cache().free_device([1]), st.ConfigError, "pages"),
    ("HiCache.wait timeout", lambda: _cache().wait(1, timeout=-1.0), st.ConfigError, "timeout"),
    ("HiCache.wait layer", lambda: _cache().wait(1, layer=-1), st.OutOfRangeError, "layer"),
    ("HiCache.wait transfer id", lambda: _cache().wait(-1), st.OutOfRangeError, "transfer_id"),
    ("ResidencyDirectory.state key", lambda: _dir().state((1, 2)), st.ConfigError, "key"),
    ("ResidencyDirectory.drop_namespace", lambda: _dir().drop_namespace(-5), st.OutOfRangeError, "namespace"),
    ("ResidencyDirectory.fail unknown", lambda: _dir().fail(99, "x"), st.UnknownTransferError, "transfer_id"),
    ("ResidencyDirectory.transfer_ended unknown", lambda: _dir().transfer_ended(99), st.UnknownTransferError, "transfer_id"),
    ("token_pages negative", lambda: lowlevel.token_pages([-1], 16, 2), st.OutOfRangeError, "positions"),
    ("token_pages zero bytes", lambda: lowlevel.token_pages([1], 16, 0), st.ConfigError, "token_bytes"),
    ("PoolSpec.check_tensor layout", lambda: st.PoolSpec("KV", 1, 1, 8).check_tensor(None, "rows"), st.ConfigError, "layout"),
    ("PoolSpec.shape layout", lambda: st.PoolSpec("KV", 1, 1, 8).shape("rows"), st.ConfigError, "layout"),
    ("PoolSpec.with_pages zero", lambda: st.PoolSpec("KV", 1, 1, 8).with_pages(0), st.ConfigError, "pages"),
    ("plan_stack pools not a list", lambda: st.plan_stack(5), st.ConfigError, "pools"),
    ("plan_stack pool not a spec", lambda: st.plan_stack(["KV"]), st.ConfigError, "pools[0]"),
    ("compile_cuda_kernels arch", lambda: lowlevel.compile_cuda_kernels(90), st.ConfigError, "arch"),
    ("TransferEngine device", lambda: st.TransferEngine("kernel", device=-1), st.ConfigError, "device"),
    ("DecodeRuntime kv_format", lambda: _runtime(kv_format="int4"), st.ConfigError, "kv_format"),
    ("PoolSpec row_parts sum", lambda: st.PoolSpec("INDEXER", 1, 1, 132, "fp8", row_parts=[("values", "fp8", 128)]), st.ConfigError, "row_parts"),
    ("PoolSpec row_parts name", lambda: st.PoolSpec("INDEXER", 1, 1, 4, "fp8", row_parts=[("latent", "fp8", 4)]), st.ConfigError, "row_parts[0].name"),
    ("PoolSpec page_layout", lambda: st.PoolSpec("INDEXER", 1, 1, 4, "fp8", page_layout="scales_first"), st.ConfigError, "page_layout"),
    ("PoolSpec part_offset part", lambda: st.PoolSpec("KV", 1, 1, 8).part_offset("layer_first", 0, 0, 0, 0, 1), st.OutOfRangeError, "part"),
    ("TransferEngine lanes not a power of two", lambda: st.TransferEngine("kernel", lanes=48), st.ConfigError, "lanes"),
    ("TransferEngine lanes too many", lambda: st.TransferEngine("kernel", lanes=1024), st.ConfigError, "lanes"),
    ("TransferEngine lanes negative", lambda: st.TransferEngine("kernel", lanes=-4), st.ConfigError, "lanes"),
    ("object keys wrong width", lambda: _dir().resolve([[1, 2, 3]]), st.ConfigError, "keys.shape"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "exc", "field"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_raises_a_typed_error_naming_the_field(name, call, exc, field):
    with pytest.raises(exc) as e:
        call()
    assert isinstance(e.value, st.SparsetierError)
    if field is not None:
        assert e.value.field == field


def test_a_panic_inside_a_binding_is_an_internal_error():
    # A bug (a panic) in a binding that keeps no state reaches Python as InternalError, a
    # SparsetierError that `except Exception` catches, naming where the call entered the
    # core; pyo3's own PanicException derives from BaseException and would not be caught.
    with pytest.raises(st.InternalError) as e:
        testing.contained_panic("broken invariant")
    assert isinstance(e.value, st.SparsetierError) and isinstance(e.value, Exception)
    assert e.value.detail == "broken invariant"
    assert "src/py/error.rs" in e.value.site
    assert "a bug in sparsetier" in str(e.value)
    # Nothing is left behind: the next call panics and is contained the same way.
    with pytest.raises(st.InternalError):
        testing.contained_panic("again")
