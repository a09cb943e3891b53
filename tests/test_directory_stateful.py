"""Hypothesis state machine: the ResidencyDirectory binding against a pure-Python reference
model. The model predicts every outcome (success or error class), every transfer and handle
id, and each object's states and pins. Invariants checked after every step: page conservation
on both tiers (free + used + quarantined = capacity), no slot held by two objects, pinned
objects never evicted, Loading objects carry exactly one in-flight transfer, nothing Ready
without a slot, and nothing mapped to a slot after its load failed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import sparsetier as sp
from sparsetier import lowlevel
from sparsetier.lowlevel import object_keys

DEVICE, HOST, PAGES, NAMESPACES, PRELOADED = 4, 8, 5, 2, 4


@dataclass
class Obj:
    key: tuple[int, int]
    dev: str = "Ready"  # Absent | Loading | Ready
    dev_t: int | None = None
    host: str = "None"  # None | Writing | Ready
    host_t: int | None = None
    pins: int = 0
    dropped: bool = False

    def evictable(self):
        return self.dev == "Ready" and self.host == "Ready" and self.pins == 0 and not self.dropped

    def reapable(self):
        return self.dropped and self.pins == 0 and self.dev != "Loading" and self.host != "Writing"


@dataclass
class Transfer:
    load: bool
    objs: list[int]
    state: str = "flight"  # flight | done | failed
    refs: int = 0


@dataclass
class Model:
    objs: dict[int, Obj] = field(default_factory=dict)
    index: dict[tuple[int, int], int] = field(default_factory=dict)
    uid: int = 0
    lru: list[int] = field(default_factory=list)
    dev_free: int = DEVICE
    host_free: int = HOST
    quarantine: dict[int, tuple[int, int]] = field(default_factory=dict)
    transfers: dict[int, Transfer] = field(default_factory=dict)
    handles: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    next_tid: int = 1
    next_hid: int = 1
    dropped: set[int] = field(default_factory=set)

    # -- helpers mirroring the directory's single call sites
    def settle(self, u):
        o = self.objs[u]
        if o.evictable():
            if u not in self.lru:
                self.lru.append(u)
        elif o.reapable():
            self.reap(u)

    def reap(self, u):
        if u in self.lru:
            self.lru.remove(u)
        o = self.objs.pop(u)
        self.dev_free += o.dev == "Ready"
        self.host_free += o.host == "Ready"

    def take_slot(self):
        if self.dev_free:
            self.dev_free -= 1
        else:
            self.objs[self.lru.pop(0)].dev = "Absent"

    def lookup(self, k):
        """The object of key k, or the error class the directory raises for it."""
        if k in self.index:
            return self.index[k], None
        return None, sp.NamespaceDroppedError if k[0] in self.dropped else sp.NotResidentError

    def new_tid(self, load, objs):
        t = self.next_tid
        self.next_tid += 1
        self.transfers[t] = Transfer(load, objs)
        return t

    def finish(self, t, state):
        tr = self.transfers[t]
        tr.state, tr.objs = state, []
        if tr.refs == 0:
            del self.transfers[t]

    # -- operations: return None on success, else the expected exception class
    def allocate(self, keys):
        seen = set()
        for k in keys:  # checked key by key, in order, as the directory does
            if k[0] in self.dropped:
                return sp.NamespaceDroppedError
            if k in self.index or k in seen:
                return sp.KeyExistsError
            seen.add(k)
        if len(keys) > self.dev_free + len(self.lru):
            return sp.OutOfPagesError
        for k in keys:
            self.take_slot()
            self.objs[self.uid] = Obj(k)
            self.index[k] = self.uid
            self.uid += 1
        return None

    def resolve(self, keys):
        order = []
        for k in keys:
            u, err = self.lookup(k)
            if err is not None:
                return err
            if u in order:
                continue
            o = self.objs[u]
            if o.dev == "Absent" and o.host != "Ready":
                return sp.NotResidentError
            order.append(u)
        loads = [u for u in order if self.objs[u].dev == "Absent"]
        keep = sum(self.objs[u].evictable() for u in order)
        if len(loads) > self.dev_free + len(self.lru) - keep:
            return sp.OutOfPagesError
        held, tids = [], []
        for u in order:
            o = self.objs[u]
            if o.dev == "Absent":
                continue
            if o.dev == "Loading" and o.dev_t not in tids:
                tids.append(o.dev_t)
            o.pins += 1
            held.append(u)
            if u in self.lru:
                self.lru.remove(u)
        if loads:
            t = self.new_tid(True, list(loads))
            for u in loads:
                self.take_slot()
                o = self.objs[u]
                o.dev, o.dev_t = "Loading", t
                o.pins += 1
                held.append(u)
            tids.append(t)
        for t in tids:
            self.transfers[t].refs += 1
        self.handles[self.next_hid] = (held, tids)
        self.next_hid += 1
        return None

    def complete(self, t, load):
        tr = self.transfers.get(t)
        if tr is None:
            return sp.UnknownTransferError
        if tr.state != "flight" or tr.load != load:
            return sp.TransferStateError
        for u in tr.objs:
            o = self.objs[u]
            if load:
                o.dev, o.dev_t = "Ready", None
            else:
                o.host, o.host_t = "Ready", None
            self.settle(u)
        self.finish(t, "done")
        return None

    def fail(self, t, ended):
        tr = self.transfers.get(t)
        if tr is None:
            return sp.UnknownTransferError
        if tr.state != "flight":
            return sp.TransferStateError
        objs = list(tr.objs)
        for u in objs:
            o = self.objs[u]
            if tr.load:
                o.dev, o.dev_t = "Absent", None
            else:
                o.host, o.host_t = "None", None
        self.quarantine[t] = (len(objs), 0) if tr.load else (0, len(objs))
        for u in objs:
            self.settle(u)
        self.finish(t, "failed")
        if ended:
            self.ended(t)
        return None

    def ended(self, t):
        if t not in self.quarantine:
            return sp.TransferStateError if t in self.transfers else sp.UnknownTransferError
        d, h = self.quarantine.pop(t)
        self.dev_free += d
        self.host_free += h
        return None

    def release(self, h):
        if h not in self.handles:
            return sp.UnknownHandleError
        objs, tids = self.handles.pop(h)
        for t in tids:
            tr = self.transfers[t]
            tr.refs -= 1
            if tr.refs == 0 and tr.state != "flight":
                del self.transfers[t]
        for u in objs:
            self.objs[u].pins -= 1
            self.settle(u)
        return None

    def backup(self, keys):
        order = []
        for k in keys:
            u, err = self.lookup(k)
            if err is not None:
                return err
            if u in order:
                continue
            order.append(u)
            if self.objs[u].dev != "Ready":
                return sp.InvalidTransitionError
        todo = [u for u in order if self.objs[u].host == "None"]
        if len(todo) > self.host_free:
            return sp.OutOfPagesError
        if todo:
            t = self.new_tid(False, list(todo))
            for u in todo:
                self.host_free -= 1
                self.objs[u].host, self.objs[u].host_t = "Writing", t
        return None

    def evict(self, n):
        out = []
        while len(out) < n and self.lru:
            u = self.lru.pop(0)
            self.objs[u].dev = "Absent"
            self.dev_free += 1
            out.append(self.objs[u].key)
        return out

    def drop(self, ns):
        if ns in self.dropped:
            return sp.NamespaceDroppedError
        self.dropped.add(ns)
        for k, u in [(k, u) for k, u in self.index.items() if k[0] == ns]:
            del self.index[k]
            self.objs[u].dropped = True
            if u in self.lru:
                self.lru.remove(u)
            if self.objs[u].reapable():
                self.reap(u)
        return None


def as_keys(pairs):
    return object_keys([p[0] for p in pairs], [p[1] for p in pairs])


key_lists = st.lists(
    st.tuples(st.integers(0, NAMESPACES - 1), st.integers(0, PAGES - 1)), min_size=1, max_size=4
)


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.d = lowlevel.ResidencyDirectory(DEVICE, HOST, object_bytes=4096)
        self.m = Model()
        # The directory's transfer ids in the order it issued them: the model numbers them
        # 1, 2, ...; the directory draws them from the process-wide serial (an id of one
        # directory is never another's).
        self.tids: list[int] = []
        # Host-only objects from the start, so loads, joins and failures happen early.
        for page in range(PRELOADED):
            k = object_keys(0, [page])
            self.d.allocate(k)
            t = self.d.backup(k).transfer_id
            self.tids.append(t)
            self.d.backup_complete(t)
            self.d.evict(1)
            self.m.objs[self.m.uid] = Obj((0, page), dev="Absent", host="Ready")
            self.m.index[(0, page)] = self.m.uid
            self.m.uid += 1
        self.m.host_free -= PRELOADED
        self.m.next_tid += PRELOADED
        self.handles = {}

    def check(self, expected, call):
        if expected is None:
            return call()
        with pytest.raises(expected):
            call()
        return None

    def real(self, t: int) -> int:
        """The directory's id of model transfer `t` (one never issued past the last)."""
        return self.tids[t - 1] if t - 1 < len(self.tids) else 2**62 + t

    def issued(self, plans) -> None:
        for t in plans:
            if t is not None:
                assert t not in self.tids, "a transfer id issued twice"
                self.tids.append(t)
        assert len(self.tids) + 1 == self.m.next_tid

    def pick_tid(self, data):
        live = [t for t, tr in self.m.transfers.items() if tr.state == "flight"]
        pool = live * 3 + list(self.m.transfers) + [self.m.next_tid + 5]
        return data.draw(st.sampled_from(pool))

    @rule(keys=key_lists)
    def allocate(self, keys):
        self.check(self.m.allocate(keys), lambda: self.d.allocate(as_keys(keys)))

    @rule(keys=key_lists)
    def resolve(self, keys):
        hid = self.m.next_hid
        r = self.check(self.m.resolve(keys), lambda: self.d.resolve(as_keys(keys)))
        if r is not None:
            assert all(h.id != r.handle.id for h in self.handles.values())
            assert len(r.slots) == len(keys)
            self.handles[hid] = r.handle
            self.issued([p.transfer_id for p in r.loads])

    @rule(data=st.data())
    def complete(self, data):
        t = self.pick_tid(data)
        self.check(self.m.complete(t, True), lambda: self.d.complete(self.real(t)))

    @rule(data=st.data())
    def backup_complete(self, data):
        t = self.pick_tid(data)
        self.check(self.m.complete(t, False), lambda: self.d.backup_complete(self.real(t)))

    @rule(data=st.data(), ended=st.booleans())
    def fail(self, data, ended):
        t = self.pick_tid(data)
        self.check(self.m.fail(t, ended), lambda: self.d.fail(self.real(t), "model", ended=ended))

    @rule(data=st.data())
    def transfer_ended(self, data):
        t = data.draw(st.sampled_from([*self.m.quarantine, self.m.next_tid + 5]))
        self.check(self.m.ended(t), lambda: self.d.transfer_ended(self.real(t)))

    @rule(data=st.data())
    def release(self, data):
        if not self.handles:
            return
        hid = data.draw(st.sampled_from(sorted(self.handles)))
        handle = self.handles[hid]
        if self.m.release(hid) is None:
            self.d.release(handle)
        else:
            with pytest.raises(sp.UnknownHandleError):
                self.d.release(handle)
        if data.draw(st.booleans()):  # sometimes keep it around to try a double release
            del self.handles[hid]

    @rule(keys=key_lists)
    def backup(self, keys):
        plan = self.check(self.m.backup(keys), lambda: self.d.backup(as_keys(keys)))
        if plan is not None:
            self.issued([plan.transfer_id])

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        want = self.m.evict(n)
        got = self.d.evict(n)
        assert [(int(r[0]), int(r[2])) for r in got] == want

    @rule(ns=st.integers(0, NAMESPACES))
    def drop_namespace(self, ns):
        self.check(self.m.drop(ns), lambda: self.d.drop_namespace(ns))

    @invariant()
    def agrees_with_model(self):
        self.d.validate()
        s = self.d.stats()
        qd = sum(q[0] for q in self.m.quarantine.values())
        qh = sum(q[1] for q in self.m.quarantine.values())
        assert s["device_free"] + s["device_used"] + s["device_quarantined"] == s["device_capacity"]
        assert s["host_free"] + s["host_used"] + s["host_quarantined"] == s["host_capacity"]
        assert (s["device_free"], s["device_quarantined"]) == (self.m.dev_free, qd)
        assert (s["host_free"], s["host_quarantined"]) == (self.m.host_free, qh)
        assert s["objects"] == len(self.m.objs)
        assert s["evictable"] == len(self.m.lru)
        slots = set()
        for ns in range(NAMESPACES):
            for page in range(PAGES):
                got = self.d.state((ns, 0, page, -1))
                u = self.m.index.get((ns, page))
                if u is None:
                    assert got is None, (ns, page)
                    continue
                o = self.m.objs[u]
                assert (got["device"], got["host"], got["pins"]) == (o.dev, o.host, o.pins)
                if o.dev == "Loading":
                    assert got["transfer_id"] == self.real(o.dev_t)
                if o.dev == "Absent":
                    assert got["device_slot"] is None  # nothing mapped after a failed load
                else:
                    assert got["device_slot"] not in slots  # no slot held twice
                    slots.add(got["device_slot"])
                if o.pins:
                    assert o.dev != "Absent" or o.dev_t is None


TestDirectoryMachine = DirectoryMachine.TestCase
