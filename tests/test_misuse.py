"""Misuse (issue 40): calls an engine author or an unlucky caller makes end in the right
result or a typed error raised before any change, never a hang, a deadlock or a misread.

Each test names the class of defect it covers.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from array import array

import numpy as np
import pytest
import torch
from scheduler_support import pooled_hicache, small_joined, small_scheduler

import sparsetier as st
from sparsetier import lowlevel, testing
from sparsetier.errors import ConfigError, SparsetierError

# How long a probe waits for another thread before it calls the wait a hang (not a timing
# check: a working build answers at once; a deadlocked one never does).
HANG = 20.0


class BlockingTokens:
    """Tokens whose conversion runs Python code that blocks until released: numpy calls
    `__array__`, as it does for any object with one."""

    def __init__(self, tokens) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_in_time = None

    def __array__(self, dtype=None, copy=None):
        self.entered.set()
        self.released_in_time = self.release.wait(HANG)
        return self.tokens if dtype is None else self.tokens.astype(dtype)


def converting_in_another_thread(call, tokens: BlockingTokens) -> threading.Thread:
    t = threading.Thread(target=call, daemon=True)
    t.start()
    assert tokens.entered.wait(HANG), "the conversion never started"
    return t


# ---- class 1: no core lock is waited on with the GIL held, no Python code runs under one ----


@pytest.mark.parametrize("call", ["match_prefix", "insert"])
def test_another_thread_is_served_while_tokens_convert(call):
    c = st.HiCache(1, 64)
    tokens = BlockingTokens(np.arange(1, 9))
    calls = {
        "match_prefix": lambda: c.match_prefix(tokens),
        "insert": lambda: c.insert(tokens, c.alloc_device(8)),
    }
    t = converting_in_another_thread(calls[call], tokens)
    # With the conversion under the cache's lock, these waited for it (and it for them).
    c.stats()
    c.match_prefix(np.arange(1, 4))
    c.validate()
    tokens.release.set()
    t.join(HANG)
    assert not t.is_alive()
    assert tokens.released_in_time, "the other thread was blocked until the conversion ended"
    c.validate()


def _returns_in_time(call) -> None:
    """Runs `call`; a deadlock (Python code run under a core lock that calls back in, the GIL
    held: every thread stops) ends the process with the stacks after HANG seconds."""
    import faulthandler

    faulthandler.dump_traceback_later(HANG, exit=True)
    try:
        call()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _pages_group(spec, src, dst, src_pages, dst_pages):
    """A group copying `src_pages` of `src` to `dst_pages` of `dst` (tensors or bindings)."""

    def bind(t):
        return t if isinstance(t, st.PageTransferBinding) else st.PageTransferBinding(t, spec)

    transfer = lowlevel.PreparedPageTransfer(bind(src), bind(dst), src_pages, dst_pages)
    return lowlevel.PageTransferGroup([transfer])


def test_a_callback_run_as_a_finished_copy_lets_go_of_its_memory_may_call_the_engine():
    # The engine lets go of a finished submission's memory under no lock: the last reference
    # can run Python code (a weakref callback here) that calls the engine again.
    spec = st.PoolSpec("KV", 1, 2, 8, "bf16", 4, 4)
    eng = st.TransferEngine("cpu")
    src = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    dst = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    seen: list = []
    ref = weakref.ref(dst.untyped_storage(), lambda _: seen.append(eng.in_flight))
    group = _pages_group(spec, src, dst, [0], [1])
    handle = eng.submit(group)
    del group, dst
    gc.collect()
    _returns_in_time(handle.wait)
    assert ref() is None and seen == [0]


def test_a_callback_run_as_a_plans_table_is_let_go_may_call_the_scheduler():
    s = small_scheduler(4, 32, 64, 2, {7: 8})
    plan, table = s.plan(0, np.array([7]), np.array([[0]]), 4)
    s.ready(plan)
    planned: list = []

    def plan_again(_):
        p, _t = s.plan(1, np.array([7]), np.array([[0]]), 4)
        planned.append(p)

    ref = weakref.ref(table, plan_again)
    del table
    _returns_in_time(lambda: s.finish(plan))
    assert ref() is None and len(planned) == 1
    s.ready(planned[0])
    s.finish(planned[0])
    s.validate()


def test_a_bound_tensor_pointed_elsewhere_leaves_its_copies_memory_alive():
    # The bindings hold the tensor's storage, not only the tensor: `set_` (or dropping the
    # tensor) leaves the memory the copies use alive; a storage resized under a binding is
    # refused before a copy is submitted.
    spec = st.PoolSpec("KV", 1, 8, 128, "bf16", 64, 16)
    eng = st.TransferEngine("cpu")
    src = torch.ones(spec.shape(), dtype=torch.bfloat16)
    dst = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    bound = st.PageTransferBinding(dst, spec)
    view = dst.untyped_storage()
    dst.set_(torch.empty(0, dtype=torch.bfloat16))
    del view
    eng.submit(
        _pages_group(spec, src, bound, [0, 3], [1, 2])
    ).wait()  # (into freed memory, before: a crash)
    other = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    resized = st.PageTransferBinding(other, spec)
    other.untyped_storage().resize_(0)
    with pytest.raises(ConfigError) as e:
        eng.submit(_pages_group(spec, src, resized, [0], [1]))
    assert e.value.field == "group" and "resized" in str(e.value)
    assert eng.in_flight == 0


_FREED_POOL = """
import gc, numpy as np, torch, sparsetier as st
spec = st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 1 << 20)  # 64 MiB or more: mmap'd, unmapped when freed
dev, host = torch.zeros(spec.shape(), dtype=torch.bfloat16), torch.zeros(spec.shape(),
                                                                          dtype=torch.bfloat16)
s = st.StepScheduler(st.PageTransferBinding(dev, spec), st.PageTransferBinding(host, spec),
                     st.TransferEngine("cpu"), layers=2, prefetch=False)
s.add_request(0, 11)
{which}.untyped_storage().resize_(0)
for call in (s.end_step, s.drain, lambda: s.plan(0, np.array([0]), np.array([[0]]), 4)):
    try:
        call()
        raise SystemExit("accepted")
    except st.ConfigError as e:
        assert e.field == "{field}" and "resized" in str(e), e
