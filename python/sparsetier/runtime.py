"""The decode runtime: batched decode steps of a sparse-attention model whose main KV does not
fit on the device, scheduled by the Rust `StepScheduler`.

One step, for the whole batch at once (no loop over requests inside a layer):

    append(rids)                 -> where each request's new K/V row goes, every layer
    per layer l:
      qkv, write K/V rows        (one index_put for the batch)
      Indexer-K store + select   (one scoring einsum, one torch.topk for the batch)
      plan(l, rids, selection)   -> slot table [B, K]: one directory resolve, one load
                                    submission for every miss of the batch
      ready(plan)                -> event wait (cpu) / stream wait (CUDA); failed loads are
                                    retried once in Rust, then reported per request
      attention                  (through the slot table, one tensor program)
      finish(plan)               -> pins released, metrics folded in Rust
    end_step()                   -> filled pages written through (never waited), finished
                                    transfers settled, next step's prefetch issued

Every decision about where a page lives, and every transition, is the scheduler's; this module
moves tensors. Objects are per (request, page, layer); Indexer-K stays resident (the indexer
must see all history). Shared system prompts are stored once under a prompt namespace and read
through the same per-layer plans.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsetier._core import (
    PageAllocator,
    PageTransferBinding,
    PoolSpec,
    StepScheduler,
    TransferEngine,
)
from sparsetier.attention import sparse_attention_batched
from sparsetier.errors import ConfigError, OutOfPagesError
from sparsetier.indexer import MODES
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
    idx_pages: torch.Tensor | None = None  # Indexer-K pages, prompt's first (int64)
    own_idx_pages: list[int] = field(default_factory=list)
    shared: SharedPrompt | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    ttft_s: float = 0.0

    @property
    def shared_blocks(self) -> int:
        return self.shared.blocks if self.shared else 0

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.decode_steps


@dataclass
class StepRecord:
    """One decode step: the scheduler's record (seed 002's table, counted in Rust) and the
    step's wall time."""

    step: int
    requests: int
    step_s: float
    core: dict
    failed: list[int] = field(default_factory=list)

    def __getattr__(self, name: str):
        core = self.__dict__.get("core")
        if core is not None and name in core:
            return core[name]
        raise AttributeError(name)


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
        selection: str = "block",
        block_size: int | None = None,
        reduce: str = "max",
    ) -> None:
        c = model.c
        if selection not in MODES:
            raise ConfigError.of("selection", selection, "block or token")
        unit = (block_size or page_size) if selection == "block" else 1
        if unit % page_size and page_size % unit:
            raise ConfigError.of(
                "block_size",
                str(unit),
                f"a divisor or a multiple of the page size {page_size}",
            )
        if selection == "block" and topk < window + 1:
            raise ConfigError.of(
                "topk",
                str(topk),
                f">= {window + 1} (the sink block and the local window are always read)",
            )
        if selection == "token" and topk < 2:
            raise ConfigError.of("topk", str(topk), ">= 2 (the sink token and the query's own)")
        self.model, self.ps, self.topk, self.window = model, page_size, topk, window
        self.mode, self.unit, self.reduce, self.prefetch = selection, unit, reduce, prefetch
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
        self.engine = TransferEngine(io_backend)
        self.scheduler = StepScheduler(
            PageTransferBinding(self.device_kv, kv),
            PageTransferBinding(self.host_kv, kv_host),
            self.engine,
            layers=c.layers,
            prefetch=prefetch,
        )
        ik = PoolSpec("INDEXER", c.layers, 1, c.indexer_dim, "bf16", page_size, indexer_pages)
        self.indexer_pool = torch.zeros(ik.shape(), dtype=torch.bfloat16, device=self.device)
        self.indexer_alloc = PageAllocator(indexer_pages)
        self.requests: dict[int, Request] = {}
        self.records: list[StepRecord] = []
        self.prompts: dict[int, SharedPrompt] = {}
        self.prefix_device_hits = 0  # shared-prompt blocks found on the device at arrival
        self.prefix_host_hits = 0  # ... found on host only, and loaded back layer by layer
        self.prefix_exposed_wait_s = 0.0
        self.aborted = 0
        self.failures: list[tuple[int, int, str]] = []  # (step, rid, reason)
        self.ttfts: list[float] = []

    @property
    def directory(self):
        """The scheduler's residency directory (stats and checks; it makes no transition)."""
        return self.scheduler.directory

    def _stream(self) -> int | None:
        return torch.cuda.current_stream().cuda_stream if self.device.type == "cuda" else None

    def _table(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _write_pages(self, slots: np.ndarray, first_page: int, k, v, first_token: int) -> None:
        """Writes K/V rows of tokens first_token.. (k, v: [T, Hkv, D]) into one layer's pages
        `slots` (the pages those tokens touch, from `first_page`)."""
        ps = self.ps
        t = torch.arange(first_token, first_token + k.shape[0], device=self.device)
        slot = torch.as_tensor(slots, dtype=torch.long, device=self.device)[t // ps - first_page]
        self.device_kv[0, 0, slot, t % ps] = k
        self.device_kv[1, 0, slot, t % ps] = v

    @contextmanager
    def _device_budget(self):
        """Reports the scheduler's refusals of a device too small for the work (out of slots,
        or a prefill larger than the whole device) as the runtime's `device_slots` error."""
        try:
            yield
        except (OutOfPagesError, ConfigError) as e:
            if isinstance(e, ConfigError) and e.field not in ("tokens", "pages"):
                raise
            raise ConfigError.of(
                "device_slots",
                str(self.kv_spec.pages),
                "more device pages: the page being written of every layer of every running "
                "request stays on the device, plus each layer's selected pages for the batch, "
                f"and a prefill's pages for every layer ({e})",
            ) from e

    def _alloc_idx(self, n: int) -> list[int]:
        try:
            return self.indexer_alloc.alloc(n).tolist()
        except OutOfPagesError as e:
            raise ConfigError.of(
                "indexer_pages", str(self.indexer_alloc.capacity), f"more Indexer-K pages ({e})"
            ) from e

    # -- requests ---------------------------------------------------------------------
    def _shared_prompt(self, pid: int, tokens: torch.Tensor) -> SharedPrompt:
        """The stored whole pages of system prompt `pid`, prefilled on first use."""
        if pid in self.prompts:
            return self.prompts[pid]
        m, ps = self.model, self.ps
        blocks = tokens.numel() // ps
        sp = SharedPrompt(PROMPT_NAMESPACE + pid, blocks, self._alloc_idx(blocks))
        per_layer, _ = m.prefill(tokens[: blocks * ps].to(self.device))
        slots = self.scheduler.add_prompt(sp.namespace, blocks)
        pos = torch.arange(blocks * ps, device=self.device)
        pages = torch.as_tensor(sp.idx_pages, dtype=torch.long, device=self.device)
        for li, (k, v, hidden) in enumerate(per_layer):
            m.layers[li].indexer.store_key(
                hidden, pos, pages[pos // ps] * ps + pos % ps, self.indexer_pool, li
            )
            self._write_pages(slots[li], 0, k, v, 0)
        self.prompts[pid] = sp
        return sp

    def _past(self, r: Request, layer: int, hit: bool):
        """K/V of a request's shared prompt for one layer, read through one scheduler plan
        (loading what is on host only). Counts prefix hits when `hit`."""
        blocks = r.shared_blocks
        sel = np.arange(blocks, dtype=np.int64)[None, :]
        plan, table = self.scheduler.plan(layer, np.array([r.rid]), sel, self.ps)
        failed, new = self.scheduler.ready(plan, self._stream())
        if new is not None:
            table = new
        try:
            if failed:
                raise ConfigError.of(
                    "shared prompt", str(r.shared.namespace), f"a readable prompt ({failed[0][2]})"
                )
            slots = self._table(table)[0].to(torch.long)
            hkv, d = self.device_kv.shape[-2:]
            k = self.device_kv[0, 0, slots].reshape(-1, hkv, d).clone()
            v = self.device_kv[1, 0, slots].reshape(-1, hkv, d).clone()
        finally:
            counts = self.scheduler.finish(plan)
        if hit:
            self.prefix_device_hits += counts["ready"]
            self.prefix_host_hits += counts["loaded"] + counts["joined"]
        self.prefix_exposed_wait_s += counts["exposed_wait_ns"] / 1e9
        return k, v

    @torch.no_grad()
    def add_request(
        self,
        rid: int,
        prompt: torch.Tensor,
        decode_steps: int,
        shared: tuple[int, int] | None = None,
    ) -> None:
        """Prefill. With `shared = (prompt id, prompt length)`, the whole pages of that system
        prompt are stored once for every request over it: a request reads them through the
        scheduler (from the device, or loaded back layer by layer as its prefill reaches each
        layer), and prefills only the rest. Everything written is written through to host."""
        with self._device_budget():
            if not 0 <= rid < PROMPT_NAMESPACE:
                raise ConfigError.of("rid", str(rid), f"0 <= rid < {PROMPT_NAMESPACE}")
            if rid in self.requests:
                raise ConfigError.of("rid", str(rid), "a request id not running")
            t0 = time.perf_counter()
            m, ps = self.model, self.ps
            n = prompt.numel()
            r = Request(rid, prompt, decode_steps)
            hit = False
            if shared is not None and shared[1] // ps > 0 and shared[1] < n:
                hit = shared[0] in self.prompts
                r.shared = self._shared_prompt(shared[0], prompt[: shared[1]])
            start = r.shared_blocks * ps
            r.own_idx_pages = self._alloc_idx(-(-(n + decode_steps - start) // ps))
            pages = (r.shared.idx_pages if r.shared else []) + r.own_idx_pages
            r.idx_pages = torch.as_tensor(pages, dtype=torch.long, device=self.device)
            src = prompt[start:].to(self.device)
            if r.shared is None:
                # No scheduler call during the prefill: register with every page at once.
                per_layer, logits = m.prefill(src)
                try:
                    slots = (0, self.scheduler.add_request(rid, n))
                except BaseException:
                    self.indexer_alloc.free(r.own_idx_pages)
                    raise
            else:
                # Register over the prompt, read its K/V layer by layer through scheduler plans,
                # then extend by the suffix once its K/V exist.
                self.scheduler.add_request(rid, start, (r.shared.namespace, r.shared.blocks))
                try:
                    per_layer, logits = m.prefill(
                        src, start=start, past=lambda layer: self._past(r, layer, hit)
                    )
                    slots = self.scheduler.extend(rid, n - start)
                except BaseException:
                    self.scheduler.finish_request(rid)
                    self.indexer_alloc.free(r.own_idx_pages)
                    raise
            first_page, page_slots = slots
            pos = torch.arange(start, n, device=self.device)
            for li, (k, v, hidden) in enumerate(per_layer):
                m.layers[li].indexer.store_key(
                    hidden, pos, self._locs(r, pos), self.indexer_pool, li
                )
                self._write_pages(page_slots[li], first_page, k, v, start)
            r.pos = n
            r.next_token = int(logits.argmax())
            r.ttft_s = time.perf_counter() - t0
            self.ttfts.append(r.ttft_s)
            self.requests[rid] = r

    def finish_request(self, rid: int) -> Request:
        r = self.requests.pop(rid)
        self.scheduler.finish_request(rid)
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

    def inject_faults(
        self, kind: str, count: int = 1, layer: int | None = None, delay: float | None = None
    ) -> None:
        """Arms `count` failures of the scheduler's next `kind` (load or backup) submissions,
        at `layer` only if given: they fail inside the copy engine (cpu engine). With `delay`
        (seconds) those copies are slow instead."""
        self.scheduler.inject_faults(kind, count, layer, delay)

    def _locs(self, r: Request, pos: torch.Tensor) -> torch.Tensor:
        return r.idx_pages[pos // self.ps] * self.ps + pos % self.ps

    # -- one decode step --------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepRecord:
        """One decode step of every running request; requests whose loads failed twice are
        reported in the record (and in `failures`) and ended after the step."""
        with self._device_budget():
            m, ps, dev = self.model, self.ps, self.device
            reqs = [r for r in self.requests.values() if not r.done]
            t_step = time.perf_counter()
            if not reqs:
                core = self.scheduler.end_step()
                rec = StepRecord(len(self.records), 0, time.perf_counter() - t_step, core)
                self.records.append(rec)
                return rec
            # Per-step batch state (built once per step, not per layer).
            rids_np = np.array([r.rid for r in reqs], dtype=np.int64)
            pos = torch.tensor([r.pos for r in reqs], device=dev)
            tokens = torch.tensor([r.next_token for r in reqs], device=dev)
            idx_tbl = torch.nn.utils.rnn.pad_sequence([r.idx_pages for r in reqs], batch_first=True)
            t_hist = int(pos.max()) + 1
            t = torch.arange(t_hist, device=dev)
            hist_locs = idx_tbl[:, (t // ps).clamp(max=idx_tbl.shape[1] - 1)] * ps + t % ps
            my_locs = idx_tbl.gather(1, (pos // ps)[:, None])[:, 0] * ps + pos % ps
            slots_np, rows_np = self.scheduler.append(rids_np)
            slots = torch.from_numpy(slots_np).to(dev, torch.long)
            rows = torch.from_numpy(rows_np).to(dev, torch.long)
            x = m.embed(tokens)
            failed: dict[int, str] = {}
            stream = self._stream()
            for li, layer in enumerate(m.layers):
                q, k, v = layer.qkv(x, pos)
                self.device_kv[0, 0, slots[:, li], rows] = k
                self.device_kv[1, 0, slots[:, li], rows] = v
                h = rms(x)
                layer.indexer.store_key(h, pos, my_locs, self.indexer_pool, li)
                keys = self.indexer_pool[0, li].reshape(-1, m.c.indexer_dim)[hist_locs]
                sel = layer.indexer.select(
                    h, pos, keys, mode=self.mode, unit=self.unit, topk=self.topk,
                    window=self.window, reduce=self.reduce,
                )  # fmt: skip
                plan, table = self.scheduler.plan(li, rids_np, sel.cpu().numpy(), self.unit)
                bad, new = self.scheduler.ready(plan, stream)
                if new is not None:
                    table = new
                for _, rid, why in bad:
                    failed.setdefault(rid, why)
                out = sparse_attention_batched(q, self.device_kv, self._table(table), sel, pos,
                                               self.unit, ps)  # fmt: skip
                x = layer.finish(x, out)
                self.scheduler.finish(plan)
            logits = m.logits(x)
            nxt = logits.argmax(dim=-1).tolist()
            out_cpu = logits.cpu()
            for b, r in enumerate(reqs):
                r.pos += 1
                if r.rid in failed:
                    continue
                r.outputs.append(out_cpu[b])
                r.next_token = nxt[b]
            core = self.scheduler.end_step()
            rec = StepRecord(
                len(self.records), len(reqs), time.perf_counter() - t_step, core, sorted(failed)
            )
            for rid, why in sorted(failed.items()):
                log.warning("request %d failed at step %d: %s", rid, rec.step, why)
                self.failures.append((rec.step, rid, why))
                self.finish_request(rid)
            self.records.append(rec)
            return rec

    def drain(self) -> None:
        """Waits for every transfer in flight (what to call before reading final stats)."""
        self.scheduler.drain()


__all__ = ["DecodeRuntime", "Request", "SharedPrompt", "StepRecord"]
