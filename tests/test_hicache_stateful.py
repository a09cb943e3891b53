"""Hypothesis state machine over HiCache with the cpu engine: insert, match, lock, unlock,
evict_device, evict_host, load-back, completion and failure of transfers.

The reference model is a dict of the inserted prefixes (page by page). Which nodes LRU
eviction picks is the tree's business, so the model bounds what may match rather than
predicting it exactly, and checks exactly what must hold whatever eviction did:

- right after an insert, the sequence matches in full (on the device, or loading);
- a match never exceeds what the model says was inserted;
- a locked prefix keeps its device pages and its host pages;
- every device page a match returns holds the data written for that prefix, in KV, Indexer-K
  and draft alike (so KV and Indexer-K of the same tokens are on the same tier, and a restored
  page equals the page backed up);
- after every step: the tree's invariants (no page owned twice, LRU membership, device
  residency prefix-closed) and free + used = capacity on both tiers (`validate`).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import sparsetier as sp
from sparsetier import testing

PS = 2
PROMPTS = [np.arange(1, 1 + 2 * PS) * 7, np.arange(1, 1 + 3 * PS) * 11, np.arange(1, 1 + PS) * 13]


def pattern(prefix: np.ndarray, comp_salt: int) -> float:
    """A value exact in bf16 that identifies a prefix (its last page included)."""
    return float((hash((comp_salt, *prefix.tolist())) % 201) - 100)


SALT = {"KV": 1, "INDEXER": 2, "DRAFT": 3}


class HiCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        pools = [
            sp.PoolSpec("KV", 2, 1, 4, "bf16", PS, 13),
            sp.PoolSpec("INDEXER", 2, 1, 4, "bf16", PS, 13),
            sp.PoolSpec("DRAFT", 1, 1, 4, "bf16", PS, 13),
        ]
        self.s = sp.build_sparse_stack(pools, hicache_ratio=1.5, layout="layer_page_first")
        self.c = self.s.hicache
        self.inserted: set[tuple[int, ...]] = set()  # every page-aligned prefix inserted
        self.seqs: list[np.ndarray] = []
        self.locks: list[tuple[int, np.ndarray, int, int]] = []  # node, seq, device, total
        self.submissions = 0

    # -- helpers
    def model_len(self, seq: np.ndarray) -> int:
        n = 0
        for end in range(PS, len(seq) + 1, PS):
            if tuple(seq[:end].tolist()) not in self.inserted:
                break
            n = end
        return n

    def write(self, seq: np.ndarray, first_page: int, pages: np.ndarray) -> None:
        for i, page in enumerate(pages.tolist()):
            prefix = seq[: (first_page + i + 1) * PS]
            for comp, t in self.s.device_pools.items():
                t[:, :, page] = pattern(prefix, SALT[comp])

    def check_pages(self, seq: np.ndarray, pages: np.ndarray) -> None:
        for i, page in enumerate(pages.tolist()):
            prefix = seq[: (i + 1) * PS]
            for comp, t in self.s.device_pools.items():
                want = pattern(prefix, SALT[comp])
                assert (t[:, :, page] == want).all(), (comp, i, page)

    # -- rules
    @rule(
        p=st.integers(0, len(PROMPTS) - 1),
        suffix=st.lists(st.integers(1, 3), max_size=3 * PS),
        lock=st.booleans(),
        whole=st.booleans(),
        evict_between=st.integers(0, 3),
    )
    def insert(self, p, suffix, lock, whole, evict_between):
        seq = np.concatenate([PROMPTS[p], np.array(suffix, dtype=np.int64)])
        seq = seq[: len(seq) // PS * PS]
        if whole:
            # One call locks the match and allocates the rest; the match itself goes to insert
            # (its pages trusted while no device page was freed since, else checked).
            try:
                m = self.c.match_prefix(seq, alloc=True)
            except sp.OutOfPagesError:
                return  # everything else locked: the request would wait
            have, fresh = m.device_len // PS, m.new_pages
        else:
            m = self.c.match_prefix(seq)
            have = m["device_len"] // PS
            # The protocol: lock the match so that making room cannot evict its pages.
            self.c.lock(m["device_node"])
            try:
                fresh = self.c.alloc_device(len(seq) // PS - have)
            except sp.OutOfPagesError:
                self.c.unlock(m["device_node"])
                return  # everything else locked: the request would wait
        self.write(seq, have, fresh)
        # Other nodes evicted meanwhile free pages: the match's are then checked one by one.
        self.c.evict_device(evict_between)
        pages = m if whole else np.concatenate([m["device_pages"], fresh])
        # With lock, the inserted path comes back locked (as lock(last_node) after it).
        r = self.c.insert(seq, pages, lock=lock)
        self.c.unlock(m["device_node"])
        for end in range(PS, len(seq) + 1, PS):
            self.inserted.add(tuple(seq[:end].tolist()))
        self.seqs.append(seq)
        m = self.c.match_prefix(seq)
        # In full: on the device, or (where a load-back is in flight) about to be.
        assert m["device_len"] + m["host_len"] == len(seq), "a sequence just inserted matches"
        self.check_pages(seq, m["device_pages"])
        if lock:
            assert r.last_node == m["last_node"]
            self.locks.append((r.last_node, seq, m["device_len"], len(seq)))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def match(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        m = self.c.match_prefix(seq)
        assert m["device_len"] + m["host_len"] <= self.model_len(seq)
        self.check_pages(seq, m["device_pages"])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def lock(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        m = self.c.match_prefix(seq)
        if m["device_len"] + m["host_len"] == 0:
            return  # evicted from both tiers: the root, whose lock holds nothing
        self.c.lock(m["last_node"])
        self.locks.append((m["last_node"], seq, m["device_len"], m["device_len"] + m["host_len"]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, *_ = self.locks.pop(i)
        self.c.unlock(node)

    @rule(n=st.integers(1, 8))
    def evict_device(self, n):
        self.c.evict_device(n)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n):
        self.c.evict_host(n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), fail=st.booleans())
    def load_back(self, data, fail):
        seq = data.draw(st.sampled_from(self.seqs))
        m = self.c.match_prefix(seq)
        if m["host_len"] == 0:
            return
        if fail:
            testing.inject_copy_fault(
                self.s.engine, self.submissions, layer=data.draw(st.integers(0, 1)), fail="model"
            )
        if self.c.load_back(m["last_node"]) is None:
            return  # no room even after eviction: the request recomputes
        self.submissions += len(self.c.flush())

    @rule(other_version=st.booleans())
    def drop_namespace(self, other_version):
        """Drops a namespace: refused while locked or in flight; a dropped version forgets all
        its prefixes and frees every page. Namespace 1 (another model version) holds a copy."""
        ns = 1 if other_version else 0
        if ns == 1:
            seq = PROMPTS[0]
            m = self.c.match_prefix(seq, namespace=1)
            try:
                fresh = self.c.alloc_device(len(seq) // PS - m["device_len"] // PS)
            except sp.OutOfPagesError:
                return
            if m["device_len"]:
                self.c.free_device(fresh)
            else:
                self.c.insert(seq, fresh, namespace=1)
        busy = ns == 0 and bool(self.locks)
        try:
            self.c.drop_namespace(ns)
        except sp.ConfigError:
            assert busy or self.c.stats()["in_flight"] or self.pending(), "refused without cause"
            return
        assert not busy, "dropped a namespace with a locked node"
        assert self.c.match_prefix(PROMPTS[0], namespace=ns)["device_len"] == 0
        if ns == 0:
            self.inserted.clear()
            self.seqs.clear()

    def pending(self) -> bool:
        """Whether queued or in-flight transfers touch the tree (then a drop is refused)."""
        self.submissions += len(self.c.flush())
        return self.c.stats()["in_flight"] > 0

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), kind=st.sampled_from(["tree_page", "stale", "twice"]))
    def insert_pages_not_held(self, data, kind):
        """An insert naming a page its caller does not hold (one of the tree's, a stale
        allocation's, one named twice) is refused and changes nothing."""
        seq = data.draw(st.sampled_from(self.seqs))
        fresh_tokens = seq + 1000  # never inserted: every page would be new
        n = len(seq) // PS
        try:
            fresh = self.c.alloc_device(n)
        except sp.OutOfPagesError:
            return  # everything else locked
        given = fresh.pages.copy()
        if kind == "tree_page":
            m = self.c.match_prefix(seq)
            if m.device_len == 0:
                self.c.free_device(fresh)
                return
            given[-1] = m.device_pages[0]
        elif kind == "stale":
            self.c.free_device(fresh)
            given = fresh  # the allocation itself, its pages handed back
            try:
                fresh = self.c.alloc_device(n)  # the same pages, another receipt
            except sp.OutOfPagesError:
                return
        elif n > 1:
            given[-1] = given[0]
        else:
            self.c.free_device(fresh)
            return
        books = self.c.stats()
        try:
            self.c.insert(fresh_tokens, given)
        except sp.NotHeldError:
            pass
        else:
            raise AssertionError(f"{kind}: an insert of pages not held was accepted")
        assert self.c.stats() == books, "a refused insert changed the cache"
        self.c.free_device(fresh)

    @rule()
    def flush(self):
        self.submissions += len(self.c.flush())

    @rule()
    def settle(self):
        self.c.drain()

    # -- invariants
    @invariant()
    def conserved(self):
        self.c.validate()
        st_ = self.c.stats()
        assert (
            st_["device_free"] + st_["device_in_tree"] + st_["device_outstanding"]
            == st_["device_capacity"]
        )
        assert st_["host_free"] + st_["host_in_tree"] == st_["host_capacity"]

    @invariant()
    def locked_prefixes_keep_their_pages(self):
        for _node, seq, dev, total in self.locks:
            m = self.c.match_prefix(seq)
            assert m["device_len"] >= dev, "a locked prefix lost device pages"
            assert m["device_len"] + m["host_len"] >= total, "a locked prefix lost host pages"

    def teardown(self):
        self.c.drain()
        torch.set_num_threads(torch.get_num_threads())


TestHiCacheMachine = HiCacheMachine.TestCase