del s  # its drop must not drain into the freed pool
gc.collect()
print("refused")
"""


@pytest.mark.parametrize(("which", "field"), [("dev", "device"), ("host", "host")])
def test_a_pool_freed_under_a_scheduler_is_refused_before_any_copy(which, field):
    # (Before: the write-through read the unmapped pages, a segfault; and again in the drain
    # of the scheduler's drop. A subprocess, so that a crash fails only this test.)
    import subprocess

    code = _FREED_POOL.format(which=which, field=field)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "refused", (r.returncode, r.stderr[-2000:])


def test_a_pool_freed_under_a_hicache_is_refused_at_flush():
    c, _e, _dev, host = pooled_hicache(4)
    c.insert(np.arange(8), c.alloc_device(2))  # queues the two pages' backups
    host.tensor.untyped_storage().resize_(0)
    with pytest.raises(ConfigError) as e:
        c.flush()
    assert e.value.field == "pools[0][1]" and "resized" in str(e.value)


def test_one_buffer_bound_as_two_pools_is_refused_at_construction():
    # (Before: accepted, and each pool's copies read and wrote the other's pages.)
    kv = st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 8)
    shared = st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv)
    dev = [st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv)
           for _ in range(2)]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        st.HiCache(4, 8, host_pages=8, engine=st.TransferEngine("cpu"),
                   pools=[(dev[0], shared, None), (dev[1], shared, None)])  # fmt: skip
    assert e.value.field == "pools[1][1]" and "overlapping pools[0][1]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        st.StepScheduler(dev[0], dev[0], st.TransferEngine("cpu"), layers=1)
    assert e.value.field == "host"
    # Two views of one tensor that overlap, as the joined scheduler's KV and Indexer-K hosts.
    layers = 2
    kvh = st.PoolSpec("KV", layers, 1, 8, "bf16", 4, 8)
    ik = st.PoolSpec("INDEXER", layers, 1, 8, "bf16", 4, 8, planes_per_layer=2)
    host = torch.zeros(kvh.shape(), dtype=torch.bfloat16)
    with pytest.raises(ConfigError) as e:
        st.StepScheduler.joined(
            dev[0], st.PageTransferBinding(host, kvh), st.TransferEngine("cpu"),
            indexer_device=st.PageTransferBinding(torch.zeros(ik.shape(), dtype=torch.bfloat16),
                                                  ik),
            indexer_host=st.PageTransferBinding(host.view(ik.shape()), ik),
        )  # fmt: skip
    assert e.value.field == "indexer_host"


def test_a_host_pool_of_other_rows_than_its_device_pool_is_refused_at_construction():
    # (Before: accepted; every write-through failed, counted as a failed backup, until the
    # device filled with pages it could not evict.)
    e = st.TransferEngine("cpu")

    def bind(spec):
        return st.PageTransferBinding(torch.zeros(spec.shape(), dtype=torch.bfloat16), spec)

    dev = bind(st.PoolSpec("KV", 1, 1, 16, "bf16", 4, 8))
    with pytest.raises(ConfigError) as err:
        st.StepScheduler(dev, bind(st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 8)), e, layers=2)
    assert err.value.field == "host" and "16-byte rows" in str(err.value), err.value
    ik = st.PoolSpec("INDEXER", 2, 1, 8, "bf16", 4, 8)
    with pytest.raises(ConfigError) as err:
        st.StepScheduler.joined(
            dev, bind(st.PoolSpec("KV", 2, 1, 16, "bf16", 4, 8)), e, indexer_device=bind(ik),
            indexer_host=bind(st.PoolSpec("INDEXER", 2, 1, 8, "bf16", 4, 8, planes_per_layer=2)),
        )  # fmt: skip
    assert err.value.field == "indexer_host" and "1 planes a layer" in str(err.value)
    other = bind(st.PoolSpec("KV", 1, 1, 16, "bf16", 8, 4))
    with pytest.raises(ConfigError) as err:
        st.HiCache(4, 8, host_pages=8, engine=e, pools=[(dev, other, None)])
    assert err.value.field == "pools[0][1]" and "pages of 4 tokens" in str(err.value)


def test_a_request_id_or_prompt_namespace_is_used_again_after_it_ended():
    # (Before: the plain scheduler refused it, NamespaceDroppedError: the directory refuses
    # a dropped namespace's keys while it remembers it, and every id kept version 0.)
    s = small_scheduler(4, 32, 64, 2, {0: 11, 1: 5})
    for _ in range(3):
        s.finish_request(0)
        s.end_step()
        s.drain()
        s.add_request(0, 11)
        plan, table = s.plan(0, np.array([0, 1]), np.array([[0, 2], [0, 1]]), 4)
        s.ready(plan)
        assert (table >= 0).all()
        s.finish(plan)
        s.end_step()
        s.validate()
    for _ in range(2):
        s.add_prompt(7, 2)
        s.end_step()
        s.drain()
        s.add_request(9, 12, prefix=(7, 2))
        plan, table = s.plan(0, np.array([9]), np.array([[0, 1, 2]]), 4)  # the prompt's too
        assert not s.ready(plan)[0] and (table >= 0).all()
        s.finish(plan)
        s.finish_request(9)
        s.drop_prompt(7)
        s.end_step()
        s.validate()
    s.drain()
    assert s.stats()["requests"] == 2


def _prompt_scheduler():
    """A plain scheduler with request 9 over prompt 7's two pages, every page then evicted
    from the device, and its engine."""
    e = st.TransferEngine("cpu")
    spec = st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 32)
    host = spec.with_pages(64)
    s = st.StepScheduler(
        st.PageTransferBinding(torch.zeros(spec.shape(), dtype=torch.bfloat16), spec),
        st.PageTransferBinding(torch.zeros(host.shape(), dtype=torch.bfloat16), host),
        e, layers=1, prefetch=False,
    )  # fmt: skip
    s.add_prompt(7, 2)
    s.end_step()
    s.drain()
    s.add_request(9, 12, prefix=(7, 2))
    s.end_step()
    s.drain()
    testing.evict_device(s, 32)
    return s, e


def test_a_plan_of_an_ended_request_does_not_fail_the_new_one_under_its_id():
    # The plan's loads of the prompt's pages fail twice, after request 9 ended and started
    # again. Before, `ready` named the new request 9 as failed (its caller would end it).
    s, e = _prompt_scheduler()
    testing.inject_copy_fault(e, e.submitted, fail="first")
    testing.inject_copy_fault(e, e.submitted + 1, fail="retry")
    plan, _ = s.plan(0, np.array([9]), np.array([[0, 1, 2]]), 4)
    s.finish_request(9)
    s.add_request(9, 12, prefix=(7, 2))
    failed, table = s.ready(plan)
    assert failed == [] and (table == -1).all()
    s.finish(plan)
    s.end_step()
    s.drain()
    # The new request is served.
    plan, table = s.plan(0, np.array([9]), np.array([[0, 1, 2]]), 4)
    assert not s.ready(plan)[0] and (table >= 0).all()
    s.finish(plan)
    s.end_step()
    s.validate()


def test_a_step_with_a_plan_still_open_is_not_ended():
    # Before, end_step took it: the plan's pins went on into the next step, and the record
    # counted no layer.
    s, _ = _prompt_scheduler()
    plan, _ = s.plan(0, np.array([9]), np.array([[0, 1, 2]]), 4)
    s.ready(plan)
    with pytest.raises(ConfigError, match="plans") as e:
        s.end_step()
    assert e.value.field == "plans"
    s.finish(plan)
    assert s.end_step()["layers"] == 1
    s.validate()


@pytest.mark.parametrize("remember", [-1, 2**70, 1.5])
def test_a_bad_storage_remember_count_is_a_config_error(remember):
    for owner in (st.HiCache(4, 64, host_pages=8), small_joined()):
        with pytest.raises(ConfigError) as e:
            owner.enable_storage(remember=remember)
        assert e.value.field == "remember"


def test_a_cuda_stream_given_to_a_cpu_engine_is_refused_whatever_its_copies_state():
    s = small_scheduler(4, 32, 64, 2, {7: 8})
    plan, _ = s.plan(0, np.array([7]), np.array([[0]]), 4)
    for stream in (0xDEADBEEF, -1, 2**64, True, "0"):
        with pytest.raises(ConfigError) as e:
            s.ready(plan, stream)
        assert e.value.field == "stream", e.value
    s.ready(plan)
    s.finish(plan)
    j = small_joined()
    j.admit(1, np.arange(8))
    with pytest.raises(ConfigError) as e:
        j.wait_prefix(1, 0, 0x1234)
    assert e.value.field == "stream"
    j.wait_prefix(1, 0)
    s.validate()
    j.validate()


# ---- class 4: any float duration is valid up to forever, or refused; never a panic ----


@pytest.mark.parametrize("timeout", [sys.maxsize, 1e20, float("inf")])
def test_a_long_timeout_means_no_limit(timeout):
    c = st.HiCache(1, 8)
    with pytest.raises(st.UnknownTransferError):
        c.wait(0, timeout=timeout)  # read, then looked up: never issued here
    c.validate()
    d = lowlevel.ResidencyDirectory(device_pages=4, host_pages=4, object_bytes=64)
    with pytest.raises(st.UnknownTransferError):
        d.wait(0, timeout=timeout)
    d.validate()


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("-inf")])
def test_a_bad_timeout_is_a_config_error(timeout):
    with pytest.raises(ConfigError, match="timeout"):
        st.HiCache(1, 8).wait(0, timeout=timeout)
    with pytest.raises(ConfigError, match="timeout"):
        lowlevel.ResidencyDirectory(device_pages=4, host_pages=4, object_bytes=64).wait(
            0, timeout=timeout
        )


@pytest.mark.parametrize("delay", [1e20, float("inf"), float("nan"), -1.0])
def test_an_impossible_fault_delay_is_refused_and_poisons_nothing(delay):
    s = small_scheduler(4, 16, 64, 2, {1: 8})
    with pytest.raises(ConfigError, match="delay"):
        testing.inject_faults(s, "load", 1, delay=delay)
    e = st.TransferEngine("cpu")
    with pytest.raises(ConfigError):
        testing.inject_copy_fault(e, 0, delay=delay)
    s.validate()
    s.stats()  # still usable


def test_errors_are_sparsetier_errors():
    assert issubclass(ConfigError, SparsetierError)


# ---- classes 5, 7, 11: every array argument is read by value (any strides, order, byte
# order) or refused; never read in memory order, byte-swapped, or truncated ----


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_a_fortran_ordered_selection_plans_the_rows_it_holds(dtype):
    tables = []
    for order in ("C", "F"):
        s = small_scheduler(4, 16, 64, 1, {1: 12, 2: 12})
        sel = np.array([[0, 2], [1, 2]], dtype=dtype, order=order)
        counts = np.array([[4, 4], [4, 4]], dtype=np.int32, order=order)
        _, table = s.plan(0, [1, 2], sel, 4, counts)
        tables.append(table.tolist())
        s.validate()
    assert tables[0] == tables[1]
    # The transpose (torch.topk(...).indices.T.numpy() is one) is read as its rows.
    s = small_scheduler(4, 16, 64, 1, {1: 12, 2: 12})
    _, table = s.plan(0, [1, 2], np.array([[0, 1], [2, 2]], dtype=dtype).T, 4)
    assert table.tolist() == tables[0]


@pytest.mark.parametrize("dtype", [">u4", ">i8", "<i8", ">i4", "<u2"])
def test_tokens_in_any_byte_order_are_read_by_value(dtype):
    c = st.HiCache(1, 64)
    m = c.match_prefix(np.arange(1, 9), alloc=True)
    c.insert(np.arange(1, 9), m)
    assert c.match_prefix(np.arange(1, 9, dtype=dtype)).device_len == 8
    c2 = st.HiCache(1, 64)
    m = c2.match_prefix(np.arange(1, 9, dtype=dtype), alloc=True)
    c2.insert(np.arange(1, 9, dtype=dtype), m)
    assert c2.match_prefix(np.arange(1, 9)).device_len == 8
    c.validate()
    c2.validate()


@pytest.mark.parametrize(
    "tokens",
    [[1.7, 2.0], np.array([1.5, 2.5]), [True, False], np.array([True]), ["1", "2"], [1, "a"]],
)
def test_tokens_that_are_not_integers_are_refused_before_any_change(tokens):
    c = st.HiCache(1, 64)
    pages = c.alloc_device(2)
    before = c.stats()
    with pytest.raises(ConfigError, match="tokens"):
        c.match_prefix(tokens)
    with pytest.raises(ConfigError, match="tokens"):
        c.insert(tokens, pages)
    assert c.stats() == before
    c.free_device(pages)
    c.validate()


def test_a_strided_memoryview_of_bytes_is_refused_not_read_a_byte_a_token():
    c = st.HiCache(1, 64)
    raw = np.arange(1, 9, dtype="<u4").tobytes()
    m = c.match_prefix(raw, alloc=True)
    c.insert(raw, m)
    assert c.match_prefix(memoryview(raw)).device_len == 8
    with pytest.raises(ConfigError, match="strided"):
        c.match_prefix(memoryview(raw)[::2])
    c.validate()


def test_ids_past_int64_are_refused_not_wrapped():
    c = st.HiCache(1, 64)
    with pytest.raises(ConfigError, match="pages"):
        c.free_device(np.array([2**63], dtype=np.uint64))
    with pytest.raises(ConfigError, match="pages"):
        c.free_device([1.0])
    c.validate()


# ---- class 10: every argument is checked before anything changes ----


def test_insert_with_a_stale_unlock_changes_nothing():
    c = st.HiCache(1, 64)
    m = c.match_prefix(np.arange(1, 5), alloc=True)
    nodes = c.stats()["nodes"]
    with pytest.raises((st.UnknownNodeError, st.NotLockedError)):
        c.insert(np.arange(1, 5), m, lock=True, unlock=987654321)
    assert c.stats()["nodes"] == nodes, "the insert took effect before the refusal"
    r = c.insert(np.arange(1, 5), m, lock=True, unlock=m.device_node)
    c.unlock(r.last_node)
    c.validate()
    assert c.evict_device(4) == 4, "nothing stays locked"


# ---- class 9: a finished request inserts only the tokens it was admitted with ----


def test_finishing_with_other_tokens_than_the_admitted_prompt_is_refused():
    s = small_joined()
    prompt = np.arange(1, 11, dtype=np.int64)  # 10 tokens: two whole pages
    s.admit(7, prompt)
    s.extend(7, len(prompt))
    s.end_step()
    s.drain()
    other = prompt.copy()
    other[6] = 999  # inside the prompt's second page, past anything matched
    with pytest.raises(ConfigError, match="admitted"):
        s.finish_request(7, other)
    s.finish_request(7, prompt)
    s.flush_finished()
    s.validate()
    # The next request over the other tokens matches only the page it shares with the prompt.
    assert s.admit(8, other)["matched_pages"] == 1
    assert s.admit(9, prompt)["matched_pages"] == 2


@pytest.mark.parametrize(
    "form",
    [
        lambda a: a.astype("<u4").tobytes(),
        lambda a: bytearray(a.astype("<u4").tobytes()),
        lambda a: memoryview(a.astype("<u4").tobytes()),
        lambda a: array("q", a.tolist()),
        lambda a: torch.from_numpy(a),
    ],
    ids=["bytes", "bytearray", "memoryview", "array_q", "torch"],
)
def test_the_joined_scheduler_reads_token_containers_as_hicache_does(form):
    # Bytes are little-endian uint32 ids, as HiCache reads them; read as numpy would, each byte
    # had been a token of its own (a 10-token prompt read as 40 tokens, matching nothing).
    s = small_joined()
    prompt = np.arange(1, 11, dtype=np.int64)
    s.admit(7, form(prompt))
    assert s.request_len(7) == 0
    s.extend(7, len(prompt))
    s.end_step()
    s.drain()
    s.finish_request(7, form(prompt))
    s.flush_finished()
    assert s.admit(8, prompt)["matched_pages"] == 2
    assert s.admit(9, form(prompt))["matched_pages"] == 2
    with pytest.raises(ConfigError, match="strided"):
        s.admit(10, memoryview(prompt.astype("<u4").tobytes())[::2])
    s.validate()


# ---- classes 2 and 8: an L3 store that fails as the OS fails, and objects out of place ----


def _l3_stack(tmp_path):
    from l3_support import stack

    return stack("file", tmp_path)


def test_a_page_whose_directory_cannot_be_made_is_a_counted_store_failure(tmp_path):
    from l3_support import PS, insert, push_to_l3, restore, same, tokens

    s = _l3_stack(tmp_path)
    t = tokens(5 * PS, seed=11)
    keys = s.hicache.storage_keys(t)
    # A stray file where page 2's fan-out directory goes.
    (tmp_path / keys[2][:2]).write_bytes(b"not a directory")
    want = insert(s, t, "index")
    push_to_l3(s)  # write-back: every page is offered to the store; one fails
    s.storage.drain()  # ends
    stats = s.hicache.storage_stats()
    assert stats["write_failures"] >= 1
    assert stats["online"], "one page failing is not the store going away"
    assert stats["writes_in_flight"] == 0
    assert s.storage.backend.write_errors >= 1
    c = s.hicache.stats()
    assert c["host_in_tree"] == 0, "no host page stays pinned by a lost write plan"
    n, got = restore(s, t)
    assert n == 2, "the pages before the one that could not be stored come back"
    for comp in want:
        assert same({comp: got[comp]}, {comp: want[comp][:, :, :2]})
    s.hicache.validate()
    s.storage.close()


def test_a_host_pool_freed_under_l3_is_refused_before_the_store_touches_it(tmp_path):
    # The L3 controller hands the store raw addresses of host pages. Before, a host pool
    # resized after binding went on being read by writes and written by prefetches.
    from l3_support import PS, insert, tokens

    s = _l3_stack(tmp_path)
    t = tokens(4 * PS, seed=3)
    insert(s, t)
    c = s.hicache
    c.evict_device(10**6)
    next(iter(s.host_pools.values())).untyped_storage().resize_(0)
    c.evict_host(10**6)  # write-back: plans a write of every page
    for call in (
        s.storage.flush,
        lambda: s.storage.prefetch(t, 0, 4),
        lambda: s.storage._l3.host_segments(0),
    ):
        with pytest.raises(ConfigError, match="resized"):
            call()
    # Nothing was handed to the store's worker: the plans wait in the core.
    assert c.storage_stats()["writes_in_flight"] > 0 and not s.storage._writes


def test_a_host_pool_freed_under_the_joined_schedulers_l3_is_refused():
    kv = st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 24)
    ik = st.PoolSpec("INDEXER", 2, 1, 8, "bf16", 4, 24)
    kv_host = st.PoolSpec("KV", 2, 1, 8, "bf16", 4, 24)
    host = torch.zeros(kv_host.shape(), dtype=torch.bfloat16)
    s = st.StepScheduler.joined(
        st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv),
        st.PageTransferBinding(host, kv_host),
        st.TransferEngine("cpu"),
        indexer_device=st.PageTransferBinding(torch.zeros(ik.shape(), dtype=torch.bfloat16), ik),
        indexer_host=st.PageTransferBinding(torch.zeros(ik.shape(), dtype=torch.bfloat16), ik),
    )
    l3 = lowlevel.L3Protocol(s.enable_storage())
    host.untyped_storage().resize_(0)
    for call in (l3.take_writes, lambda: l3.host_segments(0),
                 lambda: l3.plan_prefetch(np.arange(1, 9), 0, 2)):  # fmt: skip
        with pytest.raises(ConfigError, match="resized") as e:
            call()
        assert e.value.field == "host_kv"


@pytest.mark.parametrize(
    ("option", "value"),
    [("chunk_pages", 1.5), ("chunk_pages", True), ("chunk_pages", "4"), ("chunk_pages", None),
     ("chunk_pages", 0), ("prefetch_timeout", None), ("prefetch_timeout", float("nan")),
     ("prefetch_timeout", -1), ("prefetch_timeout", "x"), ("retry_interval", float("nan")),
     ("retry_interval", "x"), ("retry_interval", -1.0), ("backend", None)],
)  # fmt: skip
def test_a_storage_controllers_bad_setting_is_refused_naming_it(tmp_path, option, value):
    # Before: a NaN retry interval never probed a lost store again (L3 off for good), a
    # fractional chunk failed every prefetch in the worker, no timeout waited forever.
    from sparsetier.l3 import StorageController

    s = _l3_stack(tmp_path)
    kw = {"backend": s.storage.backend, option: value}
    with pytest.raises(ConfigError) as e:
        StorageController(s.hicache, **kw)
    assert e.value.field == option
    with pytest.raises(ConfigError, match="cached_tokens"):
        s.storage.storage_pages(np.arange(1, 65), -4)
    s.storage.close()


def test_a_closed_storage_controller_refuses_work_and_leaks_nothing(tmp_path):
    # Before: a prefetch after close took host pages from the core, failed to reach the
    # worker, and a later drain waited for it forever.
    from l3_support import PS, insert, push_to_l3, tokens

    s = _l3_stack(tmp_path)
    t = tokens(4 * PS, seed=5)
    insert(s, t)
    push_to_l3(s)
    insert(s, tokens(4 * PS, seed=7))  # host pages the store lacks
    s.storage.close()
    s.storage.close()  # (again: nothing)
    for call in (lambda: s.storage.prefetch(t, 0, 4), s.storage.flush, s.storage.poll,
                 s.storage.drain):  # fmt: skip
        with pytest.raises(ConfigError, match="closed"):
            call()
    # The cache plans nothing for a store no one runs: write-back eviction drops the pages.
    c = s.hicache
    c.evict_device(10**6)
    c.evict_host(10**6)
    stats = c.storage_stats()
    assert stats["prefetches_in_flight"] == stats["writes_in_flight"] == 0
    assert c.stats()["host_in_tree"] == 0, "no host page stays pinned by a write plan"
    c.validate()


def test_a_prefetch_the_worker_cannot_take_ends_with_its_host_pages_freed(tmp_path):
    from l3_support import PS, insert, push_to_l3, tokens

    s = _l3_stack(tmp_path)
    t = tokens(4 * PS, seed=6)
    insert(s, t)
    push_to_l3(s)
    host_free = s.hicache.stats()["host_free"]
    s.storage._pool.shutdown()  # the worker gone under the controller
    with pytest.raises(RuntimeError, match="shutdown"):
        s.storage.prefetch(t, 0, 4)
    assert s.hicache.storage_stats()["prefetches_in_flight"] == 0
    assert s.hicache.stats()["host_free"] == host_free
    s.hicache.validate()


@pytest.mark.parametrize(
    ("config", "field"),
    [({"salt": None}, "salt"), ({"write_ahead": "x"}, "write_ahead"),
     ({"write_ahead": True}, "write_ahead"), ({"write_ahead": None}, "write_ahead"),
     ({"write_policy": None}, "write_policy"), ({"path": ""}, "path"), ({"path": None}, "path"),
     ({"chunk_pages": 0}, "chunk_pages"), ({"retry_interval": float("nan")}, "retry_interval")],
)  # fmt: skip
def test_a_stacks_bad_storage_setting_is_refused_naming_it(config, field):
    # (Before: a salt of None was the salt "None", a path of "" stored pages in the working
    # directory, and the controller's settings were checked after L3 was on.)
    from l3_support import specs

    with pytest.raises(ConfigError) as e:
        st.build_sparse_stack(specs(16), storage_backend="file", storage_config=config)
    assert e.value.field == field


@pytest.mark.parametrize("pin", [0, "no", True] if not torch.cuda.is_available() else [0, "no"])
def test_a_stacks_pin_memory_is_a_bool_and_needs_cuda_to_be_true(pin):
    from l3_support import specs

    with pytest.raises(ConfigError) as e:
        st.build_sparse_stack(specs(16), pin_memory=pin)
    assert e.value.field == "pin_memory"


@pytest.mark.parametrize("bad", ["../../x", "a/b", "", ".", None])
def test_a_file_store_key_that_would_leave_its_root_is_refused_before_any_page(tmp_path, bad):
    import ctypes

    from sparsetier.l3 import FileStore

    root = tmp_path / "store"
    b = FileStore(root)
    src = (ctypes.c_char * 64).from_buffer_copy(bytes(range(64)))
    good = "ab" + "0" * 30
    for call in (b.put, b.get):
        with pytest.raises(ConfigError) as e:
            call([good, bad], [[(ctypes.addressof(src), 64)]] * 2)
        assert e.value.field == "keys[1]"
    assert not b.exists([good])[0], "nothing stored before the refusal"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_store_root_replaced_by_a_file_goes_offline_and_comes_back(tmp_path):
    from l3_support import PS, insert, push_to_l3, tokens

    root = tmp_path / "store"
    s = _l3_stack(root)
    s.storage.retry_interval = 0.0
    insert(s, tokens(2 * PS, seed=1), "random")
    aside = tmp_path / "aside"
    root.rename(aside)
    root.write_bytes(b"a file where the store was")
    insert(s, tokens(2 * PS, seed=2), "random")
    push_to_l3(s)
    s.storage.drain()
    assert not s.hicache.storage_stats()["online"]
    root.unlink()
    aside.rename(root)
    s.storage.poll()
    assert s.hicache.storage_stats()["online"], "the store answers again"
    s.hicache.validate()
    s.storage.close()


def test_a_store_root_under_a_regular_file_is_a_config_error(tmp_path):
    from sparsetier.l3 import FileStore

    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ConfigError, match="root"):
        FileStore(tmp_path / "f" / "store")


def test_swapped_page_files_are_misses_not_each_others_data(tmp_path):
    from l3_support import PS, insert, push_to_l3, restore, same, tokens

    s = _l3_stack(tmp_path)
    t = tokens(4 * PS, seed=3)
    want = insert(s, t, "index")
    push_to_l3(s)
    keys = s.hicache.storage_keys(t)
    a = tmp_path / keys[1][:2] / f"{keys[1]}.page"
    b = tmp_path / keys[2][:2] / f"{keys[2]}.page"
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)
    n, got = restore(s, t)
    assert n == 1, "page 1 holds page 2's object: a miss, and nothing after it"
    for comp in want:
        assert same({comp: got[comp]}, {comp: want[comp][:, :, :1]})
    assert s.storage.backend.foreign == 2, "both swapped objects (one read chunk)"
    s.hicache.validate()
    s.storage.close()


def _page_file(root, key):
    return root / key[:2] / f"{key}.page"


def _in_thread(call):
    """Runs `call` in a thread; fails the test if it has not ended after HANG seconds."""
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=call()), daemon=True)
    th.start()
    th.join(HANG)
    assert not th.is_alive(), "the call hangs"
    return out["r"]


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink_loop", "truncated", "empty"])
def test_a_page_file_that_is_not_a_page_is_a_counted_miss(tmp_path, kind):
    """What sits where a stored page was (a FIFO, which a plain open would wait on forever, a
    directory, a symlink loop, a cut or empty file) is a miss counted by the store, never a
    hang or data; the pages before it come back, and the page is written again later."""
    import os

    from l3_support import PS, insert, push_to_l3, restore, same, tokens

    s = _l3_stack(tmp_path)
    t = tokens(4 * PS, seed=21)
    want = insert(s, t, "index")
    push_to_l3(s)
    path = _page_file(tmp_path, s.hicache.storage_keys(t)[2])
    raw = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink_loop":
        path.symlink_to(path.name)
    elif kind == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:
        path.write_bytes(b"")
    b = s.storage.backend
    corrupt = b.corrupt
    n, got = _in_thread(lambda: restore(s, t))
    assert n == 2, "the pages before the bad one come back, nothing after it"
    for comp in want:
        assert same({comp: got[comp]}, {comp: want[comp][:, :, :2]})
    if kind in ("truncated", "empty"):
        assert b.corrupt == corrupt + 1, "the bad object is counted"
    # A bad object is removed (to be written again); what is not a regular file never counts
    # as a stored page.
    assert b.exists([s.hicache.storage_keys(t)[2]]) == [False]
    assert s.hicache.storage_stats()["online"], "one bad page is not the store going away"
    s.hicache.validate()
    s.storage.close()


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink_loop"])
def test_reading_a_page_that_is_not_a_regular_file_never_blocks(tmp_path, kind):
    """The backend read itself, where the object turned into a FIFO, a directory or a symlink
    loop after it was found: a counted miss at once."""
    import ctypes
    import os

    from sparsetier.l3 import FileStore

    b = FileStore(tmp_path)
    src = (ctypes.c_char * 64).from_buffer_copy(bytes(range(64)))
    dst = (ctypes.c_char * 64)()
    key = "ab" + "0" * 30
    assert b.put([key], [[(ctypes.addressof(src), 64)]]) == [True]
    path = _page_file(tmp_path, key)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(path.name)
    got = _in_thread(lambda: b.get([key], [[(ctypes.addressof(dst), 64)]]))
    assert got == [False]
    assert b.corrupt + b.read_errors == 1, "the miss is counted"
    assert bytes(dst) == bytes(64), "nothing was written into the page"


def test_a_full_disk_is_a_counted_store_failure(tmp_path):
    """ENOSPC from the OS: the page's temporary file is /dev/full (a symlink in its place), so
    the write fails as on a full disk; the store counts it, unpins the page and stays online."""
    import os

    from l3_support import PS, insert, push_to_l3, tokens

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    s = _l3_stack(tmp_path)
    t = tokens(3 * PS, seed=8)
    key = s.hicache.storage_keys(t)[1]
    (tmp_path / key[:2]).mkdir(exist_ok=True)
    tmp = _page_file(tmp_path, key).with_suffix(f".tmp{os.getpid()}")
    tmp.symlink_to("/dev/full")
    insert(s, t, "random")
    push_to_l3(s)
    s.storage.drain()
    assert s.storage.backend.write_errors == 1
    stats = s.hicache.storage_stats()
    assert stats["online"] and stats["writes_in_flight"] == 0
    assert s.hicache.stats()["host_in_tree"] == 0, "no host page stays pinned"
    assert not tmp.exists() and not tmp.is_symlink(), "the temporary name is cleaned up"
    assert s.storage.backend.exists([key]) == [False]
    s.hicache.validate()
    s.storage.close()


def _run_script(code: str) -> None:
    """Runs `code` in a Python of its own (limits, users and descriptors it changes stay
    there): it must print "ok"."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok")


