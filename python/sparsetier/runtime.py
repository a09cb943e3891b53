"""The decode runtime: decode steps of a sparse-attention model whose main KV does not fit on
the device.

Per layer of a step, for each request: store the new token's K/V and Indexer-K; select top-k
blocks with the indexer; `ResidencyDirectory.resolve` them (Ready: pinned; Absent: a slot and a
load; Loading: join); wait for that layer's loads; attend over the resolved slots; release the
pins; record the metrics. Every decision about where a page lives is the Rust directory's; this
module only moves tensors and calls it.

Objects are per (request, block, layer): main KV is tiered per layer, as sparse decode reads it.
Indexer-K stays resident (the indexer must see all history). A block's KV is written through to
host when it fills. With `prefetch`, a layer's loads for every request are submitted before any
of them attends, so loads overlap the attention of earlier requests; the runtime measures the
wait it could not hide (exposed wait), not the copy time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsetier._core import (
    PageAllocator,
    PageTransferBinding,
    PageTransferGroup,
    PoolSpec,
    PreparedPageTransfer,
    ResidencyDirectory,
    TransferEngine,
)
from sparsetier.attention import sparse_attention
from sparsetier.errors import ConfigError, OutOfPagesError
from sparsetier.keys import object_keys
from sparsetier.model import TinySparseModel, rms

log = logging.getLogger("sparsetier.runtime")


#: Namespaces of shared system prompts start here; request namespaces stay below.
PROMPT_NAMESPACE = 1 << 40


@dataclass
class SharedPrompt:
    """The whole pages of a system prompt, stored once and read by every request over it."""

    namespace: int
    blocks: int
    idx_pages: list[int]


@dataclass
class Request:
    rid: int
    prompt: torch.Tensor
    decode_steps: int
    pos: int = 0  # tokens written so far
    next_token: int = 0
    idx_pages: list[int] = field(default_factory=list)
    own_idx_pages: list[int] = field(default_factory=list)
    shared: SharedPrompt | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def shared_blocks(self) -> int:
        return self.shared.blocks if self.shared else 0

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.decode_steps


@dataclass
class StepRecord:
    step: int
    requests: int
    selected: int = 0
    distinct: int = 0
    ready: int = 0
    loads: int = 0
    inflight_reuse: int = 0
    bytes_needed: int = 0
    bytes_transferred: int = 0
    exposed_wait_s: float = 0.0
    step_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.ready / self.distinct if self.distinct else 0.0


def exposed_wait(handle) -> float:
    """Blocks until a submitted transfer is written; returns the seconds the caller actually
    blocked (the exposed wait), which is not the transfer's duration: work done between the
    submission and this call hides that much of it."""
    t0 = time.perf_counter()
    handle.wait()
    return time.perf_counter() - t0


class DecodeRuntime:
    """Decodes a batch of requests with main KV tiered between `device_slots` device pages
    and host memory."""

    def __init__(
        self,
        model: TinySparseModel,
        *,
        page_size: int = 16,
        device_slots: int,
        host_slots: int,
        indexer_pages: int,
        topk: int = 8,
        window: int = 1,
        prefetch: bool = True,
        io_backend: str = "cpu",
        device: str = "cpu",
    ) -> None:
        c = model.c
        if topk < window + 1:
            raise ConfigError.of(
                "topk",
                str(topk),
                f">= {window + 1} (the sink block and the local window are always read)",
            )
        self.model, self.ps, self.topk, self.window, self.prefetch = (
            model,
            page_size,
            topk,
            window,
            prefetch,
        )
        kv = PoolSpec("KV", 1, c.kv_heads, c.head_dim, "bf16", page_size, device_slots)
        kv_host = kv.with_pages(host_slots)
        self.kv_spec = kv
        self.device = torch.device(device)
        if (self.device.type == "cuda") != (io_backend != "cpu"):
            raise ConfigError.of(
                "io_backend", io_backend, "cpu with device cpu; kernel or direct with device cuda"
            )
        self.device_kv = torch.zeros(kv.shape(), dtype=torch.bfloat16, device=self.device)
        self.host_kv = torch.zeros(kv_host.shape(), dtype=torch.bfloat16)
        if self.device.type == "cuda":
            self.host_kv = self.host_kv.pin_memory()
        self.dev_bind = PageTransferBinding(self.device_kv, kv)
        self.host_bind = PageTransferBinding(self.host_kv, kv_host)
        self.directory = ResidencyDirectory(
            device_slots, host_slots, object_bytes=kv.page_bytes * kv.planes_per_layer
        )
        self.engine = TransferEngine(io_backend)
        ik = PoolSpec("INDEXER", c.layers, 1, c.indexer_dim, "bf16", page_size, indexer_pages)
        self.indexer_pool = torch.zeros(ik.shape(), dtype=torch.bfloat16, device=self.device)
        self.indexer_alloc = PageAllocator(indexer_pages)
        self.requests: dict[int, Request] = {}
        self.records: list[StepRecord] = []
        self.token_bytes = kv.token_bytes * kv.planes_per_layer
        self._pending: dict[int, object] = {}  # load transfer id -> engine handle
        self.faults_seen = 0
        self.prompts: dict[int, SharedPrompt] = {}
        self.prefix_device_hits = 0  # shared-prompt blocks found on the device at arrival
        self.prefix_host_hits = 0  # ... found on host only, and loaded back layer by layer
        self.prefix_exposed_wait_s = 0.0
        self.aborted = 0

    # -- pages ------------------------------------------------------------------------
    def _keys(self, rid: int, blocks, layer: int) -> np.ndarray:
        return object_keys(rid, blocks, layer)

    def _write_kv(self, slot: int, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.device_kv[0, 0, slot, row : row + k.shape[0]] = k
        self.device_kv[1, 0, slot, row : row + k.shape[0]] = v

    def _backup(self, keys: np.ndarray) -> None:
        """Write-through: copies the blocks to host and marks the host copies Ready."""
        plan = self.directory.backup(keys)
        if plan.transfer_id is None:
            return
        t = PreparedPageTransfer(
            self.dev_bind, self.host_bind, plan.device_slots, plan.host_slots, direction="backup"
        )
        h = self.engine.submit(PageTransferGroup([t]))
        try:
            h.wait()
        except Exception as e:
            log.warning("backup %d failed (%s): blocks stay device-only", plan.transfer_id, e)
            self.directory.fail(plan.transfer_id, str(e), ended=True)
            self.faults_seen += 1
            return
        self.directory.backup_complete(plan.transfer_id)

    def _allocate(self, keys: np.ndarray) -> np.ndarray:
        try:
            return self.directory.allocate(keys)
        except OutOfPagesError as e:
            raise ConfigError.of(
                "device_slots",
                str(self.kv_spec.pages),
                "more device pages: the current block of every layer of every running "
                f"request stays on the device until it fills, plus top-k blocks per request ({e})",
            ) from e

    # -- requests ---------------------------------------------------------------------
    def _namespaces(self, r: Request, blocks: np.ndarray) -> np.ndarray:
        """Shared-prompt blocks live in the prompt's namespace, the rest in the request's."""
        if r.shared is None:
            return np.full(len(blocks), r.rid, dtype=np.int64)
        return np.where(blocks < r.shared.blocks, r.shared.namespace, r.rid)

    def _store_blocks(self, ns: int, k, v, first_block: int, layer: int, n_tokens: int) -> None:
        """Writes K/V rows of consecutive blocks from `first_block` into fresh device objects,
        writing every full block through to host."""
        ps = self.ps
        for i in range(-(-n_tokens // ps)):
            lo, hi = i * ps, min(n_tokens, (i + 1) * ps)
            keys = self._keys(ns, [first_block + i], layer)
            slot = int(self._allocate(keys)[0])
            self._write_kv(slot, 0, k[lo:hi], v[lo:hi])
            if hi - lo == ps:
                self._backup(keys)

    def _shared_prompt(self, pid: int, tokens: torch.Tensor) -> SharedPrompt:
        """The stored whole pages of system prompt `pid`, prefilled on first use."""
        if pid in self.prompts:
            return self.prompts[pid]
        m, ps = self.model, self.ps
        blocks = tokens.numel() // ps
        sp = SharedPrompt(PROMPT_NAMESPACE + pid, blocks, self.indexer_alloc.alloc(blocks).tolist())
        per_layer, _ = m.prefill(tokens[: blocks * ps].to(self.device))
        pos = torch.arange(blocks * ps, device=self.device)
        pages = torch.as_tensor(sp.idx_pages, dtype=torch.long, device=self.device)
        for li, (k, v, hidden) in enumerate(per_layer):
            loc = pages[pos // ps] * ps + pos % ps
            m.layers[li].indexer.store_key(hidden, pos, loc, self.indexer_pool, li)
            self._store_blocks(sp.namespace, k, v, 0, li, blocks * ps)
        self.prompts[pid] = sp
        return sp

    def _past(self, sp: SharedPrompt, layer: int, hit: bool):
        """K/V of a shared prompt for one layer: resolved (loading what is on host only),
        waited for, gathered. Counts prefix hits when `hit` (the prompt was stored by an
        earlier request). Returns (k, v, pin handle)."""
        res = self.directory.resolve(self._keys(sp.namespace, np.arange(sp.blocks), layer))
        if hit:
            self.prefix_device_hits += res.metrics["ready"]
            self.prefix_host_hits += res.metrics["absent"] + res.metrics["loading"]
        self._submit(res)
        for tid in [lp.transfer_id for lp in res.loads] + list(res.joined):
            self.prefix_exposed_wait_s += self._ensure(tid)
        slots = torch.from_numpy(res.slots).to(self.device)
        hkv, d = self.device_kv.shape[-2:]
        k = self.device_kv[0, 0, slots].reshape(-1, hkv, d).clone()
        v = self.device_kv[1, 0, slots].reshape(-1, hkv, d).clone()
        return k, v, res.handle

    @torch.no_grad()
    def add_request(
        self,
        rid: int,
        prompt: torch.Tensor,
        decode_steps: int,
        shared: tuple[int, int] | None = None,
    ) -> None:
        """Prefill. With `shared = (prompt id, prompt length)`, the whole pages of that system
        prompt are stored once for every request over it: a request finds them on the device,
        or on host (loaded back layer by layer as its prefill reaches each layer), and
        prefills only the rest. Everything written is written through to host."""
        if rid >= PROMPT_NAMESPACE:
            raise ConfigError.of("rid", str(rid), f"0 <= rid < {PROMPT_NAMESPACE}")
        m, ps = self.model, self.ps
        n = prompt.numel()
        r = Request(rid, prompt, decode_steps)
        hit = False
        if shared is not None and shared[1] // ps > 0 and shared[1] < n:
            hit = shared[0] in self.prompts
            r.shared = self._shared_prompt(shared[0], prompt[: shared[1]])
        start = r.shared_blocks * ps
        own = -(-(n + decode_steps - start) // ps)
        r.own_idx_pages = self.indexer_alloc.alloc(own).tolist()
        r.idx_pages = (r.shared.idx_pages if r.shared else []) + r.own_idx_pages
        handles = []

        def past(layer: int):
            k, v, h = self._past(r.shared, layer, hit)
            handles.append(h)
            return k, v

        per_layer, logits = m.prefill(prompt[start:].to(self.device), start=start, past=past)
        for h in handles:
            self.directory.release(h)
        pos = torch.arange(start, n, device=self.device)
        for li, (k, v, hidden) in enumerate(per_layer):
            m.layers[li].indexer.store_key(hidden, pos, self._locs(r, pos), self.indexer_pool, li)
            self._store_blocks(rid, k, v, r.shared_blocks, li, n - start)
        r.pos = n
        r.next_token = int(logits.argmax())
        self.requests[rid] = r

    def finish_request(self, rid: int) -> Request:
        r = self.requests.pop(rid)
        self.directory.drop_namespace(rid)
        self.indexer_alloc.free(r.own_idx_pages)
        return r

    def abort(self, rid: int) -> None:
        """Ends a request between steps: its objects go (at once, or when transfers still
        touching them end), its Indexer-K pages are freed; shared prompts stay for others."""
        if rid not in self.requests:
            raise ConfigError.of("rid", str(rid), f"one of {sorted(self.requests)}")
        self.finish_request(rid)
        self.aborted += 1
        log.info("request %d aborted", rid)

    def _locs(self, r: Request, pos: torch.Tensor) -> torch.Tensor:
        pages = torch.as_tensor(r.idx_pages, dtype=torch.long, device=self.device)
        return pages[pos // self.ps] * self.ps + pos % self.ps

    # -- loads ------------------------------------------------------------------------
    def _submit(self, res) -> None:
        for lp in res.loads:
            t = PreparedPageTransfer(self.host_bind, self.dev_bind, lp.host_slots, lp.device_slots)
            self.directory.mark_submitted(lp.transfer_id)
            self._pending[lp.transfer_id] = self.engine.submit(PageTransferGroup([t]))

    def _ensure(self, tid: int) -> float:
        """Waits for load `tid` and publishes it; returns the time blocked."""
        h = self._pending.pop(tid, None)
        if h is None:
            t0 = time.perf_counter()
            self.directory.wait(tid)  # completed by an earlier request of this step
            return time.perf_counter() - t0
        try:
            waited = exposed_wait(h)
        except Exception as e:
            log.warning("load %d failed (%s): its blocks go back to host-only", tid, e)
            self.directory.fail(tid, str(e), ended=True)
            self.faults_seen += 1
            raise
        self.directory.complete(tid)
        return waited

    # -- one decode step --------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepRecord:
        m, ps = self.model, self.ps
        reqs = [r for r in self.requests.values() if not r.done]
        rec = StepRecord(len(self.records), len(reqs))
        t_step = time.perf_counter()
        dev = self.device
        xs = {r.rid: m.embed(torch.tensor([r.next_token], device=dev)) for r in reqs}
        for li, layer in enumerate(m.layers):
            plans = {}
            for r in reqs:
                pos = torch.tensor([r.pos], device=dev)
                q, k, v = layer.qkv(xs[r.rid], pos)
                block, row = divmod(r.pos, ps)
                keys = self._keys(r.rid, [block], li)
                if row == 0:
                    self._allocate(keys)
                slot = int(self.directory.state((r.rid, 0, block, li))["device_slot"])
                self._write_kv(slot, row, k, v)
                layer.indexer.store_key(
                    rms(xs[r.rid]), pos, self._locs(r, pos), self.indexer_pool, li
                )
                past = self.indexer_pool[0, li].reshape(-1, m.c.indexer_dim)[
                    self._locs(r, torch.arange(r.pos + 1, device=dev))
                ]
                sel = layer.indexer(
                    rms(xs[r.rid]), pos, past, block_size=ps, topk=self.topk, window=self.window
                )[0]
                needed = (r.pos + 1 - sel.blocks[-1].item() * ps) + (len(sel.blocks) - 1) * ps
                blocks = sel.blocks.numpy()
                res = self.directory.resolve(
                    object_keys(self._namespaces(r, blocks), blocks, li),
                    bytes_needed=needed * self.token_bytes,
                )
                plans[r.rid] = (q, sel, res)
                if self.prefetch:
                    self._submit(res)
            for r in reqs:
                q, sel, res = plans[r.rid]
                if not self.prefetch:
                    self._submit(res)
                for tid in [lp.transfer_id for lp in res.loads] + list(res.joined):
                    rec.exposed_wait_s += self._ensure(tid)
                out = sparse_attention(
                    q[0], self.device_kv, torch.from_numpy(res.slots).to(dev), sel.blocks, r.pos, ps
                )
                xs[r.rid] = layer.finish(xs[r.rid], out[None])
                metrics = self.directory.release(res.handle)
                rec.selected += metrics["selected"]
                rec.distinct += metrics["distinct"]
                rec.ready += metrics["ready"]
                rec.loads += metrics["absent"]
                rec.inflight_reuse += metrics["inflight_reuse"]
                rec.bytes_needed += metrics["bytes_needed"]
                rec.bytes_transferred += metrics["bytes_transferred"]
        for r in reqs:
            logits = m.logits(xs[r.rid])[0]
            r.outputs.append(logits.cpu())
            r.next_token = int(logits.argmax())
            r.pos += 1
            if r.pos % ps == 0:  # the block filled: write it through, every layer
                for li in range(len(m.layers)):
                    self._backup(self._keys(r.rid, [r.pos // ps - 1], li))
        rec.step_s = time.perf_counter() - t_step
        self.records.append(rec)
        return rec
