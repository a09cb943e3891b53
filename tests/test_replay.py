"""`sparsetier replay`: the LRU replay is the directory itself (it reproduces the recorded
run's hits to the object), MIN is the offline optimum (checked against exhaustive search), and
MIN is never below LRU."""

import functools
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsetier as sp
from sparsetier import lowlevel
from sparsetier.replay import load_trace, save_trace, sweep
from sparsetier.tools.cli import main
from sparsetier.tools.demo import DemoConfig, _run, _workload
from sparsetier.tools.model import ModelConfig, TinySparseModel


@functools.cache
def demo_trace(prefetch: bool):
    cfg = DemoConfig(requests=6, concurrent=3, steps=16, context_min=256, context_max=512,
                     page_size=8, topk=4, prefetch=prefetch)  # fmt: skip
    model = TinySparseModel(ModelConfig(seed=0))
    return cfg, model, _workload(cfg, model.c.vocab)


def record(prefetch: bool, tmp_path):
    cfg, model, work = demo_trace(prefetch)
    path = str(tmp_path / f"t{int(prefetch)}.npz")
    rt, *_ = _run(cfg, model, work, 150, (400, 200), None, {}, trace=path)
    return rt, load_trace(path)


@pytest.mark.parametrize("prefetch", [False, True])
def test_lru_replay_reproduces_the_recorded_run_to_the_object(prefetch, tmp_path):
    rt, trace = record(prefetch, tmp_path)
    tot = rt.scheduler.totals()
    r = lowlevel.replay_trace(trace, trace["device_slots"], "lru")
    assert r["feasible"]
    assert r["hits"] == tot["ready"] + tot["joined"]
    assert r["loads"] == tot["loaded"] + tot["prefetch_loaded"]
    assert r["accesses"] == tot["pages"]


def test_min_is_never_below_lru_and_both_reach_the_peak(tmp_path):
    _, trace = record(True, tmp_path)
    rows = sweep(trace, [0.2, 0.3, 0.5, 0.7, 1.0])
    by = {(r.policy, r.budget): r for r in rows}
    for (policy, b), r in by.items():
        if policy == "lru" and r.feasible:
            m = by[("min", b)]
            assert m.feasible and m.hits >= r.hits, b
    peak = lowlevel.trace_peak_live(trace)
    lru, mn = by[("lru", peak)], by[("min", peak)]
    assert lru.hits == mn.hits and lru.loads == mn.loads  # nothing to evict: no policy matters


def trace_of(n_objects, reads):
    """A trace of `n_objects` pages created (and written through) one by one, then read in
    batches `reads` (each resolved and released), recorded on a directory that fits them."""
    d = lowlevel.ResidencyDirectory(64, 64, object_bytes=8)
    d.start_journal()
    for o in range(n_objects):
        k = lowlevel.object_keys(o, [0])
        d.allocate(k)
        d.backup_complete(d.backup(k).transfer_id)
    for batch in reads:
        keys = np.concatenate([lowlevel.object_keys(o, [0]) for o in sorted(set(batch))])
        d.release(d.resolve(keys).handle)
    return d.take_journal()


def optimum(n_objects, reads, cap):
    """Fewest misses any eviction choice achieves: exhaustive search, memoized."""
    events = [("new", o) for o in range(n_objects)] + [("read", frozenset(b)) for b in reads]

    @functools.cache
    def best(i, resident):
        if i == len(events):
            return 0
        kind, x = events[i]
        need = {x} if kind == "new" else set(x)
        miss = need - resident
        keep = resident | need
        over = len(keep) - cap
        cost = len(miss) if kind == "read" else 0
        if over <= 0:
            return cost + best(i + 1, frozenset(keep))
        out = float("inf")
        for drop in itertools.combinations(sorted(resident - need), over):
            out = min(out, best(i + 1, frozenset(keep - set(drop))))
        return cost + out

    return best(0, frozenset())


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(2, 6),
    reads=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=9),
    cap=st.integers(1, 6),
)
def test_min_is_the_offline_optimum(n, reads, cap):
    reads = [[o % n for o in b] for b in reads]
    if cap > n or any(len(set(b)) > cap for b in reads):
        return
    trace = trace_of(n, reads)
    m = lowlevel.replay_trace(trace, cap, "min")
    lru = lowlevel.replay_trace(trace, cap, "lru")
    assert m["feasible"] and lru["feasible"]
    opt = optimum(n, reads, cap)
    assert m["accesses"] - m["hits"] == opt
    assert lru["accesses"] - lru["hits"] >= opt


def test_trace_files_round_trip_and_bad_ones_are_typed(tmp_path):
    t = trace_of(3, [[0, 1], [2]])
    p = str(tmp_path / "t.npz")
    save_trace(p, t)
    back = load_trace(p)
    assert all(np.array_equal(back[k], t[k]) for k in ("ops", "ns", "starts"))
    assert lowlevel.replay_trace(back, 2, "min") == lowlevel.replay_trace(t, 2, "min")
    with pytest.raises(sp.ConfigError):
        lowlevel.replay_trace(t, 2, "fifo")
    with pytest.raises(sp.ConfigError):
        lowlevel.replay_trace(t, 0, "lru")
    bad = dict(t, starts=t["starts"][::-1].copy())
    with pytest.raises(sp.ConfigError):
        lowlevel.replay_trace(bad, 2, "lru")
    with pytest.raises(sp.ConfigError):
        load_trace(str(tmp_path / "missing.npz"))


def test_replay_command(tmp_path, capsys):
    t = trace_of(4, [[0, 1], [2, 3], [0, 2], [1], [3, 0]])
    p = str(tmp_path / "t.npz")
    save_trace(p, t)
    j = tmp_path / "r.json"
    assert main(["replay", p, "--budgets", "50,100", "--bandwidth", "25", "--window-ms", "0.1",
                 "--hit-rate", "0.5", "--json", str(j)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "under LRU" in out and "under MIN" in out
    rows = json.loads(j.read_text())["rows"]
    assert {r["policy"] for r in rows} == {"lru", "min"}
    assert main(["replay", p, "--budgets", "0"]) == 2