_FAILING_STORE = """
import os, resource, signal, sys
sys.path.insert(0, {tests!r})
from l3_support import PS, insert, push_to_l3, stack, tokens
s = stack("file", {root!r})
t = tokens(4 * PS, seed=5)
insert(s, t, "random")
{limit}
push_to_l3(s)
s.storage.drain()
st = s.hicache.storage_stats()
assert st["writes_in_flight"] == 0, st
assert s.storage.backend.write_errors >= 1, "the OS error is counted"
assert s.hicache.stats()["host_in_tree"] == 0, "no host page stays pinned"
s.hicache.validate()
s.storage.close()
print("ok", s.storage.backend.write_errors)
"""


@pytest.mark.parametrize(
    "limit",
    [
        # The file size limit: a write past it fails with EFBIG (SIGXFSZ ignored).
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit("
        "resource.RLIMIT_FSIZE)[1]))",
        # Too many open files: every descriptor the limit allows is taken, so opening a page
        # file fails with EMFILE.
        "n = resource.getrlimit(resource.RLIMIT_NOFILE); resource.setrlimit("
        "resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 16, n[1])); hog = []\n"
        "try:\n    while True: hog.append(open(os.devnull))\nexcept OSError: pass",
        # No permission to write in the store (EACCES): the process gives up root (the store
        # stays readable, 0755), or a process that never had root finds it read-only.
        "if os.getuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
        "else:\n    os.chmod(s.storage.backend.root, 0o500)",
    ],
    ids=["file_too_large", "too_many_open_files", "permission_denied"],
)
def test_an_os_error_while_writing_is_a_counted_store_failure(tmp_path, limit):
    """Write failures the OS gives a process (EFBIG past its file size limit, EMFILE past its
    open files, EACCES on a store it may not write) are counted store failures: the drain
    ends, no host page stays pinned."""
    import shutil
    import tempfile
    from pathlib import Path

    # A store root every user may reach (pytest's own directories are the owner's only), so a
    # process that gave up root finds the store there but may not write in it.
    root = Path(tempfile.mkdtemp(prefix="sparsetier-l3-"))
    try:
        root.chmod(0o755)
        code = _FAILING_STORE.format(tests=str(Path(__file__).parent), root=str(root), limit=limit)
        _run_script(code)
    finally:
        shutil.rmtree(root, ignore_errors=True)


_LOCKED_OUT = """
import os, sys
sys.path.insert(0, {tests!r})
from l3_support import PS, insert, push_to_l3, restore, same, stack, tokens
s = stack("file", {root!r})
s.storage.retry_interval = 0.0
t = tokens(3 * PS, seed=4)
want = insert(s, t, "random")
os.setegid(65534); os.seteuid(65534)  # the store's parent is its owner's only: EACCES
push_to_l3(s)
s.storage.drain()
st = s.hicache.storage_stats()
assert not st["online"], st
assert st["writes_in_flight"] == 0, st
assert s.hicache.stats()["host_in_tree"] == 0, "no host page stays pinned"
s.hicache.validate()
os.seteuid(0); os.setegid(0)
s.storage.poll()
assert s.hicache.storage_stats()["online"], "the store answers again"
insert(s, t, "random", seed=1)
push_to_l3(s)
n, got = restore(s, t)
assert n == 3 and same(got, want), n
s.hicache.validate()
s.storage.close()
print("ok")
"""


def test_a_store_the_process_may_not_reach_goes_offline_and_comes_back(tmp_path):
    """EACCES on the store's parent (its owner's only, and the process gave up root): the
    store is gone, as a removed one is; nothing stays pinned, the drain ends, and once the
    process may reach it again it answers and serves."""
    import os
    from pathlib import Path

    if os.getuid() != 0:
        pytest.skip("needs root, to give it up and take it back")
    tmp_path.chmod(0o700)
    code = _LOCKED_OUT.format(tests=str(Path(__file__).parent), root=str(tmp_path / "store"))
    _run_script(code)


_UNREADABLE_PAGE = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from l3_support import PS, insert, push_to_l3, restore, same, stack, tokens
s = stack("file", {root!r})
t = tokens(4 * PS, seed=6)
want = insert(s, t, "random")
push_to_l3(s)
key = s.hicache.storage_keys(t)[2]
Path({root!r}, key[:2], key + ".page").chmod(0)
os.setegid(65534); os.seteuid(65534)  # may search the store, may not read that page: EACCES
n, got = restore(s, t)
assert n == 2, n
assert s.storage.backend.read_errors == 1, s.storage.backend.read_errors
for comp in want:
    assert same({{comp: got[comp]}}, {{comp: want[comp][:, :, :2]}})
assert s.hicache.storage_stats()["online"]
s.hicache.validate()
s.storage.close()
print("ok")
"""


def test_a_page_the_process_may_not_read_is_a_counted_miss(tmp_path):
    """EACCES on one page file: that page and those after it are misses, counted in
    `read_errors`; the pages before it are restored exactly and the store stays online."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    if os.getuid() != 0:
        pytest.skip("needs root, to give it up")
    root = Path(tempfile.mkdtemp(prefix="sparsetier-l3-"))
    try:
        root.chmod(0o755)
        code = _UNREADABLE_PAGE.format(tests=str(Path(__file__).parent), root=str(root))
        _run_script(code)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- class 11: the smaller cases, each a typed error naming its field ----


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda c: c.evict_device(-1), "n"),
        (lambda c: c.evict_host(-1), "n"),
        (lambda c: testing.inject_alloc_failures(c, -3), "count"),
        (lambda c: lowlevel.L3Protocol(c).prefetch_end(-1), "plan_id"),
        (lambda c: lowlevel.L3Protocol(c).host_segments(-1), "page"),
        (lambda c: c.evict_device(2**70), "n"),
        (lambda c: c.evict_device(True), "n"),
    ],
)
def test_negative_and_huge_counts_are_config_errors(call, field):
    c = st.HiCache(1, 8)
    with pytest.raises(ConfigError) as e:
        call(c)
    assert e.value.field == field
    c.validate()


