"""The joined system (prefix cache + per-layer residency) through the Python binding, as a
hypothesis state machine.

The reference model is the stamp: every main-KV row and every Indexer-K row of token `t`
holds a value derived from (token id, position, layer), so a page written by one request and
found by another through the prefix tree must read back the same. Rules admit requests (over a
few shared system prompts, or as the next turn of a finished conversation: with and without
prefix hits), prefill them, run decode steps (random block or token selections per layer,
every selected row read back through the slot table), finish requests (inserting them, or
letting them go), evict both tiers (Indexer-K device pages, host pages, KV slots), and arm
load, restore and backup faults. `validate()` runs after every rule: no page held twice, page
conservation on every tier, pins and locks balanced; at the end nothing is pinned, locked, in
flight or left over.
"""

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import sparsetier as sp
from sparsetier import testing

PS, LAYERS, HEADS, DIM, IDIM = 4, 2, 1, 4, 4
SYSTEMS = [np.arange(1, 14) * 3, np.arange(1, 18) * 5 + 1]  # 13 and 17 tokens


def kv_stamp(tok: int, t: int, layer: int, plane: int) -> float:
    return float((tok * 7 + t * 3 + layer * 5 + plane) % 200)  # exact in bf16


def ik_stamp(tok: int, t: int, layer: int) -> float:
    return float((tok * 11 + t + layer * 13) % 200)


