"""The decode runtime: prefill and batched decode steps of a sparse-attention model whose main
KV does not fit on the device, over a radix prefix cache, scheduled by the Rust `StepScheduler`
in its joined mode.

A request, joined:

    admit(rid, prompt)          -> the prefix cache matches its whole pages; their Indexer-K
                                   is restored in the background (layer by layer), their main
                                   KV stays on host
    prefill, chunk by chunk     -> extend (new pages) + per layer: K/V rows, Indexer-K rows,
                                   wait_prefix(layer), select per token (one topk for the
                                   chunk), one plan over the chunk's selected blocks (loading
                                   only the matched blocks it picks), attention
    decode steps (batched)      -> append + per layer: plan / ready / attend / finish
    finish_request(rid, tokens) -> its pages go into the prefix tree once written through, so
                                   the next turn (prompt + answer + new message) hits them

Prefill and decode attend the same way (DSA: every token reads its top-k selection), so a
token's output does not depend on how much of its prompt was matched. Every decision about
where a page lives, and every transition, is the scheduler's; this module moves tensors.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsetier._checks import count
from sparsetier._core import PageTransferBinding, PoolSpec, StepScheduler, TransferEngine
from sparsetier.attention import sparse_attention_batched
from sparsetier.errors import (
    ConfigError,
    CopyFailedError,
    CudaError,
    OutOfPagesError,
    RequestFailedError,
    TransferFailedError,
)
from sparsetier.indexer import MODES
from sparsetier.kv_format import kv_format as make_kv_format
from sparsetier.l3 import StorageBackend, StorageController
from sparsetier.token_map import TokenMapper
from sparsetier.tools.model import TinySparseModel, rms
from sparsetier.tools.step_graphs import StepGraphs

try:
    from sparsetier.tools.metrics import RuntimeMetrics
except ImportError:  # prometheus-client is optional (sparsetier[metrics])
    RuntimeMetrics = None

log = logging.getLogger("sparsetier.tools.runtime")

LAYOUTS = ("layer_first", "layer_page_first")
RID_MAX = 2**63 - 1  # the core's request ids are int64


def _rid(rid) -> int:
    """A request id: an integer >= 0 (a bool or a float would find another request, as
    True == 1, and the core would refuse it only after the runtime let that one go)."""
    return count("rid", rid, 0, RID_MAX)


class _PrefillFailed(Exception):
    """A prefill failed: its plan's loads twice, or its logits are NaN (reported to the
    caller as RequestFailedError)."""


@dataclass
class Request:
    rid: int
    prompt: torch.Tensor
    decode_steps: int
    pos: int = 0  # tokens written so far
    next_token: int = 0
    idx_pages: torch.Tensor | None = None  # Indexer-K device pages (int64), from the scheduler
    fed: list[int] = field(default_factory=list)  # generated tokens fed back (written)
    outputs: list[torch.Tensor] = field(default_factory=list)
    ttft_s: float = 0.0
    matched_tokens: int = 0
    # A restarted request: its first `carried` outputs came before the restart, and the
    # tokens fed for them are part of `prompt` now.
    carried: int = 0
    # Its prefix hit's restore as the core decided and what it loaded
    # (`JoinedStepScheduler.restore_status`, taken when it finishes); None: nothing restored
    # from host.
    restore: dict | None = None

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.decode_steps

    def tokens(self) -> np.ndarray:
        """Every token written: the prompt, then the generated tokens fed back."""
        return np.concatenate([self.prompt.numpy(), np.asarray(self.fed, dtype=np.int64)])


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
    """Prefills and decodes requests with main KV tiered between `device_slots` device pages
    (one layer of one page each) and `host_pages` host pages (every layer of a page), which
    the prefix cache owns; Indexer-K lives in `indexer_pages` whole device pages. A decode
    layer's top-k becomes slots in the core, one call a layer (`resolve="host"`), or through the
    device resolver with one grant a step (`resolve="device"`: its reference implementation on
    the cpu engine's pools, its CUDA kernel on a GPU's). A prefix hit
    restores its Indexer-K, and its main KV as the core's restore policy decides (`restore`:
    "auto" by its cost model, "indexer" only, "full", or "predicted": the pages its position
    model expects selected, in bulk). With `storage` (an L3 backend:
    `sparsetier.l3.FileStore`, `MooncakeStore`) the prefix tier spans L3 too: pages are written
    there (`storage_write_policy`), and a prompt whose pages left host memory has them fetched
    back into host pages before it is matched (`storage_options`: `StorageController`'s, such
    as `retry_interval`). With `graphs` (CUDA, `resolve="device"`) a device-resolved step is
    replayed as a CUDA graph, one per batch size and history bucket (`step_graphs.py`; never
    run on a GPU yet)."""

    def __init__(
        self,
        model: TinySparseModel,
        *,
        page_size: int = 16,
        device_slots: int,
        host_pages: int,
        indexer_pages: int,
        topk: int = 8,
        window: int = 1,
        prefetch: bool = True,
        io_backend: str = "cpu",
        device: str = "cpu",
        selection: str = "block",
        block_size: int | None = None,
        reduce: str = "max",
        layout: str = "layer_first",
        prefill_chunk: int = 256,
        keep_records: int | None = 4096,
        kv_format: str = "bf16",
        token_map: str = "core",
        resolve: str = "host",
        restore: str = "auto",
        storage: StorageBackend | None = None,
        storage_write_policy: str = "write_through",
        storage_options: dict | None = None,
        graphs: bool = False,
    ) -> None:
        c = model.c
        # Sizes and counts as the user gave them, before anything is built: a float, a bool or
        # a 0 would otherwise be read as another size, or refused deep inside the first prefill.
        page_size = count("page_size", page_size, 1)
        for name, n in (("device_slots", device_slots), ("host_pages", host_pages),
                        ("indexer_pages", indexer_pages)):  # fmt: skip
            count(name, n, 1)
        topk, window = count("topk", topk, 1), count("window", window)
        if block_size is not None:  # (0 is not "the page size")
            block_size = count("block_size", block_size, 1)
        prefill_chunk = count("prefill_chunk", prefill_chunk, 1)
        if keep_records is not None:
            try:
                keep_records = count("keep_records", keep_records, 1)
            except ConfigError:
                raise ConfigError.of(
                    "keep_records", repr(keep_records), "None (all) or an integer >= 1"
                ) from None
        for name, flag in (("prefetch", prefetch), ("graphs", graphs)):
            if not isinstance(flag, bool):
                raise ConfigError.of(name, repr(flag), "True or False")
        if reduce not in ("max", "mean"):
            raise ConfigError.of("reduce", repr(reduce), "max or mean")
        try:
            torch_device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError.of("device", repr(device), "a torch device: cpu, cuda, cuda:N") from e
        if selection not in MODES:
            raise ConfigError.of("selection", selection, "block or token")
        if token_map not in ("core", "device"):
            raise ConfigError.of("token_map", token_map, "core or device")
        if token_map == "device" and selection != "token":
            raise ConfigError.of("token_map", token_map, "core (device maps token selections)")
        # Token mode's decode steps: the core maps token rows to pages (default), or
        # `map_tokens` does it on the model's device and the core plans page rows with counts
        # (a prefill chunk's union of tokens, one request's, is planned as tokens either way).
        # On an H200 host the device mapping cost more CPU a step than the core's (RESULTS,
        # "Token mode mapped on the GPU"): its ~20 small ops a layer took longer to launch
        # than the core takes to map the layer. `TokenMapper` replays them as one CUDA graph.
        self.token_map = token_map
        self._mapper = TokenMapper(page_size) if token_map == "device" else None
        if layout not in LAYOUTS:
            raise ConfigError.of("layout", layout, " or ".join(LAYOUTS))
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
        # Where a decode layer's top-k becomes slots: the core, one call a layer ("host"), or
        # the device resolver, with one grant a step and no call into the core per layer
        # ("device": its reference implementation on the cpu engine's pools, its kernel on a
        # GPU's; the scheduler stops prefetching once it has one).
        if resolve not in ("host", "device"):
            raise ConfigError.of("resolve", resolve, "host or device")
        if resolve == "device" and (selection == "block" and unit != page_size):
            raise ConfigError.of(
                "block_size", str(unit), f"the page size {page_size} with resolve='device'"
            )
        if resolve == "device" and selection == "token" and token_map != "core":
            raise ConfigError.of("token_map", token_map, "core with resolve='device'")
        if graphs and (resolve != "device" or torch_device.type != "cuda"):
            raise ConfigError.of(
                "graphs", "True", "device cuda with resolve='device' (a step the host plans "
                "asks the core once a layer)"
            )  # fmt: skip
        self.model, self.ps, self.topk, self.window = model, page_size, topk, window
        self.mode, self.unit, self.reduce, self.prefetch = selection, unit, reduce, prefetch
        self.chunk = prefill_chunk
        self.device = torch_device
        if (self.device.type == "cuda") != (io_backend != "cpu"):
            raise ConfigError.of(
                "io_backend", io_backend, "cpu with device cpu; kernel or direct with device cuda"
            )
        # bf16 heads, or FP8 values with fp32 scales in packed rows (DeepSeek-V3.2's formats).
        self.fmt = fmt = make_kv_format(kv_format, c.kv_heads, c.head_dim, c.indexer_dim)
        kv = fmt.kv_spec(1, page_size, device_slots)
        kv_host = fmt.kv_spec(c.layers, page_size, host_pages)
        ik = fmt.indexer_spec(c.layers, page_size, indexer_pages)
        ik_host = ik.with_pages(host_pages)
        self.kv_spec = kv
        cuda = self.device.type == "cuda"

        def host(spec: PoolSpec) -> torch.Tensor:
            t = torch.zeros(spec.shape(layout), dtype=fmt.dtype)
            return t.pin_memory() if cuda else t

        self.device_kv = torch.zeros(kv.shape(), dtype=fmt.dtype, device=self.device)
        self.indexer_pool = torch.zeros(ik.shape(), dtype=fmt.dtype, device=self.device)
        self.host_kv, self.indexer_host = host(kv_host), host(ik_host)
        self.engine = TransferEngine(io_backend)
        self.scheduler = StepScheduler.joined(
            PageTransferBinding(self.device_kv, kv),
            PageTransferBinding(self.host_kv, kv_host, layout),
            self.engine,
            indexer_device=PageTransferBinding(self.indexer_pool, ik),
            indexer_host=PageTransferBinding(self.indexer_host, ik_host, layout),
            prefetch=prefetch,
            restore=restore,
        )
        self.resolve = resolve
        self.resolver = self.scheduler.enable_device_resolver() if resolve == "device" else None
        # Device-resolved steps replayed as CUDA graphs (`step_graphs.py`).
        self.graphs: StepGraphs | None = None
        if graphs:
            self.graphs = StepGraphs(self)
        # L3 under the prefix cache: a hit beyond host memory is fetched into host pages before
        # the admission matches it; what the cache plans to write is written as steps go.
        self.l3: StorageController | None = None
        self.l3_pages_fetched = 0
        if storage is not None:
            buffers = [(t.data_ptr(), t.numel() * t.element_size())
                       for t in (self.host_kv, self.indexer_host)]  # fmt: skip
            opts = {"prefetch_policy": "wait_complete", **(storage_options or {})}
            self.l3 = StorageController(
                self.scheduler.enable_storage(write_policy=storage_write_policy),
                storage,
                host_buffers=buffers,
                **opts,
            )
        self.requests: dict[int, Request] = {}
        # The latest records only (a serving process lives for weeks); the scheduler's
        # `totals()` keeps the cumulative counts. `None` keeps every one (the demo's JSON).
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self.prefill_records: deque[dict] = deque(maxlen=keep_records)
        self.steps = 0  # decode steps run
        self.metrics = RuntimeMetrics(self) if RuntimeMetrics is not None else None
        self.prefix_wait_s = 0.0  # blocked on Indexer-K restores during prefills
        self.aborted = 0
        # The latest ones, like the records (the metrics histograms keep the whole run).
        self.failures: deque[tuple[int, int, str]] = deque(maxlen=keep_records)
        self.admission_failures: deque[tuple[int, str]] = deque(maxlen=keep_records)
        self.ttfts: deque[float] = deque(maxlen=keep_records)
        # Requests that failed or were aborted, as they stood, for `restart` (the latest
        # `keep_records`, oldest dropped first; a caller that will not restart one pops it).
        self.ended: OrderedDict[int, Request] = OrderedDict()
        self._keep_ended = keep_records

    @property
    def directory(self):
        """The scheduler's residency directory, read only (`ResidencyView`: stats, state,
        validate)."""
        return self.scheduler.residency

    def _stream(self) -> int | None:
        return torch.cuda.current_stream().cuda_stream if self.device.type == "cuda" else None

    def _table(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

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
                "more device pages (and Indexer-K pages): the page being written of every layer"
                " of every running request stays on the device, plus each layer's selected "
                f"pages for the batch, and a prefill chunk's pages for every layer ({e})",
            ) from e

    def _locs(self, r: Request, pos: torch.Tensor) -> torch.Tensor:
        return r.idx_pages[pos // self.ps] * self.ps + pos % self.ps

    def _refresh_idx(self, r: Request) -> None:
        r.idx_pages = torch.as_tensor(
            self.scheduler.indexer_pages(r.rid), dtype=torch.long, device=self.device
        )

    # -- requests ---------------------------------------------------------------------
    @torch.no_grad()
    def add_request(self, rid: int, prompt: torch.Tensor, decode_steps: int) -> dict:
        """Admits and prefills a request. Its prompt's whole pages are matched in the prefix
        cache: their Indexer-K comes back layer by layer while the suffix prefill runs, their
        main KV stays on host and only the blocks the prefill's selections pick are loaded.
        Returns the admission (`matched_pages`, `device_pages`, `restored_pages`). Raises
        RequestFailedError (the request ended, the rest unaffected) when a load it needs fails
        twice."""
        rid = _rid(rid)
        if rid in self.requests:
            raise ConfigError.of("rid", str(rid), "a request id not running")
        prompt = self._prompt(prompt)
        decode_steps = count("decode_steps", decode_steps)
        self.ended.pop(rid, None)  # a new request under that id: the old one is gone
        try:
            return self._admit(Request(rid, prompt, decode_steps), None)
        except ConfigError as e:
            if self.l3 is None or not isinstance(e.__cause__, OutOfPagesError):
                raise
            # Under write-back, host eviction waits for the store: the writes the failed
            # eviction planned run now, and the admission is tried once more.
            self.l3.drain()
            return self._admit(Request(rid, prompt, decode_steps), None)

    def _prompt(self, prompt) -> torch.Tensor:
        """The prompt as a 1-D int64 CPU tensor of token ids in the model's vocabulary, or a
        ConfigError naming `prompt` (checked before anything is admitted)."""
        vocab = self.model.c.vocab
        allowed = f"a non-empty 1-D tensor of token ids in [0, {vocab})"
        if not isinstance(prompt, torch.Tensor):
            raise ConfigError.of("prompt", type(prompt).__name__, allowed)
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ConfigError.of("prompt", f"shape {tuple(prompt.shape)}", allowed)
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ConfigError.of("prompt", str(prompt.dtype), allowed)
        p = prompt.to("cpu", torch.long)
        lo, hi = int(p.min()), int(p.max())
        if lo < 0 or hi >= vocab:
            raise ConfigError.of("prompt", f"a token id {lo if lo < 0 else hi}", allowed)
        return p

    def restart(self, rid: int) -> dict:
        """Admits again a request that failed (in a step or in its prefill) or was aborted,
        kept in `ended` as it stood: its prompt and the tokens it was fed that have outputs
        are prefilled (whole pages may hit the prefix cache), its outputs so far are kept, and
        it decodes the rest of its `decode_steps`, the step that failed first (the token fed
        there is fed again). Returns the admission; raises RequestFailedError if the prefill
        fails (it stays in `ended`, to try again)."""
        rid = _rid(rid)
        if rid not in self.ended:
            allowed = f"a failed or aborted request: one of {list(self.ended)}"
            raise ConfigError.of("rid", str(rid), allowed)
        if rid in self.requests:
            raise ConfigError.of("rid", str(rid), "a request id not running")
        old = self.ended.pop(rid)
        # Fed tokens with an output; the one fed at a failed step has none and is fed again.
        n = min(len(old.fed), len(old.outputs) - old.carried)
        fed = torch.tensor(old.fed[:n], dtype=torch.long)
        r = Request(rid, torch.cat([old.prompt, fed]), old.decode_steps)
        r.outputs = old.outputs[: old.carried + n]
        r.carried = old.carried + n
        return self._admit(r, old)

    def _admit(self, r: Request, restarting: Request | None) -> dict:
        """Admits and prefills `r` (`restarting`: the ended request it continues, put back in
        `ended` if this prefill fails too)."""
        rid, prompt = r.rid, r.prompt
        with self._device_budget():
            t0 = time.perf_counter()
            if self.l3 is not None:
                self.l3.poll()  # writes settled free host pages for this admission
                self._fetch_from_l3(prompt.numpy())
            adm = self.scheduler.admit(rid, prompt.numpy())
            r.pos = r.matched_tokens = adm["matched_pages"] * self.ps
            try:
                logits = self._prefill(r, restoring=adm["restored_pages"] > 0)
                if torch.isnan(logits).any():  # (the host reads the logits next anyway)
                    raise _PrefillFailed("NaN logits")
            except (CopyFailedError, TransferFailedError, _PrefillFailed) as e:
                # Its loads (or its prefix's restore) failed twice: end it, keep serving.
                self.scheduler.finish_request(rid)
                self._ended(restarting or Request(rid, prompt, r.decode_steps))
                why = str(e)
                self.admission_failures.append((rid, why))
                self.failures.append((self.steps, rid, why))
                log.warning("request %d failed in prefill: %s", rid, why)
                raise RequestFailedError(
                    f"request {rid} failed in prefill: {why}", rid=rid, reason=why
                ) from e
            except BaseException:
                self.scheduler.finish_request(rid)
                if restarting is not None:
                    self._ended(restarting)  # still restartable, as it was
                raise
            r.next_token = int(logits.argmax())
            # The prefill is a scheduling round of its own: its plans are recorded apart from
            # the decode steps', and its filled pages are written through now.
            self.prefill_records.append(self.scheduler.end_step())
            r.ttft_s = time.perf_counter() - t0
            if restarting is None:  # a restart's first token came long ago
                self.ttfts.append(r.ttft_s)
                if self.metrics is not None:
                    self.metrics.prefill_seconds.observe(r.ttft_s)
            self.requests[rid] = r
            return adm

    def _poll_l3(self) -> None:
        """Hands the cache's write plans to the store and settles what finished."""
        if self.l3 is not None:
            self.l3.poll()

    def _fetch_from_l3(self, tokens: np.ndarray) -> None:
        """Brings the pages of `tokens` the store holds past the cached prefix into host pages
        (the tree's, as host hits), waiting for them; nothing when the store is off."""
        m = self.l3.match_prefix(tokens)
        n = m["storage_pages"]
        if n:
            p = self.l3.prefetch(tokens, (m["device_len"] + m["host_len"]) // self.ps, n)
            if p is not None:
                self.l3_pages_fetched += self.l3.finish_prefetch(p)

    def _ended(self, r: Request) -> None:
        """Keeps a failed or aborted request for `restart`, the latest `keep_records`."""
        self.ended[r.rid] = r
        self.ended.move_to_end(r.rid)
        while self._keep_ended is not None and len(self.ended) > self._keep_ended:
            self.ended.popitem(last=False)

    def _prefill(self, r: Request, restoring: bool) -> torch.Tensor:
        """Prefills r.prompt from r.pos in chunks; returns the last token's logits."""
        m, ps, dev, sched = self.model, self.ps, self.device, self.scheduler
        n = r.prompt.numel()
        stream = self._stream()
        logits = None
        for c0 in range(r.pos, n, self.chunk):
            c1 = min(n, c0 + self.chunk)
            first_page, slots = sched.extend(r.rid, c1 - c0)
            self._refresh_idx(r)
            pos = torch.arange(c0, c1, device=dev)
            page_slot = torch.as_tensor(slots, dtype=torch.long, device=dev)
            slot = page_slot[:, pos // ps - first_page]  # [layers, T]
            hist = self._locs(r, torch.arange(c1, device=dev))
            x = m.embed(r.prompt[c0:c1].to(dev))
            for li, layer in enumerate(m.layers):
                q, k, v = layer.qkv(x, pos)
                self.fmt.write_kv(self.device_kv, 0, slot[li], pos % ps, k)
                self.fmt.write_kv(self.device_kv, 1, slot[li], pos % ps, v)
                h = rms(x)
                self.fmt.write_keys(layer.indexer, h, pos, self._locs(r, pos), self.indexer_pool,
                                    li)  # fmt: skip
                if restoring:
                    t = time.perf_counter()
                    sched.wait_prefix(r.rid, li, stream)
                    self.prefix_wait_s += time.perf_counter() - t
                keys = self.fmt.gather_keys(self.indexer_pool, li, hist)
                sel = layer.indexer.select(
                    h, pos, keys, mode=self.mode, unit=self.unit, topk=self.topk,
                    window=self.window, reduce=self.reduce,
                )  # fmt: skip
                out = self._attend_chunk(r.rid, li, q, sel, pos, stream)
                x = layer.finish(x, out)
            r.pos = c1
            logits = m.logits(x[-1:])[0]
        return logits

    def _attend_chunk(self, rid, li, q, sel, pos, stream) -> torch.Tensor:
        """Attention of one request's chunk of tokens over their selections: one plan over the
        distinct entries the chunk selected, then each token reads its own through it."""
        entries = torch.unique(sel[sel >= 0])  # ascending
        sched = self.scheduler
        plan, table = sched.plan(li, np.array([rid]), entries.cpu().numpy()[None, :], self.unit)
        failed, new = sched.ready(plan, stream)
        if new is not None:
            table = new
        try:
            if failed:
                raise _PrefillFailed(failed[0][2])
            ppe = max(1, self.unit // self.ps)
            cells = self._table(table)[0].view(-1, ppe).to(self.device, torch.long)
            j = torch.searchsorted(entries, sel.clamp(min=0))
            tok_table = cells[j.clamp(max=entries.numel() - 1)].reshape(sel.shape[0], -1)
            tok_table = tok_table.masked_fill((sel < 0).repeat_interleave(ppe, dim=1), -1)
            return sparse_attention_batched(
                q, self.device_kv, tok_table, sel, pos, self.unit, self.ps, self.fmt
            )
        finally:
            sched.finish(plan)

    def finish_request(self, rid: int) -> Request:
        """Ends a finished request: its pages go into the prefix tree (written through first),
        so a later request over the same tokens hits them."""
        rid = _rid(rid)
        if rid not in self.requests:
            raise ConfigError.of(
                "rid", str(rid), f"a running request: one of {sorted(self.requests)}"
            )
        r = self.requests.pop(rid)
        r.restore = self.scheduler.restore_status(rid)
        self.scheduler.finish_request(rid, r.tokens()[: r.pos])
        # Inserted now, not at a later step: the next admission sees the same tree in every
        # run of the same workload.
        self.scheduler.flush_finished()
        return r

    def abort(self, rid: int) -> None:
        """Ends a request between steps without inserting it: its own pages are let go (at
        once, or when transfers still touching them end); prefixes stay for others."""
        rid = _rid(rid)
        if rid not in self.requests:
            raise ConfigError.of("rid", str(rid), f"one of {sorted(self.requests)}")
        self._ended(self.requests.pop(rid))
        self.scheduler.finish_request(rid)
        self.aborted += 1
        log.info("request %d aborted", rid)

    def inject_faults(
        self,
        kind: str,
        count: int = 1,
        layer: int | None = None,
        delay: float | None = None,
        panic: bool = False,
    ) -> None:
        """Arms `count` failures of the scheduler's next `kind` submissions: `load` (a layer's
        selected blocks), `backup` (write-through) or `restore` (a prefix hit's Indexer-K); at
        `layer` only if given. They fail inside the copy engine (every engine; on the CUDA
        engines the earlier layers of that submission are copied and the rest fail). With
        `delay` (seconds; cpu engine only) those copies are slow instead; with `panic` (cpu
        engine only) the copy worker panics on them, as a bug would, and the engine fails
        them. Kind `internal` (nothing else given): the scheduler's next plan panics inside
        the core; `step` raises `InternalError`, and the scheduler refuses every later call."""
        from sparsetier import testing  # a build with the test hooks

        testing.inject_faults(self.scheduler, kind, count, layer, delay, panic)

    # -- one decode step --------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepRecord:
        """One decode step of every running request; requests whose loads failed twice are
        reported in the record (and in `failures`) and ended after the step."""
        with self._device_budget():
            reqs = [r for r in self.requests.values() if not r.done]
            t_step = time.perf_counter()
            if not reqs:
                core = self.scheduler.end_step()
                self._poll_l3()
                rec = StepRecord(self.steps, 0, time.perf_counter() - t_step, core)
                self.records.append(rec)
                self.steps += 1
                return rec
            rids_np = np.array([r.rid for r in reqs], dtype=np.int64)
            slots_np, rows_np = self.scheduler.append(rids_np)
            for b in np.flatnonzero(rows_np == 0):
                self._refresh_idx(reqs[b])  # a page started: its Indexer-K page is new
            # Per-step batch state (built once per step, not per layer).
            # The batch's host state in one copy to the device (pinned, on the stream: the
            # host does not wait for it).
            n, nl = len(reqs), slots_np.shape[1]
            state = np.empty((n, 3 + nl), dtype=np.int64)
            state[:, 0] = [r.pos for r in reqs]
            state[:, 1] = [r.next_token for r in reqs]
            state[:, 2] = rows_np
            state[:, 3:] = slots_np
            idx_tbl = torch.nn.utils.rnn.pad_sequence([r.idx_pages for r in reqs], batch_first=True)
            t_hist = max(r.pos for r in reqs) + 1  # (from the host's copy: no device sync)
            failed: dict[int, str] = {}
            # One grant for the step; False: the device cannot grant a slot for every cell,
            # and this step plans on the host.
            on_device = self.resolver is not None and self.scheduler.begin_device_step(
                rids_np, self.topk
            )
            try:
                if on_device and self.graphs is not None:
                    logits = self.graphs.step(rids_np, state, idx_tbl, t_hist, failed)
                else:
                    resolve = self._resolve_fn(rids_np, failed, on_device)
                    logits = self._forward(self._table(state), idx_tbl, t_hist, resolve)
            except BaseException:
                # A device step ends in the core all the same (what the layers resolved is
                # reconciled, the grant's victims let go): left open, it would refuse every
                # later one. Its tokens are not taken.
                if on_device:
                    self.scheduler.end_step()
                raise
            nxt = logits.argmax(dim=-1).tolist()
            out_cpu = logits.cpu()
            # NaN logits (a NaN hidden state: on a GPU the layers do not stop the host to
            # check) fail their request, not the step.
            for b in torch.nonzero(torch.isnan(out_cpu).any(dim=-1)).view(-1).tolist():
                failed.setdefault(reqs[b].rid, "NaN logits")
            for b, r in enumerate(reqs):
                r.fed.append(r.next_token)
                r.pos += 1
                if r.rid in failed:
                    continue
                r.outputs.append(out_cpu[b])
                r.next_token = nxt[b]
            try:
                core = self.scheduler.end_step()
            except CudaError:
                # The device step's read-back failed: the core ended the step without learning
                # what it did (its grant counts as overwritten). Its outputs are kept, its
                # failed requests ended, the step counted as the core counts it, and the
                # error goes to the caller.
                self._end_failed(self.steps, failed)
                self.steps += 1
                raise
            self._poll_l3()
            rec = StepRecord(
                self.steps, len(reqs), time.perf_counter() - t_step, core, sorted(failed)
            )
            self._end_failed(rec.step, failed)
            self.records.append(rec)
            self.steps += 1
            if self.metrics is not None:
                self.metrics.step_seconds.observe(rec.step_s)
            return rec

    def _forward(self, state_dev, idx_tbl, width: int, resolve) -> torch.Tensor:
        """A decode step's layers and logits: `state_dev` [B, 3 + layers] (positions, tokens,
        rows in their pages, each layer's slot of the page being written) on the device,
        `idx_tbl` [B, P] each request's Indexer-K pages, `width` history tokens scored (at
        least the batch's longest; a graph's are a bucket). `resolve(layer, sel)` gives the
        layer's slot table on the device, and what to call once attention read it."""
        m, ps, dev = self.model, self.ps, self.device
        pos, tokens, rows, slots = (state_dev[:, 0], state_dev[:, 1], state_dev[:, 2],
                                    state_dev[:, 3:])  # fmt: skip
        t = torch.arange(width, device=dev)
        hist_locs = idx_tbl[:, (t // ps).clamp(max=idx_tbl.shape[1] - 1)] * ps + t % ps
        my_locs = idx_tbl.gather(1, (pos // ps)[:, None])[:, 0] * ps + pos % ps
        x = m.embed(tokens)
        for li, layer in enumerate(m.layers):
            q, k, v = layer.qkv(x, pos)
            self.fmt.write_kv(self.device_kv, 0, slots[:, li], rows, k)
            self.fmt.write_kv(self.device_kv, 1, slots[:, li], rows, v)
            h = rms(x)
            self.fmt.write_keys(layer.indexer, h, pos, my_locs, self.indexer_pool, li)
            keys = self.fmt.gather_keys(self.indexer_pool, li, hist_locs)
            sel = layer.indexer.select(
                h, pos, keys, mode=self.mode, unit=self.unit, topk=self.topk,
                window=self.window, reduce=self.reduce,
            )  # fmt: skip
            table_dev, after = resolve(li, sel)
            try:
                out = sparse_attention_batched(q, self.device_kv, table_dev, sel, pos,
                                               self.unit, ps, self.fmt)  # fmt: skip
                x = layer.finish(x, out)
            finally:
                # The layer's plan is finished whatever happened: left open, it would hold
                # its pins and the core would refuse to end any later step.
                if after is not None:
                    after()
        return m.logits(x)

    def _failed_cells(self, li: int, rids_np: np.ndarray, table: np.ndarray, failed: dict) -> None:
        """The requests of a device-resolved host table with a cell whose copy failed twice
        (`FAILED`: no data at this layer) go into `failed`."""
        for b in np.flatnonzero((table == self.resolver.FAILED).any(axis=1)):
            failed.setdefault(int(rids_np[b]), f"device copy failed at layer {li}")

    def _resolve_fn(self, rids_np: np.ndarray, failed: dict[int, str], on_device: bool):
        """How an eager step's layers get their slot tables: the device resolver (no call into
        the core), or the core's plan, one call a layer. Requests whose loads failed go into
        `failed`."""
        stream = self._stream()
        cuda, token_mode = self.device.type == "cuda", self.mode == "token"
        resolver = self.resolver

        def on_the_device(li: int, sel: torch.Tensor):
            if cuda:
                # The kernel, on this stream: the top-k never leaves the GPU (and the kernel
                # has no copy to fail: a failed copy on a GPU is a sticky error of the
                # context).
                return resolver.resolve(li, rids_np, sel.to(torch.int32).contiguous(),
                                        token_mode), None  # fmt: skip
            table = resolver.resolve(li, rids_np, sel.to(torch.int32).cpu().numpy(), token_mode)
            self._failed_cells(li, rids_np, table, failed)
            return self._table(table), None

        def planned(li: int, sel: torch.Tensor):
            mapped = self.mode == "token" and self.token_map == "device"
            if mapped:
                # Tokens become pages on the model's device; the core plans page rows.
                tp = self._mapper(sel)
                pages_np, counts_np = tp.to_host()
                plan, table = self.scheduler.plan(li, rids_np, pages_np, self.ps, counts_np)
            else:
                # As int32: half the bytes to copy off the device and for the core to read
                # (entries are below 2^31: token indices or block ids of one context).
                sel32 = sel.to(torch.int32).cpu().numpy()
                plan, table = self.scheduler.plan(li, rids_np, sel32, self.unit)
            try:
                bad, new = self.scheduler.ready(plan, stream)
                if new is not None:
                    table = new
                for _, rid, why in bad:
                    failed.setdefault(rid, why)
                table_dev = self._table(table)
                if mapped:
                    table_dev = tp.token_table(table_dev)
            except BaseException:
                self.scheduler.finish(plan)
                raise
            return table_dev, lambda: self.scheduler.finish(plan)

        return on_the_device if on_device else planned

    def _end_failed(self, step: int, failed: dict[int, str]) -> None:
        """Ends the requests that failed at `step` (kept in `ended` for `restart`)."""
        for rid, why in sorted(failed.items()):
            log.warning("request %d failed at step %d: %s", rid, step, why)
            self.failures.append((step, rid, why))
            self._ended(self.requests.pop(rid))
            self.scheduler.finish_request(rid)

    def metrics_text(self) -> str:
        """Every counter, gauge and latency histogram in Prometheus' text format (constant
        memory however long the runtime runs). Needs `prometheus-client`."""
        if self.metrics is None:
            raise ConfigError.of(
                "metrics", "prometheus-client missing", "pip install 'sparsetier[metrics]'"
            )
        return self.metrics.text()

    def prefix_stats(self) -> dict:
        """The prefix tier's counters: hits, Indexer-K bytes restored, main-KV bytes loaded for
        matched blocks, and what a full restore of the matched host pages would have moved."""
        return self.scheduler.prefix_stats()

    def drain(self) -> None:
        """Waits for every transfer in flight (what to call before reading final stats), L3
        writes included."""
        self.scheduler.drain()
        if self.l3 is not None:
            self.l3.drain()


__all__ = ["LAYOUTS", "DecodeRuntime", "Request", "StepRecord"]