def _runtime():
    from sparsetier.tools.model import ModelConfig, TinySparseModel
    from sparsetier.tools.runtime import DecodeRuntime

    m = TinySparseModel(ModelConfig(layers=1, vocab=64))
    return DecodeRuntime(m, page_size=4, device_slots=64, host_pages=64, indexer_pages=32)


@pytest.mark.parametrize(
    "prompt",
    [
        [1, 2, 3],
        np.arange(1, 4),
        "abc",
        None,
        pytest.param("empty", id="empty"),
        pytest.param("2d", id="2d"),
        pytest.param("oov", id="out-of-vocabulary"),
        pytest.param("negative", id="negative"),
        pytest.param("float", id="float"),
    ],
)
def test_bad_prompts_are_config_errors_naming_the_prompt(prompt):
    import torch

    rt = _runtime()
    prompt = (
        {
            "empty": torch.zeros(0, dtype=torch.long),
            "2d": torch.ones(2, 3, dtype=torch.long),
            "oov": torch.tensor([1, 2, 64]),
            "negative": torch.tensor([1, -2]),
            "float": torch.tensor([1.0, 2.0]),
        }.get(prompt, prompt)
        if isinstance(prompt, str)
        else prompt
    )
    with pytest.raises(ConfigError) as e:
        rt.add_request(0, prompt, 2)
    assert e.value.field == "prompt"
    assert not rt.requests
    rt.scheduler.validate()


