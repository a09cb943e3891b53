"""Threads (issue 40, class 1): every pair of a serving loop's calls in two threads on one
object (`HiCache`, `ResidencyDirectory`, `PageAllocator`, a plain and a joined
`StepScheduler`), and four threads at once. Each pair must end (no deadlock, no call left
waiting on a lock held with the GIL), raise nothing but the typed refusals a race may cause,
and leave nothing pinned or in flight.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from scheduler_support import small_joined, small_scheduler

import sparsetier as st
from sparsetier import lowlevel
from sparsetier.errors import SparsetierError

# How long a thread may take before the pair is called hung (not a timing check: a working
# build answers at once; a deadlocked one never does).
HANG = 20.0


def _hicache_calls():
    """Calls a serving loop makes on one HiCache, each self-contained (it cleans up what it
    takes), some converting tokens through Python code."""

    def match_insert(c, rng):
        toks = rng.integers(1, 50, size=int(rng.integers(1, 12)))
        m = c.match_prefix(toks, alloc=True)
        r = c.insert(toks, m, unlock=m.device_node)
        del r

    def match_slow(c, rng):
        c.match_prefix(BlockingTokensNow(rng.integers(1, 50, size=6)))

    def alloc_free(c, rng):
        try:
            c.free_device(c.alloc_device(int(rng.integers(0, 3))))
        except st.OutOfPagesError:
            pass

    return {
        "match_insert": match_insert,
        "match_slow": match_slow,
        "alloc_free": alloc_free,
        "lock_unlock": lambda c, rng: _lock_unlock(c, rng),
        "evict": lambda c, rng: c.evict_device(int(rng.integers(0, 4))),
        "stats": lambda c, rng: c.stats(),
        "validate": lambda c, rng: c.validate(),
        "wait": _wait_unknown,
    }


def _wait_unknown(c, rng):
    """A wait whose lookup runs under the cache's lock (an id this cache never issued)."""
    try:
        c.wait(0, timeout=0.0)
    except st.UnknownTransferError:
        return
    raise AssertionError("transfer 0 was never issued")


class BlockingTokensNow:
    """Tokens whose conversion runs Python code (and lets other threads run) but never waits."""

    def __init__(self, tokens) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)

    def __array__(self, dtype=None, copy=None):
        threading.Event().wait(0)  # a call into Python that yields
        return self.tokens if dtype is None else self.tokens.astype(dtype)


def _lock_unlock(c, rng):
    m = c.match_prefix(rng.integers(1, 50, size=4), lock=True)
    c.unlock(m.device_node)


