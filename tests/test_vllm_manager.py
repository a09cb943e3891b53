"""``SparsetierOffloadingManager`` against vLLM 0.33's ``CPUOffloadingManager``.

1. vLLM's own ``tests/v1/kv_offload/cpu/test_manager.py`` (from its sdist): every test that uses
   only the public manager API runs here with the module's ``CPUOffloadingManager`` rebound to
   ours (``vllm_spec.INTERNAL`` lists the others and what they reach into).
2. A differential state machine: random request streams (lookups, loads, stores that succeed
   and fail, touches, request ends, resets, events, metrics; two KV groups; both policies;
   with and without a store threshold) driven through vLLM's manager and ours, with identical
   results, chunk ids, evictions and events at every step, and our core's invariants checked
   after every step.
"""

from __future__ import annotations

import gc

import pytest
import vllm_spec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from sparsetier.errors import ConfigError, InvalidTransitionError, NotResidentError
from sparsetier.vllm import SparsetierOffloadingManager

_VLLM = vllm_spec.load()
_VLLM.CPUOffloadingManager = SparsetierOffloadingManager  # make_cpu_manager builds ours


def test_every_vllm_test_is_run_or_named_internal():
    names = vllm_spec.test_names(_VLLM)
    assert set(vllm_spec.INTERNAL) <= names, "an internal test vLLM no longer has"
    public = names - set(vllm_spec.INTERNAL)
    assert len(public) >= 25, public
    assert public <= set(globals()), "a public vLLM test not collected here"


def test_vllm_helpers_build_ours():
    assert isinstance(_VLLM.make_cpu_manager(), SparsetierOffloadingManager)


# vLLM's public-API tests, collected as tests of this module.
for _name in vllm_spec.test_names(_VLLM) - set(vllm_spec.INTERNAL):
    globals()[_name] = getattr(_VLLM, _name)
del _name


# ---- the differential state machine ----

BLOCKS = 24
GROUPS = 2
TOKENS = 16


def key(block: int, group: int) -> bytes:
    return make_offload_key(f"block-{block}".encode(), group)


UNIVERSE = [key(b, g) for b in range(BLOCKS) for g in range(GROUPS)]


class Request:
    """One request on both managers: its context (shared: each manager keeps its own state
    type on it), its blocks, how far it has offered them."""

    def __init__(self, name: str, blocks: list[int]) -> None:
        self.ctx = ReqContext(req_id=name)
        self.blocks = blocks
        self.offered = 0
        self.finished = False

    def keys(self, lo: int, hi: int) -> list[bytes]:
        out = []
        for g in range(GROUPS):
            for i in range(lo, hi):
                k = key(self.blocks[i], g)
                self.ctx.set_offload_key_position(k, (i + 1) * TOKENS)
                out.append(k)
        return out


def pins_of(ref: CPUOffloadingManager) -> tuple[int, int, int]:
    """vLLM's (stored, storing, load pins), read from its policy's chunks."""
    policy = ref._policy
    chunks = dict(policy.chunks) if hasattr(policy, "chunks") else {**policy.t1, **policy.t2}
    stored = sum(1 for c in chunks.values() if c.ref_cnt >= 0)
    storing = sum(1 for c in chunks.values() if c.ref_cnt < 0)
    pins = sum(max(c.ref_cnt, 0) for c in chunks.values())
    return stored, storing, pins