def test_unknown_requests_are_config_errors():
    rt = _runtime()
    with pytest.raises(ConfigError, match="rid"):
        rt.finish_request(5)
    with pytest.raises(ConfigError, match="rid"):
        rt.add_request(-1, np.arange(3), 1)
    with pytest.raises(ConfigError, match="decode_steps"):
        import torch

        rt.add_request(0, torch.arange(1, 4), -1)


def test_a_wait_that_times_out_names_the_callers_transfer():
    c, e, dev, host = pooled_hicache(1)
    # Engine submissions the cache never made, so its transfer ids and the engine's differ.
    for _ in range(3):
        backup = lowlevel.PreparedPageTransfer(dev, host, [1], [1], direction="backup")
        e.submit(lowlevel.PageTransferGroup([backup])).wait()
    testing.inject_copy_fault(e, e.submitted, delay=2.0)
    m = c.match_prefix(np.arange(1, 3), alloc=True)
    c.insert(np.arange(1, 3), m, unlock=m.device_node)
    [tid] = c.flush()
    assert tid != e.submitted - 1, "the ids coincide: the test cannot tell them apart"
    with pytest.raises(st.WaitTimeoutError) as err:
        c.wait(tid, timeout=0.01)
    assert err.value.transfer_id == tid
    c.drain()
    c.validate()


