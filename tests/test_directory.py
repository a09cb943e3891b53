"""The residency directory through the Python binding: the source's worked examples, the
error cases, and threads hammering one directory."""

import threading

import numpy as np
import pytest

import sparsetier as st
from sparsetier import lowlevel
from sparsetier.lowlevel import object_keys

KIB = 1024


def make(device=16, host=16, object_bytes=64 * KIB):
    return lowlevel.ResidencyDirectory(device, host, object_bytes=object_bytes)


def host_only(d, pages, ns=7, layer=3):
    """Objects with a ready host copy and no device copy."""
    for p in pages:
        k = object_keys(ns, [p], layer)
        d.allocate(k)
        d.backup_complete(d.backup(k).transfer_id)
        assert d.evict(1).tolist() == k.tolist()


def test_walkthrough_17_42_81():
    d = make()
    d.allocate(object_keys(7, [17], layer=3))  # 17: Ready on the device
    host_only(d, [42, 81])  # 42 and 81: host copies only
    other = d.resolve(object_keys(7, [81], layer=3))  # another request starts loading 81
    r = d.resolve(object_keys(7, [17, 42, 81], layer=3))
    m = r.metrics
    assert (m["ready"], m["absent"], m["loading"], m["inflight_reuse"]) == (1, 1, 1, 1)
    assert r.joined == [other.loads[0].transfer_id]
    assert len(r.loads) == 1 and r.loads[0].device_slots.tolist() == [r.slots[1]]
    assert r.slots[2] == other.slots[0]
    assert d.state((7, 0, 42, 3))["device"] == "Loading"
    d.mark_submitted(r.loads[0].transfer_id)
    d.complete(other.loads[0].transfer_id)
    d.complete(r.loads[0].transfer_id)
    d.wait(r.loads[0].transfer_id)
    record = d.release(r.handle)
    assert record["submitted_ns"] is not None
    assert (
        record["resolved_ns"]
        <= record["submitted_ns"]
        <= record["ready_ns"]
        <= record["consumed_ns"]
    )
    d.release(other.handle)
    with pytest.raises(st.UnknownHandleError) as e:
        d.release(r.handle)
    assert e.value.field == "handle"
    d.validate()


def test_seven_of_ten_resident_restore_192_kib():
    d = make(32, 32)
    host_only(d, [0, 1, 2])
    d.allocate(object_keys(7, range(3, 10), layer=3))
    r = d.resolve(object_keys(7, range(10), layer=3))
    assert r.metrics["bytes_transferred"] == 192 * KIB
    assert r.metrics["device_byte_hit_rate"] == pytest.approx(0.7)


def test_scattered_tokens_amplify_64x_and_shared_pages_less():
    tp = lowlevel.token_pages(np.arange(10) * 64 + 9, page_size=64, token_bytes=KIB)
    assert (tp["bytes_needed"], tp["bytes_to_move"], tp["read_amplification"]) == (
        10 * KIB,
        640 * KIB,
        64.0,
    )
    d = make(32, 32)
    host_only(d, range(10))
    r = d.resolve(object_keys(7, tp["pages"], layer=3), bytes_needed=tp["bytes_needed"])
    assert r.metrics["moved_per_needed"] == 64.0  # every page moved: = read amplification
    shared = lowlevel.token_pages([0, 1, 2, 3, 64, 65], page_size=64, token_bytes=KIB)
    assert shared["pages"].tolist() == [0, 1]
    assert shared["read_amplification"] == pytest.approx(128 / 6)


def test_failure_quarantine_and_retry():
    d = make(4, 4)
    host_only(d, [1, 2])
    r = d.resolve(object_keys(7, [1, 2], layer=3))
    t = r.loads[0].transfer_id
    d.fail(t, "injected")
    with pytest.raises(st.TransferFailedError) as e:
        d.wait(t)
    assert e.value.reason == "injected"
    s = d.stats()
    assert (s["device_quarantined"], s["device_free"]) == (2, 2)
    assert d.state((7, 0, 1, 3))["device"] == "Absent"
    with pytest.raises(st.TransferStateError):
        d.complete(t)
    d.transfer_ended(t)
    with pytest.raises(st.TransferStateError):
        d.transfer_ended(t)
    d.release(r.handle)
    with pytest.raises(st.UnknownTransferError):
        d.complete(t)
    retry = d.resolve(object_keys(7, [1, 2], layer=3))
    d.complete(retry.loads[0].transfer_id)
    assert d.stats()["totals"]["retries"] == 2
    assert d.stats()["totals"]["failed_transfers"] == 1
    d.validate()


