"""The hierarchical cache's state machine (``test_hicache_stateful``) with an L3 tier in the
interleavings: write plans executed and settled at any point, prefetches under every policy,
objects corrupted, the store gone and back. On the real file store.

Beyond the base machine's checks (data of every page a match returns, locked prefixes keep
their pages, conservation on both tiers, tree invariants), after every step:
- no prefix comes back from L3 that was never inserted (`model_len` bounds every match);
- pages restored from L3 carry the data written for their prefix (`check_pages`);
- between steps every copy and L3 write has settled (so what is drawn never depends on thread
  timing) and no prefetch holds a host page.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_hicache_stateful import PS, HiCacheMachine

import sparsetier as sp


class L3Machine(HiCacheMachine):
    POLICY = "write_back"

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="sparsetier-l3-"))
        self.store = self.dir / "store"
        pools = [
            sp.PoolSpec("KV", 2, 1, 4, "bf16", PS, 13),
            sp.PoolSpec("INDEXER", 2, 1, 4, "bf16", PS, 13),
            sp.PoolSpec("DRAFT", 1, 1, 4, "bf16", PS, 13),
        ]
        self.s = sp.build_sparse_stack(
            pools,
            hicache_ratio=1.5,
            layout="layer_page_first",
            storage_backend="file",
            storage_config={"path": str(self.store), "write_policy": self.POLICY},
        )
        self.c = self.s.hicache
        self.l3 = self.s.storage
        self.l3.retry_interval = 0.0

    @rule()
    def l3_poll(self):
        self.l3.poll()

    @rule()
    def l3_drain(self):
        self.l3.drain()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]))
    def prefetch(self, data, policy):
        seq = data.draw(st.sampled_from(self.seqs))
        m = self.l3.match_prefix(seq)
        assert m["device_len"] + m["host_len"] + m["storage_pages"] * PS <= self.model_len(seq)
        if m["storage_pages"] == 0:
            return
        start = (m["device_len"] + m["host_len"]) // PS
        p = self.l3.prefetch(seq, start, m["storage_pages"])
        if p is not None:
            # The reads finish before the policy is applied: what a policy takes must not
            # depend on thread timing here (hypothesis replays a case expecting the same
            # draws); partial arrivals are tested deterministically in test_l3.py.
            p.done.wait()
            got = self.l3.finish_prefetch(p, policy)
            assert got <= p.pages
        self.l3.drain()
        m = self.c.match_prefix(seq)
        assert m["device_len"] + m["host_len"] <= self.model_len(seq)
        # Bring what came from L3 to the device and check every byte pattern.
        if m["host_len"] and self.c.load_back(m["last_node"]) is not None:
            self.submissions += len(self.c.flush())
            self.c.drain()
            self.check_pages(seq, self.c.match_prefix(seq)["device_pages"])

    @rule()
    def spill(self):
        """Everything unlocked leaves L1 and L2 (through L3 under write-back)."""
        self.submissions += len(self.c.flush())
        self.c.drain()
        self.l3.drain()
        self.c.evict_device(10**6)
        self.c.evict_host(10**6)
        self.l3.drain()
        self.c.evict_host(10**6)

    @rule(pick=st.integers(0, 2**16), offset=st.integers(0, 2**16))
    def corrupt(self, pick, offset):
        # Fixed-shape arguments: which files exist may not change what is drawn.
        files = sorted(self.store.rglob("*.page")) if self.store.is_dir() else []
        if not files:
            return
        f = files[pick % len(files)]
        raw = bytearray(f.read_bytes())
        raw[offset % len(raw)] ^= 0x40
        f.write_bytes(bytes(raw))

    @precondition(lambda self: self.store.is_dir())
    @rule()
    def store_gone(self):
        self.l3.drain()
        self.store.rename(self.dir / "away")

    @precondition(lambda self: (self.dir / "away").is_dir())
    @rule()
    def store_back(self):
        (self.dir / "away").rename(self.store)
        self.l3.poll()

    @rule(other_version=st.booleans())
    def drop_namespace(self, other_version):
        # L3 keeps a dropped namespace's pages (its keys name it): they stay valid prefixes.
        self.l3.drain()
        kept = set(self.inserted)
        HiCacheMachine.drop_namespace(self, other_version)
        self.inserted |= kept

    @invariant()
    def settled_between_steps(self):
        # Every rule starts from settled copies and L3 writes: which pages are stored,
        # pinned or evictable must not depend on how far the copy and L3 threads got, or
        # hypothesis sees a different case on replay (in-flight writes across calls are
        # tested in test_l3.py and the Rust storage tests). No prefetch holds a page here.
        self.c.drain()  # landed backups plan write-through writes...
        self.l3.drain()  # ...which run here
        assert self.c.storage_stats()["prefetches_in_flight"] == 0
        assert self.c.storage_stats()["writes_in_flight"] == 0
        self.c.validate()

    def teardown(self):
        self.l3.close()
        super().teardown()
        shutil.rmtree(self.dir, ignore_errors=True)


class L3WriteThroughMachine(L3Machine):
    POLICY = "write_through"


TestL3Machine = L3Machine.TestCase
TestL3Machine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestL3WriteThroughMachine = L3WriteThroughMachine.TestCase
TestL3WriteThroughMachine.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