# ---- class 3: a lock is released only on the node it was taken on ----


def _two_levels(c):
    m = c.match_prefix(np.arange(1, 5), alloc=True)
    parent = c.insert(np.arange(1, 5), m, unlock=m.device_node).last_node
    m = c.match_prefix(np.arange(1, 9), alloc=True)
    child = c.insert(np.arange(1, 9), m, unlock=m.device_node).last_node
    return parent, child


def test_unlocking_a_node_locked_only_through_its_child_is_refused():
    c = st.HiCache(1, 64)
    parent, child = _two_levels(c)
    c.lock(child)
    with pytest.raises(st.NotLockedError):
        c.unlock(parent)  # its count comes from the child's lock
    c.validate()
    c.unlock(child)
    c.lock(parent)
    # The parent's pages stay: only the child's four are evicted.
    assert c.evict_device(100) == 4
    assert c.match_prefix(np.arange(1, 5)).device_len == 4
    c.unlock(parent)
    c.validate()


def test_a_second_unlock_of_a_match_released_by_insert_is_refused():
    c = st.HiCache(1, 64)
    _two_levels(c)
    m = c.match_prefix(np.arange(1, 13), alloc=True)
    r = c.insert(np.arange(1, 13), m, lock=True, unlock=m.device_node)
    with pytest.raises(st.NotLockedError):
        c.unlock(m.device_node)  # insert released it already
    c.validate()
    c.unlock(r.last_node)
    with pytest.raises(st.NotLockedError):
        c.unlock(r.last_node)
    c.validate()
    assert c.evict_device(100) == 12, "nothing stays locked"