class JoinedMachine(RuleBasedStateMachine):
    LAYOUT = "layer_first"

    def __init__(self):
        super().__init__()
        kv = sp.PoolSpec("KV", 1, HEADS, DIM, "bf16", PS, 40)
        kv_host = sp.PoolSpec("KV", LAYERS, HEADS, DIM, "bf16", PS, 40)
        ik = sp.PoolSpec("INDEXER", LAYERS, 1, IDIM, "bf16", PS, 40)
        ik_host = ik.with_pages(40)
        self.layout = self.LAYOUT
        self.dev = torch.zeros(kv.shape(), dtype=torch.bfloat16)
        self.idx = torch.zeros(ik.shape(), dtype=torch.bfloat16)
        host_kv = torch.zeros(kv_host.shape(self.layout), dtype=torch.bfloat16)
        idx_host = torch.zeros(ik_host.shape(self.layout), dtype=torch.bfloat16)
        self.s = sp.StepScheduler.joined(
            sp.PageTransferBinding(self.dev, kv),
            sp.PageTransferBinding(host_kv, kv_host, self.layout),
            sp.TransferEngine("cpu"),
            indexer_device=sp.PageTransferBinding(self.idx, ik),
            indexer_host=sp.PageTransferBinding(idx_host, ik_host, self.layout),
            prefetch=True,
        )
        self.running: dict[int, list[int]] = {}  # rid -> tokens written
        self.finished: list[list[int]] = []  # inserted conversations, for next turns
        self.next_rid = 0
        self.faults = False

    # -- helpers ------------------------------------------------------------------------
    def write_rows(self, rid: int, first_page: int, slots, start: int, end: int) -> None:
        toks = self.running[rid]
        pages = self.s.indexer_pages(rid)
        for t in range(start, end):
            p, row = divmod(t, PS)
            for layer in range(LAYERS):
                slot = int(slots[layer, p - first_page])
                for plane in range(2):
                    self.dev[plane, 0, slot, row] = kv_stamp(toks[t], t, layer, plane)
                self.idx[0, layer, int(pages[p]), row] = ik_stamp(toks[t], t, layer)

    def check_indexer(self, rid: int) -> None:
        toks = self.running[rid]
        pages = self.s.indexer_pages(rid)
        assert len(pages) == -(-len(toks) // PS)
        for t in range(len(toks)):
            p, row = divmod(t, PS)
            for layer in range(LAYERS):
                got = float(self.idx[0, layer, int(pages[p]), row, 0, 0])
                assert got == ik_stamp(toks[t], t, layer), f"Indexer-K of {rid} at {t}"

    def end(self, rid: int, insert: bool) -> None:
        toks = self.running.pop(rid)
        if insert:
            self.s.finish_request(rid, np.array(toks, dtype=np.int64))
            self.finished.append(toks)
        else:
            self.s.finish_request(rid)

    def retry_after_drain(self, call):
        """`call`, retried once after every transfer has landed when it finds no room: whether
        room exists can depend on how far the copy threads got, and hypothesis replays a case
        expecting the same outcome (it reports a flaky strategy otherwise)."""
        try:
            return call()
        except sp.OutOfPagesError:
            self.s.drain()
            return call()

    # -- rules --------------------------------------------------------------------------
    @precondition(lambda self: len(self.running) < 3)
    @rule(
        system=st.integers(0, len(SYSTEMS) - 1),
        turn=st.integers(-1, 5),
        extra=st.integers(1, 12),
        seed=st.integers(0, 2**16),
    )
    def admit(self, system, turn, extra, seed):
        rng = np.random.default_rng(seed)
        if 0 <= turn < len(self.finished):
            base = list(self.finished[turn])  # the next turn of a conversation
        else:
            base = SYSTEMS[system].tolist()
        toks = base + rng.integers(1, 500, size=extra).tolist()
        if len(toks) > 44:
            return
        rid = self.next_rid
        self.next_rid += 1
        adm = self.s.admit(rid, np.array(toks, dtype=np.int64))
        matched = adm["matched_pages"] * PS
        assert (
            matched < len(toks)
            and adm["device_pages"] + adm["restored_pages"] == (adm["matched_pages"])
        )
        self.running[rid] = toks[:matched]
        try:
            for layer in range(LAYERS):
                self.s.wait_prefix(rid, layer)
        except (sp.CopyFailedError, sp.TransferFailedError):
            assert self.faults, "a restore failed with no fault armed"
            self.end(rid, insert=False)
            return
        self.check_indexer(rid)  # the matched pages' Indexer-K, restored or resident
        try:
            first, slots = self.retry_after_drain(lambda: self.s.extend(rid, len(toks) - matched))
        except sp.OutOfPagesError:
            self.end(rid, insert=False)  # the device holds too much not yet written through
            return
        self.running[rid] = toks
        self.write_rows(rid, first, slots, matched, len(toks))

    @precondition(lambda self: self.running)
    @rule(seed=st.integers(0, 2**32 - 1), token_mode=st.booleans())
    def step(self, seed, token_mode):
        rng = np.random.default_rng(seed)
        rids = np.array(sorted(self.running), dtype=np.int64)
        try:
            slots, rows = self.retry_after_drain(lambda: self.s.append(rids))
        except sp.OutOfPagesError:
            return
        for b, rid in enumerate(rids.tolist()):
            self.running[rid].append(int(rng.integers(1, 500)))
            t = len(self.running[rid]) - 1
            page = int(self.s.indexer_pages(rid)[t // PS])
            for layer in range(LAYERS):
                for plane in range(2):
                    self.dev[plane, 0, int(slots[b, layer]), int(rows[b])] = kv_stamp(
                        self.running[rid][t], t, layer, plane
                    )
                self.idx[0, layer, page, t % PS] = ik_stamp(self.running[rid][t], t, layer)
        unit, k = (1, 5) if token_mode else (PS, 3)
        failed: set[int] = set()
        for layer in range(LAYERS):
            sel = np.full((len(rids), k), -1, dtype=np.int64)
            for b, rid in enumerate(rids.tolist()):
                n = len(self.running[rid])
                entries = -(-n // unit)
                pick = rng.choice(entries, size=min(k, entries), replace=False)
                sel[b, : len(pick)] = np.sort(pick)
            try:
                plan, table = self.s.plan(layer, rids, sel, unit)
            except sp.OutOfPagesError:
                # Only failing write-throughs can fill this device: room cannot be made.
                assert self.faults, "a plan found no room with no fault armed"
                self.s.end_step()
                return
            bad, new = self.s.ready(plan)
            if new is not None:
                table = new
            assert not bad or self.faults, "rows failed with no fault armed"
            failed |= {rid for _, rid, _ in bad}
            for b, rid in enumerate(rids.tolist()):
                if rid in failed:
                    continue
                toks = self.running[rid]
                for j in range(k):
                    e = int(sel[b, j])
                    if e < 0:
                        continue
                    t0 = e * unit
                    for t in range(t0, min(t0 + unit, len(toks))):
                        slot = int(table[b, j])
                        got = float(self.dev[0, 0, slot, t % PS, 0, 0])
                        assert got == kv_stamp(toks[t], t, layer, 0), f"KV of {rid} at {t}"
            self.s.finish(plan)
        self.s.end_step()
        for rid in failed:
            self.end(rid, insert=False)
        for rid in list(self.running):
            self.check_indexer(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), insert=st.booleans(), flush=st.booleans())
    def finish(self, data, insert, flush):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.end(rid, insert)
        if flush:
            self.s.flush_finished()

    @rule(device=st.integers(0, 12), host=st.integers(0, 12), kv=st.integers(0, 24))
    def evict(self, device, host, kv):
        self.s.evict_prefix(device, host)
        testing.evict_device(self.s, kv)

    @rule(kind=st.sampled_from(["load", "restore", "backup"]), count=st.integers(1, 2))
    def fault(self, kind, count):
        testing.inject_faults(self.s, kind, count)
        self.faults = True

    @rule()
    def settle(self):
        self.s.poll()

    @invariant()
    def valid(self):
        # Rules start from settled copies: what fits on the device, and so which requests
        # run, must not depend on how far the copy threads got, or hypothesis sees a
        # different case on replay (a flaky strategy). Copies still overlap within a rule.
        self.s.drain()
        self.s.validate()

    def teardown(self):
        for rid in list(self.running):
            self.end(rid, insert=False)
        self.s.drain()
        self.s.validate()
        st_ = self.s.stats()
        assert (st_["pins"], st_["handles"], st_["transfers_in_flight"]) == (0, 0, 0)
        assert st_["device_quarantined"] == 0
        px = self.s.prefix_stats()
        assert px["finishing"] == 0 or self.faults
        # Every KV object left is a layer of a page the prefix tree holds.
        tree = px["host_capacity"] - px["host_free"]
        assert st_["objects"] == tree * LAYERS or px["finishing"] > 0


class JoinedPageFirstMachine(JoinedMachine):
    LAYOUT = "layer_page_first"


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestJoinedMachine = JoinedMachine.TestCase
TestJoinedMachine.settings = SETTINGS
TestJoinedPageFirstMachine = JoinedPageFirstMachine.TestCase
TestJoinedPageFirstMachine.settings = SETTINGS