def test_errors_are_typed():
    d = make(2, 8)
    d.allocate(object_keys(1, [0]))
    host_only(d, [5, 6], ns=1, layer=-1)
    with pytest.raises(st.NotResidentError):
        d.resolve(object_keys(1, [5, 99]))
    with pytest.raises(st.OutOfPagesError) as e:
        d.resolve(object_keys(1, [5, 6]))
    assert (e.value.tier, e.value.requested, e.value.free, e.value.evictable) == ("device", 2, 1, 0)
    with pytest.raises(st.KeyExistsError):
        d.allocate(object_keys(1, [0]))
    with pytest.raises(st.InvalidTransitionError):
        d.backup(object_keys(1, [5]))
    assert d.drop_namespace(1) == (3, 0)
    with pytest.raises(st.NamespaceDroppedError):
        d.resolve(object_keys(1, [0]))
    with pytest.raises(st.NamespaceDroppedError):
        d.drop_namespace(1)
    with pytest.raises(st.UnknownTransferError):
        d.complete(12345)
    with pytest.raises(st.UnknownTransferError):
        d.fail(12345, "nope")
    with pytest.raises(st.WaitTimeoutError):
        host_only(d, [3], ns=2)
        d.wait(d.resolve(object_keys(2, [3], layer=3)).loads[0].transfer_id, timeout=0.01)
    d.validate()


@pytest.mark.parametrize(
    ("keys", "exc", "field"),
    [
        (np.zeros((0, 4), dtype=np.int64), st.ConfigError, "keys"),
        (np.zeros((3, 3), dtype=np.int64), st.ConfigError, "keys.shape"),
        ([[1, 0, -1, 0]], st.OutOfRangeError, "keys[0].page"),
        ([[-1, 0, 0, 0]], st.OutOfRangeError, "keys[0].namespace"),
        ([[1, 0, 0, 1 << 20]], st.OutOfRangeError, "keys[0].layer"),
        ([[1, 1 << 40, 0, 0]], st.OutOfRangeError, "keys[0].version"),
        ("seventeen", st.ConfigError, "keys"),
    ],
)
def test_bad_keys(keys, exc, field):
    d = make()
    for op in (d.resolve, d.allocate, d.backup):
        with pytest.raises(exc) as e:
            op(keys)
        assert e.value.field == field


def test_bad_arguments():
    with pytest.raises(st.ConfigError):
        lowlevel.ResidencyDirectory(0, 4, object_bytes=1)
    with pytest.raises(st.ConfigError):
        lowlevel.ResidencyDirectory(4, 4, object_bytes=0)
    with pytest.raises(st.ConfigError):
        lowlevel.ResidencyDirectory(4, 4, object_bytes=1, device_reserve=4)
    d = make()
    with pytest.raises(st.OutOfRangeError):
        d.complete(-3)
    with pytest.raises(st.ConfigError):
        d.release("handle")
    with pytest.raises(st.ConfigError):
        d.evict(-1)
    with pytest.raises(st.ConfigError):
        d.wait(1, timeout=-1.0)
    with pytest.raises(st.ConfigError):
        lowlevel.token_pages([1, 2], page_size=0, token_bytes=1)


def test_threads_hammer_one_directory():
    d = make(device=24, host=256)
    host_only(d, range(64))
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(400):
                keys = object_keys(7, rng.integers(0, 64, size=rng.integers(1, 6)), layer=3)
                try:
                    r = d.resolve(keys)
                except st.OutOfPagesError:
                    continue
                for lp in r.loads:
                    if rng.random() < 0.15:
                        d.fail(lp.transfer_id, "stress", ended=bool(rng.random() < 0.5))
                    else:
                        d.complete(lp.transfer_id)
                for t in r.joined:
                    try:
                        d.wait(t, timeout=0.05)
                    except (st.TransferFailedError, st.WaitTimeoutError):
                        pass
                if rng.random() < 0.2:
                    d.evict(2)
                d.release(r.handle)
        except Exception as e:  # surfaced below with the thread's seed
            errors.append((seed, e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    d.validate()
    s = d.stats()
    assert (s["pins"], s["handles"]) == (0, 0)
    assert s["device_free"] + s["device_used"] + s["device_quarantined"] == s["device_capacity"]