@pytest.mark.parametrize("dtype", ["int64", "int32"])
@pytest.mark.parametrize("bad", [-2, -1000])
def test_selection_entries_below_minus_one_are_refused_not_skipped(dtype, bad):
    s = small_scheduler(4, 16, 64, 1, {1: 12, 2: 12})
    with pytest.raises(st.OutOfRangeError) as e:
        s.plan(0, [1, 2], np.array([[0, 1], [bad, 2]], dtype=dtype), 4)
    assert e.value.field == "selection[1][0]"
    offsets = np.array([0, 2, 4])
    with pytest.raises(st.OutOfRangeError):
        s.plan_csr(0, [1, 2], offsets, np.array([0, 1, 2, bad], dtype=dtype), 4)
    # -1 stays padding.
    _, table = s.plan(0, [1, 2], np.array([[0, 1], [-1, 2]], dtype=dtype), 4)
    assert table[1][0] == -1
    s.validate()


# ---- class 6: a page has one owner; an insert or a free names only pages its caller holds ----


def _books(c):
    """What a refused call must leave as it was."""
    s = c.stats()
    keys = ("nodes", "device_free", "device_in_tree", "device_outstanding", "device_locked")
    return {k: s[k] for k in keys if k in s}


def _refused(c, call, held_by):
    before = _books(c)
    with pytest.raises(st.NotHeldError) as e:
        call()
    assert e.value.field in ("device_pages", "pages"), e.value.field
    assert held_by in e.value.held_by, e.value.held_by
    assert _books(c) == before, "a refused call changed the cache"
    c.validate()
    return e.value


def test_a_match_inserted_again_under_other_tokens_is_refused():
    c = st.HiCache(1, 64)
    a, b = np.arange(1, 9), np.arange(101, 109)
    m = c.match_prefix(a, alloc=True)
    c.insert(a, m, unlock=m.device_node)
    _refused(c, lambda: c.insert(b, m), "the cache itself")
    assert c.match_prefix(b).device_len == 0
    assert c.evict_device(100) == 8, "each page is evicted once"
    c.validate()


def test_pages_the_tree_holds_are_refused_whole_or_mixed_in():
    c = st.HiCache(1, 64)
    a, b = np.arange(1, 9), np.arange(101, 109)
    r = c.insert(a, c.alloc_device(8))
    tree_pages = c.path_device_pages(r.last_node)
    _refused(c, lambda: c.insert(b, tree_pages), "the cache itself")
    fresh = c.alloc_device(8)
    mixed = np.concatenate([fresh.pages[:7], tree_pages[3:4]])
    _refused(c, lambda: c.insert(b, mixed), "the cache itself")
    _refused(c, lambda: c.free_device(tree_pages), "the cache itself")
    # The refused calls took nothing: the allocation is still whole and inserts.
    c.insert(b, fresh)
    assert c.match_prefix(b).device_len == 8
    c.validate()


def test_a_stale_allocation_is_refused_and_the_new_owner_keeps_its_pages():
    c = st.HiCache(1, 8)
    toks = np.arange(1, 5)
    old = c.alloc_device(4)
    c.free_device(old)
    new = c.alloc_device(4)
    assert sorted(new.tolist()) == sorted(old.tolist()), "the same pages, handed on"
    assert new.receipt != old.receipt
    _refused(c, lambda: c.insert(toks, old), "another allocation")
    _refused(c, lambda: c.free_device(old), "another allocation")
    # A match's new pages are its allocation's too.
    c.free_device(new)
    m = c.match_prefix(toks, alloc=True)
    _refused(c, lambda: c.insert(toks, old), "another allocation")
    c.free_device(m)
    _refused(c, lambda: c.insert(toks, m), "no one")
    c.unlock(m.device_node)
    assert c.stats()["device_free"] == 8
    c.validate()