def _hammer(target, calls, rounds: int = 60):
    """A thread body running `calls[name]` on `target` `rounds` times, and where it reports."""
    errors: list[BaseException] = []

    def run(name, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(rounds):
                calls[name](target, rng)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    return errors, run


def _run_pair(target, calls, pair, rounds: int = 60) -> None:
    """Calls `pair` (two indices into `calls`) in two threads on `target`: both end, neither
    raises."""
    names = list(calls)
    errors, run = _hammer(target, calls, rounds)
    ts = [threading.Thread(target=run, args=(names[i], k), daemon=True) for k, i in enumerate(pair)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(HANG)
    assert not any(t.is_alive() for t in ts), f"{[names[i] for i in pair]} hung"
    assert errors == []


@pytest.mark.parametrize("pair", [(a, b) for a in range(8) for b in range(a, 8)])
def test_every_pair_of_calls_on_one_hicache(pair):
    c = st.HiCache(1, 48)
    _run_pair(c, _hicache_calls(), pair)
    c.validate()


def typed(f):
    """A thread's call that another thread's racing call may refuse with a typed error (a
    load holds the slot, a key is gone, a plan is open): anything else still fails."""

    def call(target, rng):
        try:
            f(target, rng)
        except SparsetierError:
            pass

    return call


def _directory_calls():
    """Calls a decode loop makes on one ResidencyDirectory. Races between them may refuse a
    call with a typed error (another thread's load holds the slot, a key is gone); anything
    else, or a hang, fails the test."""

    def keys(rng, n=4):
        return lowlevel.object_keys(0, rng.choice(12, size=n, replace=False))

    def resolve_release(d, rng):
        r = d.resolve(keys(rng))
        for load in r.loads:
            d.mark_submitted(load.transfer_id)
            d.complete(load.transfer_id)
        d.release(r.handle)

    def backup(d, rng):
        plan = d.backup(keys(rng, 2))
        if plan.transfer_id is not None:
            d.mark_submitted(plan.transfer_id)
            d.backup_complete(plan.transfer_id)

    def allocate_drop(d, rng):
        ns = int(rng.integers(1, 1 << 30))
        d.allocate(lowlevel.object_keys(ns, [0, 1]))
        d.drop_namespace(ns)

    def wait_unknown(d, rng):
        with pytest.raises(st.UnknownTransferError):
            d.wait(1 << 62, timeout=0.0)

    return {
        "resolve_release": typed(resolve_release),
        "backup": typed(backup),
        "allocate_drop": typed(allocate_drop),
        "evict": lambda d, rng: d.evict(int(rng.integers(0, 3))),
        "state": lambda d, rng: d.state((0, 0, int(rng.integers(0, 12)), -1)),
        "stats": lambda d, rng: d.stats(),
        "validate": lambda d, rng: d.validate(),
        "wait": wait_unknown,
    }


def _directory_for_threads():
    d = lowlevel.ResidencyDirectory(16, 32, object_bytes=64)
    k = lowlevel.object_keys(0, range(12))
    d.allocate(k)
    plan = d.backup(k)
    d.mark_submitted(plan.transfer_id)
    d.backup_complete(plan.transfer_id)
    d.evict(12)
    return d


@pytest.mark.parametrize("pair", [(a, b) for a in range(8) for b in range(a, 8)])
def test_every_pair_of_calls_on_one_directory(pair):
    d = _directory_for_threads()
    _run_pair(d, _directory_calls(), pair)
    d.validate()
    s = d.stats()
    # Every call released what it pinned and settled what it started.
    assert (s["pins"], s["handles"], s["transfers_in_flight"]) == (0, 0, 0), s


def _allocator_calls():
    def alloc_free(a, rng):
        try:
            pages = a.alloc(int(rng.integers(0, 5)))
        except st.OutOfPagesError:
            return
        a.free(pages[::-1].copy())

    return {
        "alloc_free": alloc_free,
        "is_allocated": lambda a, rng: a.is_allocated(int(rng.integers(0, 40))),
        "validate": lambda a, rng: a.validate(),
        "repr": lambda a, rng: repr(a),
    }


@pytest.mark.parametrize("pair", [(a, b) for a in range(4) for b in range(a, 4)])
def test_every_pair_of_calls_on_one_page_allocator(pair):
    a = lowlevel.PageAllocator(32, reserve_pages=1)
    _run_pair(a, _allocator_calls(), pair, rounds=200)
    a.validate()
    assert a.used_count == 0


def _scheduler_calls():
    """Calls a decode loop makes on one StepScheduler, each on requests of its own thread or
    on the two shared ones. Races between them may refuse a call with a typed error (another
    thread's plan is open on the layer, the step is ending); anything else, or a hang, fails
    the test."""
    serial = iter(range(100, 1 << 30))

    def request(s, rng):
        rid = next(serial)
        s.add_request(rid, int(rng.integers(1, 9)))
        try:
            s.extend(rid, int(rng.integers(1, 3)))
        finally:
            s.finish_request(rid)

    def plan(s, rng):
        sel = rng.integers(-1, 2, size=(2, 2))
        p, _ = s.plan(int(rng.integers(0, 2)), [1, 2], sel, 4)
        try:
            s.ready(p)
        finally:
            s.finish(p)

    return {
        "request": typed(request),
        "plan": typed(plan),
        "end_step": typed(lambda s, rng: s.end_step()),
        "poll_drain": lambda s, rng: s.poll() if rng.integers(0, 2) else s.drain(),
        "append": typed(lambda s, rng: s.append([1, 2])),
        "stats": lambda s, rng: (s.stats(), s.totals(), s.request_len(1)),
        "validate": lambda s, rng: s.validate(),
    }


@pytest.mark.parametrize("pair", [(a, b) for a in range(7) for b in range(a, 7)])
def test_every_pair_of_calls_on_one_scheduler(pair):
    s = small_scheduler(4, 32, 128, 2, {1: 8, 2: 8})
    _run_pair(s, _scheduler_calls(), pair, rounds=40)
    s.drain()
    s.end_step()
    s.drain()
    s.validate()
    got = s.stats()
    # Every plan finished (the pins left are the kept selections), every finished request
    # gave back its pages, nothing in flight.
    assert got["pins"] == got["kept_pins"], got
    assert (got["plans_outstanding"], got["transfers_in_flight"]) == (0, 0), got
    assert got["requests"] == 2, got


def _joined_calls():
    """Calls a serving loop makes on one joined scheduler: conversations over a few shared
    prompts that admit, prefill, finish into the prefix cache and get evicted."""
    serial = iter(range(100, 1 << 30))

    def conversation(s, rng):
        rid = next(serial)
        prompt = np.arange(1, 1 + 4 * int(rng.integers(1, 4)), dtype=np.int64)
        prompt[-1] += int(rng.integers(0, 3))
        s.admit(rid, prompt)
        try:
            if len(prompt) > s.request_len(rid):  # the matched part is there already
                s.extend(rid, len(prompt) - s.request_len(rid))
        finally:
            s.finish_request(rid, prompt)

    return {
        "conversation": typed(conversation),
        "flush": lambda s, rng: s.flush_finished(),
        "end_step": typed(lambda s, rng: (s.end_step(), s.drain())),
        "evict": lambda s, rng: s.evict_prefix(int(rng.integers(0, 3)), int(rng.integers(0, 3))),
        "stats": lambda s, rng: (s.stats(), s.prefix_stats()),
        "validate": lambda s, rng: s.validate(),
    }


@pytest.mark.parametrize("pair", [(a, b) for a in range(6) for b in range(a, 6)])
def test_every_pair_of_calls_on_one_joined_scheduler(pair):
    s = small_joined(pages=48)
    _run_pair(s, _joined_calls(), pair, rounds=30)
    s.end_step()
    s.drain()
    s.flush_finished()
    s.validate()
    got = s.stats()
    assert (got["requests"], got["plans_outstanding"], got["transfers_in_flight"]) == (0, 0, 0)
    # The cache still serves: a finished conversation is matched whole by the next one.
    prompt = np.arange(1, 14, dtype=np.int64)  # three whole pages and one token
    s.admit(1, prompt)
    s.extend(1, len(prompt) - s.request_len(1))
    s.finish_request(1, prompt)
    s.flush_finished()
    assert s.admit(2, prompt)["matched_pages"] == 3
    s.validate()


def test_four_threads_on_one_hicache_and_one_scheduler():
    calls = _hicache_calls()
    c = st.HiCache(1, 64)
    s = small_scheduler(4, 32, 64, 2, {1: 8, 2: 8})
    errors, run = _hammer(c, calls)

    def sched(seed):
        try:
            for _ in range(60):
                s.stats()
                s.validate()
                s.request_len(1)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    names = list(calls)
    ts = [
        threading.Thread(target=run, args=(names[k % len(names)], k), daemon=True) for k in range(3)
    ]
    ts.append(threading.Thread(target=sched, args=(9,), daemon=True))
    for t in ts:
        t.start()
    for t in ts:
        t.join(HANG)
    assert not any(t.is_alive() for t in ts)
    assert errors == []
    c.validate()
    s.validate()
