"""L3 under the host tier, on the real stores: a directory (``file``) and Mooncake Store (a
real ``mooncake_master`` started here on free localhost ports). Nothing is mocked; faults are
injected around the real backend (a gate that holds or kills) or into the store itself."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from l3_support import (
    PATTERNS,
    PS,
    Gate,
    controller,
    insert,
    push_to_l3,
    restore,
    same,
    stack,
    tokens,
)

import sparsetier as st
from sparsetier import lowlevel

BACKENDS = ["file", "mooncake"]


@pytest.fixture(params=BACKENDS)
def where(request, tmp_path):
    if request.param == "file":
        return "file", tmp_path / "l3"
    return "mooncake", request.getfixturevalue("master")


@pytest.mark.parametrize("layout", ["layer_first", "layer_page_first"])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_every_pool_round_trips_through_l3(where, layout, policy):
    backend, at = where
    s = stack(backend, at, layout=layout, write_policy=policy)
    reqs = [(tokens(3 * PS, seed=i), pat) for i, pat in enumerate(PATTERNS)]
    data = [insert(s, t, pat, seed=i) for i, (t, pat) in enumerate(reqs)]
    s.storage.drain()
    push_to_l3(s)
    c = s.hicache
    assert c.stats()["host_in_tree"] == 0 and c.stats()["device_in_tree"] == 0
    st_ = c.storage_stats()
    assert st_["pages_written"] == 3 * len(reqs) and st_["write_failures"] == 0
    for (t, _), want in zip(reqs, data, strict=True):
        n, got = restore(s, t)
        assert n == 3
        assert same(got, want)
    c.validate()
    assert c.storage_stats()["pages_prefetched"] == 3 * len(reqs)
    s.storage.close()


def test_a_second_cache_finds_the_first_ones_pages(where):
    backend, at = where
    a = stack(backend, at)
    t = tokens(5 * PS, seed=7)
    want = insert(a, t, "random", seed=3)
    push_to_l3(a)
    b = stack(backend, at)  # another HiCache, another client, the same store
    assert b.storage.match_prefix(t)["storage_pages"] == 5
    # A different salt (model version) sees nothing.
    c = stack(backend, at, salt="other-model")
    assert c.storage.match_prefix(t)["storage_pages"] == 0
    n, got = restore(b, t)
    assert n == 5 and same(got, want)
    # A prompt that shares 2 pages and then differs: exactly those 2 pages.
    u = np.concatenate([t[: 2 * PS], tokens(3 * PS, seed=99)])
    assert b.storage.match_prefix(u)["storage_pages"] == 0  # b holds them itself now
    assert c.storage.match_prefix(u)["storage_pages"] == 0
    assert stack(backend, at).storage.match_prefix(u)["storage_pages"] == 2
    for s in (a, b, c):
        s.hicache.validate()
        s.storage.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "delete"])
def test_corrupt_file_objects_are_misses(tmp_path, damage):
    s = stack("file", tmp_path)
    t = tokens(4 * PS, seed=2)
    want = insert(s, t, "index")
    push_to_l3(s)
    keys = s.hicache.storage_keys(t)
    victim = tmp_path / keys[2][:2] / f"{keys[2]}.page"
    raw = bytearray(victim.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0x01
        victim.write_bytes(bytes(raw))
    elif damage == "truncate":
        victim.write_bytes(bytes(raw[:-3]))
    elif damage == "header":
        raw[0] ^= 0xFF
        victim.write_bytes(bytes(raw))
    else:
        victim.unlink()
    m = s.storage.match_prefix(t)
    # exists() sees the file (until read) unless deleted; the read verifies.
    assert m["storage_pages"] == (2 if damage == "delete" else 4)
    n, got = restore(s, t)
    assert n == 2, "only the pages before the damaged one come back"
    for comp in want:
        assert same({comp: got[comp]}, {comp: want[comp][:, :, :2]})
    if damage != "delete":
        assert s.storage.backend.corrupt == 1
        assert not victim.exists(), "a corrupt object is removed, to be written again"
    s.hicache.validate()
    stats = s.hicache.storage_stats()
    assert stats["pages_prefetched"] == 2
    assert stats["prefetch_missed"] == (0 if damage == "delete" else 2)
    s.storage.close()


def _gated(tmp_path, **kw):
    s = stack("file", tmp_path)
    t = tokens(8 * PS, seed=5)
    want = insert(s, t, "random")
    push_to_l3(s)
    gate = Gate(s.storage.backend)
    ctl = controller(s, gate, chunk_pages=2, **kw)
    return s, t, want, gate, ctl


def test_best_effort_takes_what_arrived(tmp_path):
    s, t, _, gate, ctl = _gated(tmp_path)
    p = ctl.prefetch(t, 0, 8)
    gate.release(1)  # one chunk of 2 pages may arrive
    deadline = time.monotonic() + 10
    while p.arrived < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ctl.finish_prefetch(p, "best_effort") == 2
    # The worker may still read the next chunk into held pages: released, then ended.
    gate.release(10)
    ctl.drain()
    c = s.hicache
    c.validate()
    assert c.storage_stats()["prefetches_in_flight"] == 0
    assert c.storage_stats()["prefetch_missed"] == 6
    assert c.match_prefix(t)["host_len"] == 2 * PS
    ctl.close()


def test_wait_complete_waits_for_everything(tmp_path):
    s, t, want, gate, ctl = _gated(tmp_path)
    p = ctl.prefetch(t, 0, 8)
    threading.Timer(0.2, lambda: gate.release(4)).start()
    assert ctl.finish_prefetch(p, "wait_complete") == 8
    n, got = restore(s, t)
    assert n == 8 and same(got, want)
    ctl.close()


def test_timeout_waits_up_to_the_deadline(tmp_path):
    s, t, _, gate, ctl = _gated(tmp_path, prefetch_timeout=0.3)
    p = ctl.prefetch(t, 0, 8)
    gate.release(2)  # two chunks, then the store hangs past the deadline
    t0 = time.monotonic()
    got = ctl.finish_prefetch(p, "timeout")
    assert time.monotonic() - t0 >= 0.25
    assert got == 4
    gate.release(10)
    ctl.drain()
    s.hicache.validate()
    assert s.hicache.match_prefix(t)["host_len"] == 4 * PS
    ctl.close()


def _served(s, seed):
    """A new request is still served on L1/L2: allocate, write, insert, match on the device."""
    t = tokens(2 * PS, seed=seed)
    want = insert(s, t, "random", seed=seed)
    m = s.hicache.match_prefix(t)
    assert m["device_len"] == 2 * PS
    from l3_support import read

    assert same(read(s, m["device_pages"]), want)


def test_master_killed_during_a_put(master, caplog):
    s = stack("mooncake", master, write_policy="write_through")
    killed = []

    def kill(op, n):
        if not killed:
            master.kill()
            killed.append(n)

    gate = Gate(s.storage.backend, hook=kill, gated=("put",))
    ctl = controller(s, gate, retry_interval=0.2)
    t = tokens(3 * PS, seed=1)
    with caplog.at_level(logging.WARNING, logger="sparsetier.l3"):
        want = insert(s, t, "random")
        ctl.drain()
    c = s.hicache
    stats = c.storage_stats()
    assert not stats["online"] and stats["offline_events"] == 1
    assert stats["write_failures"] == 3 and stats["pages_written"] == 0
    assert "L3 off" in caplog.text
    # L1/L2 untouched: the request's pages still hit on the device with their data.
    m = c.match_prefix(t)
    assert m["device_len"] == 3 * PS
    from l3_support import read

    assert same(read(s, m["device_pages"]), want)
    _served(s, seed=2)
    assert ctl.match_prefix(t)["storage_pages"] == 0  # off: the store is not asked
    # The store comes back: L3 is used again.
    master.start()
    deadline = time.monotonic() + 30
    while not ctl.online and time.monotonic() < deadline:
        time.sleep(0.25)
        ctl.poll()
    assert ctl.online
    for attempt in range(40):  # the client re-mounts its segment a moment after a restart
        insert(s, tokens(2 * PS, seed=100 + attempt), "random", seed=3)
        ctl.drain()
        if c.storage_stats()["pages_written"] >= 2:
            break
        time.sleep(0.25)
    assert c.storage_stats()["pages_written"] >= 2
    c.validate()
    ctl.close()


def test_master_killed_during_a_prefetch(master):
    s = stack("mooncake", master)
    t = tokens(8 * PS, seed=4)
    insert(s, t, "random")
    push_to_l3(s)

    def kill(op, n):
        if n == 2:
            master.kill()

    gate = Gate(s.storage.backend, hook=kill)
    ctl = controller(s, gate, chunk_pages=2)
    p = ctl.prefetch(t, 0, 8)
    got = ctl.finish_prefetch(p, "wait_complete")
    assert got == 2, "the chunk read before the kill arrived; nothing after it"
    ctl.drain()
    c = s.hicache
    assert not ctl.online and c.storage_stats()["offline_events"] == 1
    c.validate()
    assert c.stats()["host_in_tree"] == 2
    _served(s, seed=9)
    c.validate()
    ctl.close()


def test_write_back_keeps_a_page_until_it_is_stored(tmp_path):
    s = stack("file", tmp_path)
    c = s.hicache
    t = tokens(3 * PS)
    insert(s, t)
    c.evict_device(10**6)
    assert c.evict_host(10**6) == 0, "the write runs first"
    keys = c.storage_keys(t)
    assert c.storage_states(keys) == ["writing"] * 3
    assert c.stats()["host_in_tree"] == 3
    with pytest.raises(st.ConfigError):
        c.drop_namespace(0)  # locked while written
    s.storage.drain()
    assert c.storage_states(keys) == ["stored"] * 3
    assert c.evict_host(10**6) == 3
    c.validate()
    # With the store off, write-back evicts without writing, and says so.
    u = tokens(2 * PS, seed=1)
    insert(s, u)
    lowlevel.L3Protocol(c).set_online(False)
    c.evict_device(10**6)
    assert c.evict_host(10**6) == 2
    assert c.storage_stats()["evicted_unstored"] == 2
    s.storage.close()


def test_write_through_writes_when_the_host_copy_is_ready(tmp_path):
    s = stack("file", tmp_path, write_policy="write_through")
    c = s.hicache
    t = tokens(3 * PS)
    insert(s, t)
    assert c.storage_states(c.storage_keys(t)) == ["writing"] * 3
    s.storage.drain()
    c.evict_device(10**6)
    assert c.evict_host(10**6) == 3  # already stored: leaves at once
    assert s.storage.match_prefix(t)["storage_pages"] == 3
    s.storage.close()


def test_bad_configuration_is_refused(tmp_path):
    with pytest.raises(st.ConfigError) as e:
        stack("file", tmp_path, write_policy="write_around")
    assert e.value.field == "write_policy"
    with pytest.raises(st.ConfigError) as e:
        stack("file", tmp_path, colour="blue")
    assert e.value.field == "storage_config"
    with pytest.raises(st.ConfigError) as e:
        st.build_sparse_stack([st.PoolSpec("KV", 1, 1, 8, "bf16", PS, 8)], storage_backend="s3")
    assert e.value.field == "storage_backend"
    with pytest.raises(st.ConfigError) as e:
        st.build_sparse_stack(
            [st.PoolSpec("KV", 1, 1, 8, "bf16", PS, 8)], storage_config={"path": "x"}
        )
    assert e.value.field == "storage_config"
    with pytest.raises(st.ConfigError) as e:
        stack("file", tmp_path, write_ahead=2.0)
    assert e.value.field == "write_ahead"
    with pytest.raises(st.ConfigError) as e:
        stack("file", tmp_path, prefetch_policy="eventually")
    assert e.value.field == "prefetch_policy"
    s = stack("file", tmp_path)
    with pytest.raises(st.ConfigError) as e:
        lowlevel.L3Protocol(s.hicache).plan_prefetch(tokens(2 * PS), 1, 5)
    assert e.value.field == "n_pages"
    with pytest.raises(st.UnknownTransferError):
        lowlevel.L3Protocol(s.hicache).prefetch_commit(12345, 1)
    with pytest.raises(st.ConfigError):
        s.hicache.storage_states(["not-a-key"])
    s.storage.close()


def test_plan_shows_the_l3_tier(capsys):
    from sparsetier.tools.cli import main

    args = ["plan", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--device-pages"]
    assert main([*args, "64", "--storage-backend", "file"]) == 0
    assert "L3: file store under the host tier" in capsys.readouterr().out


def test_write_ahead_keeps_host_pages_clean(tmp_path):
    s = stack("file", tmp_path, write_ahead=0.5)
    c = s.hicache
    for i in range(3):
        insert(s, tokens(4 * PS, seed=i))
    c.evict_device(10**6)  # 12 host-only pages of 16: free 4 < half the tier
    s.storage.poll()  # plans writes for the coldest pages
    assert c.storage_stats()["writes_planned"] >= 1
    s.storage.drain()
    # Eviction now finds stored victims and frees at once, without waiting for a write.
    assert c.evict_host(4) >= 4
    c.validate()
    s.storage.close()


def test_a_skipped_backup_is_retried():
    s = st.build_sparse_stack(
        [st.PoolSpec("KV", 1, 1, 8, "bf16", PS, 9)], hicache_ratio=1.0, device_reserve=1
    )
    c = s.hicache
    a, b = tokens(4 * PS, seed=1), tokens(4 * PS, seed=2)
    insert(s, a)
    insert(s, b)
    c.evict_device(10**6)
    m = c.match_prefix(a)
    c.lock(m["last_node"])  # a's host pages cannot leave
    m = c.match_prefix(b)
    c.lock(m["last_node"])
    u = tokens(4 * PS, seed=3)
    insert(s, u)  # host tier full and locked: the backup is skipped
    assert c.stats()["totals"]["backups_skipped"] >= 1
    assert c.evict_device(4) == 0, "no host copy: the pages cannot leave the device"
    c.unlock(c.match_prefix(a)["last_node"])
    c.flush()  # retried: a leaves the host tier for it
    c.drain()
    assert c.evict_device(4) == 4
    c.validate()


def test_bench_l3_runs_and_l3_only_adds_hits(tmp_path):
    from sparsetier.tools import bench_l3

    rows = bench_l3.throughput(["file"], pages=16, reps=2)
    assert [r["op"] for r in rows] == ["put", "get"]
    assert all(r["gbps"] > 0 and r["segments_per_page"] >= 1 for r in rows)
    none, file = bench_l3.serve(["file"], requests=40, device_pages=256, host_pages=512)
    assert none["l3_hit"] == 0 and none["failed"] == 0 and file["failed"] == 0
    # Same stream, same tiers above: L3 can only add hits (device and host hit the same).
    assert file["hit"] >= none["hit"]
    assert file["recompute_pages_mean"] <= none["recompute_pages_mean"]
    assert "serve loop" in bench_l3.format_report({"throughput": rows, "serve": [none, file]})


def test_drain_leaves_nothing_in_flight_even_when_settling_plans_more(tmp_path):
    s = stack("file", tmp_path, write_ahead=1.0)  # every settle may plan more write-ahead
    c = s.hicache
    for i in range(3):
        insert(s, tokens(4 * PS, seed=i))
    c.evict_device(10**6)
    s.storage.drain()
    st_ = c.storage_stats()
    assert st_["writes_in_flight"] == 0 and st_["prefetches_in_flight"] == 0
    assert st_["pages_written"] == 12
    s.storage.close()


def test_the_master_is_found_beside_the_interpreter_without_activation(tmp_path):
    """A venv used without activation (its bin not on PATH) still finds its mooncake_master."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    beside = Path(sys.executable).parent / "mooncake_master"
    if not beside.is_file():
        pytest.skip("mooncake_master not installed beside this interpreter")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PATH")}
    env["PATH"] = "/usr/bin:/bin"
    code = "from sparsetier.l3.mooncake import find_master; print(find_master())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(beside)