def test_pages_evicted_and_handed_on_leave_the_old_match():
    c = st.HiCache(1, 8)
    a, b = np.arange(1, 9), np.arange(101, 109)
    m = c.match_prefix(a, alloc=True)
    c.insert(a, m, unlock=m.device_node)
    # All eight pages leave the tree for this allocation.
    fresh = c.alloc_device(8)
    assert sorted(fresh.tolist()) == sorted(m.pages.tolist())
    _refused(c, lambda: c.insert(a, m), "another allocation")
    c.insert(b, fresh)
    c.validate()


def test_a_page_named_twice_is_refused():
    c = st.HiCache(1, 64)
    fresh = c.alloc_device(4)
    p = fresh.pages
    twice = np.array([p[0], p[1], p[2], p[0]])
    err = _refused(c, lambda: c.insert(np.arange(1, 5), twice), "named twice")
    assert err.value == p[0]
    with pytest.raises(st.AllocatorError):
        c.free_device(twice)
    c.insert(np.arange(1, 5), fresh)
    c.validate()


def test_another_caches_allocation_is_refused():
    c, other = st.HiCache(1, 64), st.HiCache(1, 64)
    theirs = other.alloc_device(4)
    c.alloc_device(4)  # the same page numbers, held here by another allocation
    _refused(c, lambda: c.insert(np.arange(1, 5), theirs), "another allocation")
    _refused(c, lambda: c.free_device(theirs), "another allocation")
    other.insert(np.arange(1, 5), theirs)
    other.validate()


def test_out_of_range_pages_are_refused_naming_the_range():
    c = st.HiCache(1, 16, device_reserve=1)
    err = _refused(c, lambda: c.insert(np.arange(1, 2), [9999]), "1 <= page < 16")
    assert isinstance(err, ConfigError)
    _refused(c, lambda: c.insert(np.arange(1, 2), [0]), "1 <= page < 16")


def test_an_allocation_reads_as_an_array_of_its_pages():
    import torch

    c = st.HiCache(1, 64)
    a = c.alloc_device(5)
    assert len(a) == 5 and list(a) == a.tolist() == a.pages.tolist()
    assert np.asarray(a).dtype == np.int64
    assert np.asarray(a, dtype=np.int32).tolist() == a.tolist()
    assert torch.as_tensor(a).tolist() == a.tolist()
    assert a[1] == a.pages[1] and a[1:3].tolist() == a.tolist()[1:3]
    # Writing into a view changes the view only: the cache takes the pages it handed out.
    a.pages[0] = 63
    c.insert(np.arange(1, 6), a)
    assert 63 not in c.match_prefix(np.arange(1, 6)).device_pages.tolist()
    c.validate()


# ---- handles from another object: unknown there, never the name of one of its own ----


def _directory_with_a_load():
    d = lowlevel.ResidencyDirectory(8, 16, object_bytes=64)
    k = np.array([[0, 0, p, -1] for p in range(4)], dtype=np.int64)
    d.allocate(k)
    plan = d.backup(k)
    d.mark_submitted(plan.transfer_id)
    d.backup_complete(plan.transfer_id)
    assert len(d.evict(4)) == 4
    r = d.resolve(k)
    assert r.loads, "the objects load back"
    return d, r


def test_a_directorys_handles_are_unknown_to_another_directory():
    a, ra = _directory_with_a_load()
    b, rb = _directory_with_a_load()
    tid = ra.loads[0].transfer_id
    assert tid != rb.loads[0].transfer_id and ra.handle.id != rb.handle.id
    with pytest.raises(st.UnknownHandleError):
        b.release(ra.handle)
    for call in (b.mark_submitted, b.complete, b.backup_complete, b.transfer_ended):
        with pytest.raises(st.UnknownTransferError):
            call(tid)
    with pytest.raises(st.UnknownTransferError):
        b.fail(tid, "not mine")
    with pytest.raises(st.UnknownTransferError):
        b.wait(tid, timeout=0.0)
    b.validate()
    # b's own handles still work, and a's are untouched.
    b.mark_submitted(rb.loads[0].transfer_id)
    b.complete(rb.loads[0].transfer_id)
    b.release(rb.handle)
    a.mark_submitted(tid)
    a.complete(tid)
    a.release(ra.handle)
    a.validate()
    b.validate()


def test_a_caches_nodes_and_transfers_are_unknown_to_another_cache():
    from l3_support import PS, insert, tokens

    sa = st.build_sparse_stack(
        [st.PoolSpec("KV", 1, 1, 8, "bf16", PS, 16)], hicache_ratio=1.0, layout="layer_first"
    )
    sb = st.build_sparse_stack(
        [st.PoolSpec("KV", 1, 1, 8, "bf16", PS, 16)], hicache_ratio=1.0, layout="layer_first"
    )
    t = tokens(2 * PS, seed=4)
    for s in (sa, sb):
        insert(s, t)
    ma = sa.hicache.match_prefix(t)
    mb = sb.hicache.match_prefix(t)
    assert ma.last_node != mb.last_node, "node ids are the cache's own"
    cb = sb.hicache
    for call in (cb.lock, cb.unlock, cb.load_back, cb.path_device_pages):
        with pytest.raises(st.UnknownNodeError):
            call(ma.last_node)
    with pytest.raises((st.NotLockedError, st.UnknownNodeError)):
        cb.insert(t, cb.match_prefix(t, alloc=True), unlock=ma.device_node)
    sa.hicache.evict_device(100)
    lb = sa.hicache.load_back(sa.hicache.match_prefix(t).last_node)
    sa.hicache.flush()
    with pytest.raises(st.UnknownTransferError):
        cb.wait(lb["transfer_id"], timeout=0.0)
    sa.hicache.drain()
    for s in (sa, sb):
        s.hicache.validate()


def test_a_schedulers_plans_are_unknown_to_another_scheduler():
    a = small_scheduler(4, 16, 64, 1, {1: 12, 2: 12})
    b = small_scheduler(4, 16, 64, 1, {1: 12, 2: 12})
    pa, _ = a.plan(0, [1, 2], np.array([[0, 1], [0, 2]]), 4)
    pb, _ = b.plan(0, [1, 2], np.array([[0, 1], [0, 2]]), 4)
    assert pa != pb
    with pytest.raises(SparsetierError):
        b.ready(pa)
    with pytest.raises(SparsetierError):
        b.finish(pa)
    b.ready(pb)
    b.finish(pb)
    a.ready(pa)
    a.finish(pa)
    a.validate()
    b.validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a cuda tensor")
def test_a_hicache_refuses_cuda_pools_for_the_cpu_engine():
    # Misread: the cpu engine would copy a cuda tensor's address as host memory. The pair is
    # checked as the step scheduler checks its tiers, naming the pool.
    kv = st.PoolSpec("KV", 1, 1, 8, "bf16", 4, 8)
    dev = st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16, device="cuda"), kv)
    host = st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv)
    with pytest.raises(ConfigError) as e:
        st.HiCache(4, 8, host_pages=8, pools=[(dev, host, None)], engine=st.TransferEngine("cpu"))
    assert e.value.field == "pools[0][0]"
    with pytest.raises(ConfigError) as e:
        st.HiCache(4, 8, host_pages=8, pools=[(host, dev, None)], engine=st.TransferEngine("cpu"))
    assert e.value.field == "pools[0][1]"