class Differential(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []
        self.stores: list[tuple[Request, list[bytes]]] = []
        self.loads: list[tuple[Request, list[bytes]]] = []
        self.serial = 0

    @initialize(
        policy=st.sampled_from(["lru", "arc"]),
        threshold=st.sampled_from([0, 2]),
        num_chunks=st.integers(4, 14),
        tracker=st.integers(3, 10),
    )
    def build(self, policy, threshold, num_chunks, tracker):
        kw = dict(
            num_chunks=num_chunks,
            cache_policy=policy,
            enable_events=True,
            store_threshold=threshold,
            max_tracker_size=tracker,
        )
        self.ref = CPUOffloadingManager(**kw)
        self.ours = SparsetierOffloadingManager(**kw)
        assert self.ours.medium == self.ref.medium

    def both(self, method: str, *args):
        a = getattr(self.ref, method)(*args)
        b = getattr(self.ours, method)(*args)
        return a, b

    @rule(
        shared=st.integers(0, BLOCKS // 2),
        length=st.integers(1, BLOCKS // 2),
        start=st.integers(0, BLOCKS - 1),
    )
    def new_request(self, shared, length, start):
        # A shared prefix of `shared` blocks, then blocks of its own.
        own = [(start + i) % BLOCKS for i in range(length)]
        blocks = list(range(shared)) + [b for b in own if b >= shared][:length]
        self.serial += 1
        r = Request(f"r{self.serial}", blocks)
        self.both("on_new_request", r.ctx)
        self.requests.append(r)

    def live(self, i: int) -> Request | None:
        live = [r for r in self.requests if not r.finished]
        return live[i % len(live)] if live else None

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(i=st.integers(0, 7))
    def lookup_prefix(self, i):
        r = self.live(i)
        for k in r.keys(0, len(r.blocks)):
            a, b = self.both("lookup", k, r.ctx)
            assert a == b, k
            if a is LookupResult.MISS:
                break

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(i=st.integers(0, 7), back=st.integers(0, 3), n=st.integers(1, 4))
    def store(self, i, back, n):
        r = self.live(i)
        lo = max(0, r.offered - back)  # re-offers feed the store threshold
        hi = min(len(r.blocks), lo + n)
        if lo >= hi:
            return
        keys = r.keys(lo, hi)
        a, b = self.both("prepare_store", keys, r.ctx)
        assert (a is None) == (b is None)
        r.offered = max(r.offered, hi)
        if a is None:
            return
        assert b.keys_to_store == a.keys_to_store
        assert list(b.store_spec.block_ids) == list(a.store_spec.block_ids)
        assert b.evicted_keys == a.evicted_keys
        if a.keys_to_store:
            self.stores.append((r, list(a.keys_to_store)))

    # Offers are the main event: a second rule doubles their share of the steps.
    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(i=st.integers(0, 7), back=st.integers(0, 3), n=st.integers(1, 4))
    def store_more(self, i, back, n):
        self.store(i, back, n)

    @precondition(lambda self: self.stores)
    @rule(j=st.integers(0, 7), ok=st.booleans(), as_set=st.booleans())
    def complete_store(self, j, ok, as_set):
        r, keys = self.stores.pop(j % len(self.stores))
        keys = set(keys) if as_set else keys
        self.both("complete_store", keys, r.ctx, ok)

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(i=st.integers(0, 7), n=st.integers(1, 6))
    def load(self, i, n):
        r = self.live(i)
        hits = [
            k for k in r.keys(0, len(r.blocks)) if self.ref.lookup(k, r.ctx) is LookupResult.HIT
        ][:n]
        if not hits:
            return
        a, b = self.both("prepare_load", hits, r.ctx)
        assert list(b.block_ids) == list(a.block_ids)
        self.loads.append((r, hits))

    @precondition(lambda self: self.loads)
    @rule(j=st.integers(0, 7))
    def complete_load(self, j):
        r, keys = self.loads.pop(j % len(self.loads))
        self.both("complete_load", keys, r.ctx)

    @rule(picks=st.lists(st.integers(0, len(UNIVERSE) - 1), max_size=5))
    def touch(self, picks):
        keys = [UNIVERSE[p] for p in picks]
        self.both("touch", keys, ReqContext(req_id="touch"))

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        r = self.live(i)
        r.finished = True
        self.both("on_request_finished", r.ctx)

    @rule(go=st.integers(0, 15))
    def reset(self, go):
        if go:  # rare, so that state builds up between resets
            return
        self.both("reset_cache")
        # vLLM's scheduler never completes a transfer from before a reset.
        self.stores.clear()
        self.loads.clear()

    @rule()
    def events(self):
        a, b = self.both("take_events")
        assert list(b) == list(a)

    @rule()
    def stats(self):
        a, b = self.both("get_stats")
        assert b.reduce() == pytest.approx(a.reduce())

    @invariant()
    def same_lookups_and_valid(self):
        if not hasattr(self, "ours"):
            return
        self.ours.validate()
        ctx = ReqContext(req_id="probe")
        for k in UNIVERSE:
            assert self.ours.lookup(k, ctx) is self.ref.lookup(k, ctx), k
        counts = self.ours.core_counts()
        assert (counts["stored"], counts["storing"], counts["pinned"]) == pins_of(self.ref)
        if self.ref.counts is not None:
            assert dict(self.ours.counts) == dict(self.ref.counts)
            assert list(self.ours.counts) == list(self.ref.counts)


TestDifferential = Differential.TestCase
TestDifferential.settings = settings(
    TestDifferential.settings if hasattr(TestDifferential, "settings") else settings(),
    stateful_step_count=60,
)


# ---- what the drop-in does beyond vLLM's tests ----


def test_request_records_are_freed_with_their_contexts():
    m = SparsetierOffloadingManager(num_chunks=8)
    for i in range(50):
        ctx = ReqContext(req_id=str(i))
        m.on_new_request(ctx)
        out = m.prepare_store([key(i % BLOCKS, 0)], ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
        del ctx
    gc.collect()
    m.lookup(key(0, 0), ReqContext(req_id="x"))  # a call frees what was queued
    m.prepare_store([], ReqContext(req_id="y"))
    assert m.core_counts()["requests"] <= 2
    m.validate()


def test_bad_calls_are_typed_errors_and_change_nothing():
    m = SparsetierOffloadingManager(num_chunks=4, enable_events=True)
    ctx = ReqContext(req_id="a")
    with pytest.raises(ConfigError, match="keys\\[1\\]"):
        m.prepare_store([key(1, 0), "not bytes"], ctx)
    with pytest.raises(ConfigError, match="keys\\[1\\]"):
        m.prepare_store([key(1, 0), key(1, 0)], ctx)
    with pytest.raises(NotResidentError):
        m.prepare_load([key(1, 0)], ctx)
    out = m.prepare_store([key(1, 0)], ctx)
    with pytest.raises(InvalidTransitionError, match="being stored"):
        m.prepare_load(out.keys_to_store, ctx)
    m.complete_store(out.keys_to_store, ctx)
    with pytest.raises(InvalidTransitionError, match="not pinned"):
        m.complete_load([key(1, 0)], ctx)
    with pytest.raises(ConfigError, match="cache_policy"):
        SparsetierOffloadingManager(num_chunks=4, cache_policy="fifo")
    bad_args = (
        ({"enable_events": "no"}, "enable_events"),
        ({"cache_policy": None}, "cache_policy"),
        ({"info": "x"}, "info"),
    )
    for bad, field in bad_args:
        with pytest.raises(ConfigError) as e:
            SparsetierOffloadingManager(num_chunks=4, **bad)
        assert e.value.field == field
    with pytest.raises(ConfigError, match="success"):
        m.complete_store([key(1, 0)], ctx, success=None)
    # (Before: a bare AttributeError from inside the core's binding.)
    for call in (lambda: m.prepare_store([key(3, 0)], None), lambda: m.on_new_request(None),
                 lambda: m.on_request_finished("req")):  # fmt: skip
        with pytest.raises(ConfigError, match="req_context"):
            call()
    with pytest.raises(ConfigError, match="cache_policy_module_path"):
        SparsetierOffloadingManager(num_chunks=4, cache_policy_module_path="my.policies")
    m.on_request_finished(ctx)
    with pytest.raises(InvalidTransitionError, match="finished"):
        m.prepare_store([key(2, 0)], ctx)
    assert m.lookup(key(2, 0), ctx) is LookupResult.MISS
    assert m.core_counts()["stored"] == 1
    m.validate()


def test_a_position_getter_a_subclass_overrides_is_used():
    class Shifted(ReqContext):
        def get_offload_key_position(self, key):
            pos = super().get_offload_key_position(key)
            return None if pos is None else 1000 - pos

    for make in (ReqContext, Shifted):
        ref, ours = CPUOffloadingManager(num_chunks=3), SparsetierOffloadingManager(num_chunks=3)
        ctx = make(req_id="s")
        keys = [key(b, 0) for b in range(3)]
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * TOKENS)
        for m in (ref, ours):
            m.complete_store(m.prepare_store(keys, ctx).keys_to_store, ctx)
            m.on_request_finished(ctx)
        other = ReqContext(req_id="o")
        a = ref.prepare_store([key(9, 0)], other)
        b = ours.prepare_store([key(9, 0)], other)
        assert b.evicted_keys == a.evicted_keys


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_long_request_streams_match_vllm(policy):
    """Seeded streams far longer than the state machine's: ARC's target only goes fractional
    (and its truncation only matters) after many ghost hits, which short runs rarely reach."""
    import random

    for trial in range(150):
        rng = random.Random(f"{policy}-{trial}")
        d = Differential()
        d.build(
            policy=policy,
            threshold=rng.choice([0, 2]),
            num_chunks=rng.randint(4, 14),
            tracker=rng.randint(3, 10),
        )
        for _ in range(400):
            c = rng.random()
            if c < 0.1 or not any(not r.finished for r in d.requests):
                d.new_request(rng.randint(0, 12), rng.randint(1, 12), rng.randint(0, 23))
            elif c < 0.4:
                d.store(rng.randint(0, 7), rng.randint(0, 3), rng.randint(1, 4))
            elif c < 0.55 and d.stores:
                d.complete_store(rng.randint(0, 7), rng.random() < 0.85, rng.random() < 0.5)
            elif c < 0.7:
                d.load(rng.randint(0, 7), rng.randint(1, 6))
            elif c < 0.8 and d.loads:
                d.complete_load(rng.randint(0, 7))
            elif c < 0.9:
                d.touch([rng.randint(0, len(UNIVERSE) - 1) for _ in range(rng.randint(0, 5))])
            elif c < 0.95:
                d.finish(rng.randint(0, 7))
            elif c < 0.99:
                d.events()
            else:
                d.reset(0)
            d.same_lookups_and_valid()
        d.stats()


def test_threads_share_one_manager():
    """Four threads drive one manager, each on its own keys (another thread's stores may
    still evict them, so each holds `manager.lock` across a lookup and the load it pins, as
    vLLM's contract has it; the other calls go unlocked, atomic in the core). The core is
    never waited on with the GIL held: the threads interleave, nothing deadlocks, and every
    invariant holds after."""
    import threading

    m = SparsetierOffloadingManager(num_chunks=64, enable_events=True)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(300):
                ctx = ReqContext(req_id=f"{t}-{i}")
                keys = [make_offload_key(f"t{t}-{(i + j) % 40}".encode(), j % 2) for j in range(6)]
                out = m.prepare_store(keys, ctx)
                if out is not None:
                    m.complete_store(out.keys_to_store, ctx, success=i % 7 != 0)
                with m.lock:  # vLLM's contract: a hit and the load that pins it, together
                    hits = [k for k in keys if m.lookup(k, ctx) is LookupResult.HIT]
                    if hits:
                        m.prepare_load(hits, ctx)
                if hits:
                    m.complete_load(hits, ctx)
                m.on_request_finished(ctx)
                list(m.take_events())
                m.get_stats()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert errors == []
    m.validate()
    assert m.core_counts()["pinned"] == 0


def _manager_calls():
    """What vLLM's scheduler and workers call on one manager, each call on keys of its own
    thread (`t` in the key) and self-contained: it finishes the request it started."""
    import itertools

    serial = itertools.count()

    def keys(t, i):
        return [make_offload_key(f"t{t}-{(i + j) % 20}".encode(), j % 2) for j in range(4)]

    def store(m, t, i):
        ctx = ReqContext(req_id=f"s{t}-{next(serial)}")
        out = m.prepare_store(keys(t, i), ctx)
        if out is not None:
            m.complete_store(out.keys_to_store, ctx, success=i % 5 != 0)
        m.on_request_finished(ctx)

    def load(m, t, i):
        ctx = ReqContext(req_id=f"l{t}-{next(serial)}")
        with m.lock:  # vLLM's contract: a hit and the load that pins it, together
            hits = [k for k in keys(t, i) if m.lookup(k, ctx) is LookupResult.HIT]
            if hits:
                m.prepare_load(hits, ctx)
        if hits:
            m.touch(hits, ctx)
            m.complete_load(hits, ctx)
        m.on_request_finished(ctx)

    return {
        "store": store,
        "load": load,
        "events": lambda m, t, i: list(m.take_events()),
        "stats": lambda m, t, i: (m.get_stats(), m.core_counts()),
        "validate": lambda m, t, i: m.validate(),
        "reset": lambda m, t, i: m.reset_cache(),
    }


@pytest.mark.parametrize("pair", [(a, b) for a in range(6) for b in range(a, 6)])
def test_every_pair_of_calls_on_one_manager(pair):
    """Every pair of the manager's calls in two threads: both end, neither raises, and
    nothing stays pinned. A reset drops every chunk at once, as vLLM's does, pinned or not;
    vLLM's scheduler never completes a job from before a reset, and a store or load another
    thread completes after one is refused with a typed error, its pins gone with the reset."""
    import threading

    m = SparsetierOffloadingManager(num_chunks=48, enable_events=True)
    calls = _manager_calls()
    names = list(calls)
    errors: list[BaseException] = []

    def run(name, t):
        for i in range(150):
            try:
                calls[name](m, t, i)
            except (InvalidTransitionError, NotResidentError) as e:
                if "reset" not in [names[j] for j in pair]:
                    errors.append(e)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

    ts = [threading.Thread(target=run, args=(names[i], t), daemon=True) for t, i in enumerate(pair)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in ts), f"{[names[i] for i in pair]} hung"
    assert errors == []
    m.validate()
    assert m.core_counts()["pinned"] == 0
