"""``sparsetier bench decode``: the CPU cost of scheduling one decode step, at DeepSeek-V3.2's
shape, with a null compute model (no attention math, no model).

Two identical stacks are built from the same seed: same contexts, same device budget, same
synthetic selections. Each decode step runs on both, alternating in one process:

- **A, the step scheduler**: `append`, then per layer `plan` (one resolve and one load
  submission for the whole batch), `ready`, `finish`, then `end_step`: 3 calls per layer.
- **A0, the step scheduler without kept selections** (`keep_selections = False`: every
  selected page resolved and released each step; what the scheduler did before them), with
  `unkept`;
- **M, token mode mapped on a device** (with `map_device`): the scheduler fed page rows with
  per-page token counts, each layer's tokens mapped to pages by `sparsetier.token_map` on
  that torch device inside the timer (the batched ops, the one copy of pages and counts to the
  CPU, and the per-token table gathered back on the device), as the runtime does; the step's
  selection is put on the device before the timer, where an indexer would have left it. Its
  ratio is against A plus what A's input costs from there: each layer's token rows copied to
  the CPU (timed in the same step);
- **B, today's call pattern** (the per-request loop the decode runtime had before the
  scheduler): per request and layer, `ResidencyDirectory.resolve` of that request's pages,
  a `PreparedPageTransfer` + submit + wait + `complete` for its misses, `release`; a page that
  starts is allocated per request and layer, a page that fills is backed up and waited for.

Both sides get the same numpy selections (int64 `[layers, B, K]`, generated before the timer)
and pay their own conversions inside it. The figure is the CPU time spent inside those calls
per step, with the time blocked waiting for copies taken out (the cpu engine copies on a worker
thread; on a GPU that is DMA). Reported: each side's median, and the median of the per-step
ratios B / A.

The timed steps start once the scheduler is in its steady state: by default (`warmup=None`)
the warm-up lasts until the scheduler has loaded as many pages as the device has slots, so that
the pages the prefill left resident (evicted in the order the prefill wrote them, neighbours in
memory) have been turned over for pages loaded at random, or until a step loads nothing. A step
after it costs more than one of the first steps (benches/RESULTS.md, "Decode step, block mode",
the steady state).
`warmup=N` fixes it at N steps instead.

Selections are synthetic with step-to-step locality: each selected block (or hot page, in token
mode) stays from one step to the next with probability `locality`, else moves to a random one.
Block mode always holds the sink block and the last block. Token mode draws `tokens` tokens from
`token_pages` hot pages per request and layer (plus the current token), so the pages after
dedup are at most `token_pages`.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from sparsetier import _core, testing
from sparsetier._core import (
    PageTransferGroup,
    PreparedPageTransfer,
    StepScheduler,
)
from sparsetier.errors import ConfigError
from sparsetier.keys import object_keys
from sparsetier.token_map import TokenMapper
from sparsetier.tools.record import CPU_PARTS, fmt_ratio


@dataclass
class DecodeBenchConfig:
    layers: int = 61
    page_size: int = 64
    batch: int = 64
    context_min: int = 32 * 1024
    context_max: int = 128 * 1024
    budget: float = 0.25
    mode: str = "block"
    blocks: int = 32
    tokens: int = 2048
    token_pages: int = 128
    locality: float = 0.9
    steps: int = 10
    warmup: int | None = None  # None: until the device has turned over (`WarmUp`)
    prefetch: bool = False
    baseline: bool = True
    # A third stack, the scheduler with kept selections off (every selected page resolved
    # each step), alternated with the others: what kept selections save, paired.
    unkept: bool = True
    # Token mode: a fourth stack whose tokens are mapped to pages on this torch device ("cpu"
    # or "cuda") by `sparsetier.token_map`, timed with the plan of the page rows.
    map_device: str | None = None
    # Every stack's copy engine: "cpu" (pools in host memory, a copy thread), or "kernel" /
    # "direct" (device pools on the GPU, pinned host pools; `ready` is a stream wait, so the
    # CPU never blocks on a load: the deployment the CPU figure is about).
    io_backend: str = "cpu"
    # After the paired steps, this many more of the scheduler alone, back to back (None: as
    # many as `steps`; 0: none): what the other stacks' steps in between cost it in caches.
    alone_steps: int | None = None
    # The dtype the selections are handed over in: int64 (what torch.topk returns) or int32
    # (half the bytes; top-k kernels often return it). Every stack but the mapped one gets the
    # same array, converted before the timers.
    entry_dtype: str = "int64"
    seed: int = 0
    trace: str | None = None  # write the scheduler's directory trace (.npz; costs time)

    def check(self) -> None:
        checks = [
            ("layers", self.layers >= 1, "an integer >= 1"),
            ("page_size", self.page_size >= 1, "an integer >= 1"),
            ("batch", self.batch >= 1, "an integer >= 1"),
            ("context_min", 2 * self.page_size <= self.context_min <= self.context_max,
             "2 x page_size <= context_min <= context_max"),
            ("budget", 0.0 < self.budget <= 1.0, "0 < budget <= 1"),
            ("mode", self.mode in ("block", "token"), "block or token"),
            ("blocks", self.blocks >= 2, "an integer >= 2 (sink and local window)"),
            ("tokens", self.tokens >= 2, "an integer >= 2"),
            ("token_pages", self.token_pages >= 1, "an integer >= 1"),
            ("locality", 0.0 <= self.locality <= 1.0, "0 <= locality <= 1"),
            ("steps", self.steps >= 1, "an integer >= 1"),
            ("warmup", self.warmup is None or self.warmup >= 0,
             "an integer >= 0, or unset: until the device has turned over"),
            ("map_device", self.map_device is None or (
                self.mode == "token" and self.map_device in ("cpu", "cuda")),
             "unset, or cpu or cuda in token mode"),
            ("alone_steps", self.alone_steps is None or self.alone_steps >= 0,
             "an integer >= 0, or unset: as many as steps"),
            ("entry_dtype", self.entry_dtype in ("int64", "int32"), "int64 or int32"),
            ("io_backend", self.io_backend == "cpu" or (
                self.io_backend in ("kernel", "direct") and torch.cuda.is_available()),
             "cpu, or kernel or direct where a GPU is present"),
        ]  # fmt: skip
        for name, ok, allowed in checks:
            if not ok:
                raise ConfigError.of(name, str(getattr(self, name)), allowed)


class Selections:
    """Synthetic selections with step-to-step locality, identical for both sides."""

    def __init__(self, cfg: DecodeBenchConfig, lens: np.ndarray) -> None:
        self.cfg, self.rng = cfg, np.random.default_rng(cfg.seed + 7)
        self.lens = lens.copy()
        pages = -(-self.lens // cfg.page_size)
        k = cfg.blocks - 2 if cfg.mode == "block" else cfg.token_pages
        shape = (cfg.layers, cfg.batch, k)
        self.hot = (self.rng.random(shape) * (pages[None, :, None] - 1)).astype(np.int64)

    def next(self) -> np.ndarray:
        """The step's selection `[layers, B, K]` for requests of the current lengths."""
        cfg, rng = self.cfg, self.rng
        self.lens += 1  # the step's token is appended before the indexer runs
        pages = -(-self.lens // cfg.page_size)
        move = rng.random(self.hot.shape) >= cfg.locality
        fresh = (rng.random(self.hot.shape) * (pages[None, :, None] - 1)).astype(np.int64)
        self.hot = np.where(move, fresh, self.hot)
        last = np.broadcast_to((pages - 1)[None, :, None], (cfg.layers, cfg.batch, 1))
        if cfg.mode == "block":
            sink = np.zeros((cfg.layers, cfg.batch, 1), dtype=np.int64)
            sel = np.concatenate([sink, self.hot, last], axis=2)
        else:
            pick = rng.integers(0, self.hot.shape[2], (cfg.layers, cfg.batch, cfg.tokens - 1))
            off = rng.integers(0, cfg.page_size, pick.shape)
            tok = np.take_along_axis(self.hot, pick, axis=2) * cfg.page_size + off
            cur = np.broadcast_to((self.lens - 1)[None, :, None], (cfg.layers, cfg.batch, 1))
            sel = np.concatenate([tok, cur], axis=2)
        return np.ascontiguousarray(np.sort(sel, axis=2))


# The most steps an automatic warm-up runs (a run whose device has not turned over by then
# says so in its report).
WARMUP_CAP = 300


class WarmUp:
    """When a run's warm-up ends: after `cfg.warmup` steps, or (auto) once the scheduler has
    loaded as many pages as the device has slots (every page the prefill left resident has been
    evicted, so victims are pages loaded at random, as in a long run), once a step after the
    first loads nothing (nothing turns over), or after `WARMUP_CAP` steps. `ended` says which,
    once it has."""

    def __init__(self, cfg: DecodeBenchConfig, device_pages: int) -> None:
        self.fixed, self.device_pages = cfg.warmup, device_pages
        self.steps = self.loaded = 0
        self.ended: str | None = "fixed" if cfg.warmup is not None else None

    def done(self) -> bool:
        """Whether the steps seen so far complete the warm-up."""
        if self.fixed is not None:
            return self.steps >= self.fixed
        return self.ended is not None

    def saw(self, rec: dict) -> None:
        """Counts one warm-up step of the scheduler (its `end_step` record)."""
        self.steps += 1
        self.loaded += rec["loaded"]
        if self.fixed is not None:
            return
        if self.loaded >= self.device_pages:
            self.ended = "until the device turned over"
        elif self.steps >= 2 and rec["loaded"] == 0:
            self.ended = "until a step loaded nothing"
        elif self.steps >= WARMUP_CAP:
            self.ended = "capped before the device turned over"

    def describe(self) -> str:
        return (
            f"{self.steps} steps, {self.ended} ({self.loaded} pages loaded, "
            f"{self.device_pages} device slots)"
        )


def sizes(cfg: DecodeBenchConfig) -> tuple[np.ndarray, int, int]:
    """A run's contexts (one per request, drawn from the seed), device pages and host pages."""
    rng = np.random.default_rng(cfg.seed)
    lens = rng.integers(cfg.context_min, cfg.context_max + 1, cfg.batch)
    steps_total = (WARMUP_CAP if cfg.warmup is None else cfg.warmup) + cfg.steps
    pages = int((-(-(lens + steps_total) // cfg.page_size)).sum()) * cfg.layers
    device_pages = max(
        math.ceil(cfg.budget * pages),
        cfg.batch * cfg.layers * 2 + cfg.batch * max(cfg.blocks, cfg.token_pages) * 2 + 16,
    )
    return lens, device_pages, pages + cfg.batch * cfg.layers


def _stack(
    cfg: DecodeBenchConfig,
    lens: np.ndarray,
    device_pages: int,
    host_pages: int,
    journal: bool = False,
    keep: bool = True,
    core=None,
):
    """A step scheduler with every request prefilled; `core` is the extension module whose
    classes build it (this one by default; `scripts/ab_decode.py` passes another build)."""
    core = core or _core
    spec = core.PoolSpec("KV", 1, 1, 1, "bf16", cfg.page_size, device_pages)
    host_spec = spec.with_pages(host_pages)
    if cfg.io_backend == "cpu":
        dev = torch.zeros(spec.shape(), dtype=torch.bfloat16)
        host = torch.zeros(host_spec.shape(), dtype=torch.bfloat16)
        engine = core.TransferEngine("cpu", threads=1)
    else:
        dev = torch.zeros(spec.shape(), dtype=torch.bfloat16, device="cuda")
        host = torch.zeros(host_spec.shape(), dtype=torch.bfloat16).pin_memory()
        engine = core.TransferEngine(cfg.io_backend, device=dev.device.index or 0)
    s = core.StepScheduler(
        core.PageTransferBinding(dev, spec),
        core.PageTransferBinding(host, host_spec),
        engine,
        layers=cfg.layers,
        prefetch=cfg.prefetch,
    )
    s.keep_selections = keep
    if journal:
        s.start_journal()  # before the prefills: a replay needs every allocation
    for rid, n in enumerate(lens):
        s.add_request(rid, int(n))
    s.drain()
    return s, engine


def _step(s: StepScheduler, rids: np.ndarray, layers: int, plan_layer, after=None) -> dict:
    """One timed step: `append`, then per layer `plan_layer(layer)` (the plan's call), ready
    and finish, then `after()` (work the step still owes) and `end_step`."""
    pc = time.perf_counter
    # CUDA engines: the consumer's stream waits on each layer's loads (no CPU wait).
    on_gpu = s.bindings[0].device_index is not None
    stream = torch.cuda.current_stream().cuda_stream if on_gpu else None
    t = pc()
    s.append(rids)
    for layer in range(layers):
        plan = plan_layer(layer)
        s.ready(plan, stream)
        s.finish(plan)
    if after is not None:
        after()
    rec = s.end_step()
    wall = pc() - t
    return {"wall_s": wall, "wait_s": rec["exposed_wait_ns"] / 1e9, "rec": rec}


def _step_mapped(
    s: StepScheduler, rids: np.ndarray, sel: torch.Tensor, mapper: TokenMapper
) -> dict:
    """One token-mode step with each layer's tokens mapped to pages on `sel`'s device by
    `mapper` (a `TokenMapper`: a CUDA graph replay on the GPU): the mapping, the copy of pages
    and counts, the plan, and the per-token table gathered back."""
    dev, ps = sel.device, mapper.page_size

    def plan_layer(layer):
        tp = mapper(sel[layer])
        pages, counts = tp.to_host()
        plan, table = s.plan(layer, rids, pages, ps, counts)
        tp.token_table(torch.from_numpy(table).to(dev, non_blocking=True))
        return plan

    def after():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # the last layer's gather, as the next step would wait

    return _step(s, rids, sel.shape[0], plan_layer, after)


def as_given(cfg: DecodeBenchConfig, sel: np.ndarray) -> np.ndarray:
    """The step's selections in the dtype the stacks are handed them in."""
    return sel if cfg.entry_dtype == "int64" else sel.astype(np.int32)


def _step_scheduler(s: StepScheduler, rids: np.ndarray, sel: np.ndarray, unit: int) -> dict:
    """One step through the scheduler; returns its call time and the record."""
    return _step(s, rids, sel.shape[0], lambda layer: s.plan(layer, rids, sel[layer], unit)[0])


class Baseline:
    """Today's call pattern over a directory: one resolve + release per request per layer."""

    def __init__(
        self, cfg: DecodeBenchConfig, s: StepScheduler, engine: _core.TransferEngine, lens
    ):
        self.cfg, self.d, self.engine = cfg, testing.directory_of(s), engine
        self.dev, self.host = s.bindings
        self.lens = lens.copy()
        self.loads = self.hits = self.distinct = 0

    def step(self, rids: np.ndarray, sel: np.ndarray) -> dict:
        cfg, d, ps = self.cfg, self.d, self.cfg.page_size
        pc = time.perf_counter
        wait = 0.0
        t = pc()
        for b, rid in enumerate(rids.tolist()):
            n = int(self.lens[b])
            page, row = divmod(n, ps)
            for layer in range(cfg.layers):
                key = object_keys(rid, [page], layer)
                if row == 0:
                    d.allocate(key)
                d.state((rid, 0, page, layer))
        self.lens += 1
        for layer in range(cfg.layers):
            for b, rid in enumerate(rids.tolist()):
                row = sel[layer, b]
                pages = np.unique(row // ps) if cfg.mode == "token" else row
                res = d.resolve(object_keys(rid, pages, layer))
                for lp in res.loads:
                    tr = PreparedPageTransfer(self.host, self.dev, lp.host_slots, lp.device_slots)
                    d.mark_submitted(lp.transfer_id)
                    h = self.engine.submit(PageTransferGroup([tr]))
                    w = pc()
                    h.wait()
                    wait += pc() - w
                    d.complete(lp.transfer_id)
                for tid in res.joined:
                    w = pc()
                    d.wait(tid)
                    wait += pc() - w
                m = d.release(res.handle)
                self.hits += m["ready"]
                self.distinct += m["distinct"]
                self.loads += m["absent"]
        for b, rid in enumerate(rids.tolist()):
            if self.lens[b] % ps == 0:
                for layer in range(cfg.layers):
                    plan = d.backup(object_keys(rid, [int(self.lens[b]) // ps - 1], layer))
                    if plan.transfer_id is None:
                        continue
                    tr = PreparedPageTransfer(
                        self.dev, self.host, plan.device_slots, plan.host_slots,
                        direction="backup",
                    )  # fmt: skip
                    h = self.engine.submit(PageTransferGroup([tr]))
                    w = pc()
                    h.wait()
                    wait += pc() - w
                    d.backup_complete(plan.transfer_id)
        return {"wall_s": pc() - t, "wait_s": wait}


def run(cfg: DecodeBenchConfig, progress: bool = False) -> dict:
    """Builds the stacks, runs the warm-up and `steps` alternating steps, returns the report."""
    cfg.check()
    lens, device_pages, host_pages = sizes(cfg)
    t0 = time.perf_counter()
    a, _ = _stack(cfg, lens, device_pages, host_pages, journal=cfg.trace is not None)
    setup_s = time.perf_counter() - t0
    base = None
    if cfg.baseline:
        sb, eb = _stack(cfg, lens, device_pages, host_pages)
        base = Baseline(cfg, sb, eb, lens)
    a0 = None
    if cfg.unkept:
        a0, _ = _stack(cfg, lens, device_pages, host_pages, keep=False)
    am = None
    if cfg.map_device is not None:
        if cfg.map_device == "cuda" and not torch.cuda.is_available():
            raise ConfigError.of("map_device", "cuda", "cpu, or cuda where a GPU is present")
        am, _ = _stack(cfg, lens, device_pages, host_pages)
        mapper = TokenMapper(cfg.page_size)
    sels = Selections(cfg, lens)
    rids = np.arange(cfg.batch, dtype=np.int64)
    unit = cfg.page_size if cfg.mode == "block" else 1
    rows = []
    # Steps of the scheduler alone after the paired run (where any other stack ran between).
    paired = base is not None or a0 is not None or am is not None
    n_alone = (cfg.steps if cfg.alone_steps is None else cfg.alone_steps) if paired else 0
    bar = None
    if progress:
        from tqdm import tqdm

        total = None if cfg.warmup is None else cfg.warmup + cfg.steps + n_alone
        bar = tqdm(total=total, desc=f"bench decode ({cfg.mode}), warm-up", unit="step")
    warm = WarmUp(cfg, device_pages)
    while len(rows) < cfg.steps:
        sel = sels.next()
        given = as_given(cfg, sel)
        ra = _step_scheduler(a, rids, given, unit)
        r0 = _step_scheduler(a0, rids, given, unit) if a0 is not None else None
        rm = None
        if am is not None:
            sel_dev = torch.from_numpy(sel).to(cfg.map_device)  # where the indexer leaves it
            if sel_dev.is_cuda:
                torch.cuda.synchronize()
            rm = _step_mapped(am, rids, sel_dev, mapper)
            # What the core's mapping pays on top where the tokens are on a device: each
            # layer's token rows copied to the CPU for the plan (the runtime's `sel.cpu()`).
            t = time.perf_counter()
            for layer in range(sel_dev.shape[0]):
                sel_dev[layer].cpu().numpy()
            rm["core_d2h_s"] = time.perf_counter() - t
        rb = base.step(rids, given) if base else None
        if bar is not None:
            bar.update(1)
        if not warm.done():
            warm.saw(ra["rec"])
            if warm.done() and bar is not None:
                bar.total = warm.steps + cfg.steps + n_alone
                bar.set_description(f"bench decode ({cfg.mode})")
            continue
        row = {
            "scheduler_ms": (ra["wall_s"] - ra["wait_s"]) * 1e3,
            "scheduler_wait_ms": ra["wait_s"] * 1e3,
            "scheduler_core_cpu_ms": ra["rec"]["cpu_ns"] / 1e6,
            "pages": ra["rec"]["pages"],
            "loaded": ra["rec"]["loaded"],
            "hit_rate": ra["rec"]["device_byte_hit_rate"],
            "read_amplification": ra["rec"]["read_amplification"],
            "prefetch_accuracy": ra["rec"]["prefetch_accuracy"],
        }
        for part in CPU_PARTS:
            row[f"cpu_{part}_ms"] = ra["rec"][f"cpu_{part}_ns"] / 1e6
        if r0 is not None:
            row["unkept_ms"] = (r0["wall_s"] - r0["wait_s"]) * 1e3
            row["unkept_hit_rate"] = r0["rec"]["device_byte_hit_rate"]
            row["kept_ratio"] = row["unkept_ms"] / row["scheduler_ms"]
        if rm is not None:
            row["mapped_ms"] = (rm["wall_s"] - rm["wait_s"]) * 1e3
            row["mapped_core_cpu_ms"] = rm["rec"]["cpu_ns"] / 1e6
            row["mapped_rows_ms"] = rm["rec"]["cpu_rows_ns"] / 1e6
            row["mapped_read_amplification"] = rm["rec"]["read_amplification"]
            row["core_d2h_ms"] = rm["core_d2h_s"] * 1e3
            row["mapped_ratio"] = (row["scheduler_ms"] + row["core_d2h_ms"]) / row["mapped_ms"]
        if rb is not None:
            row["baseline_ms"] = (rb["wall_s"] - rb["wait_s"]) * 1e3
            row["baseline_wait_ms"] = rb["wait_s"] * 1e3
            row["ratio"] = row["baseline_ms"] / row["scheduler_ms"]
        rows.append(row)
    # The scheduler alone: its steps back to back, as a server runs them (the paired run puts
    # the other stacks' steps, and their memory traffic, between two of its steps).
    alone = []
    for _ in range(n_alone):
        r = _step_scheduler(a, rids, as_given(cfg, sels.next()), unit)
        alone.append({"ms": (r["wall_s"] - r["wait_s"]) * 1e3, "core_ms": r["rec"]["cpu_ns"] / 1e6})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if cfg.trace is not None:
        from sparsetier.replay import save_trace

        a.drain()
        save_trace(cfg.trace, a.take_journal())
    med = {k: _median(r[k] for r in rows) for k in rows[0]}
    return {
        "config": asdict(cfg),
        "machine": f"{platform.machine()}, {_cpu_model()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads"
        + _caches()
        + (f", {torch.cuda.get_device_name()}" if cfg.io_backend != "cpu" else ""),
        "date": time.strftime("%Y-%m-%d"),
        "memory": _memory_pages(),
        "device_pages": device_pages,
        "host_pages": host_pages,
        "objects": host_pages - cfg.batch * cfg.layers,
        "lookups_per_step": cfg.layers
        * cfg.batch
        * (cfg.blocks if cfg.mode == "block" else cfg.tokens),
        "setup_s": setup_s,
        "warmup_steps": warm.steps,
        "warmup_loaded": warm.loaded,
        "warmup": warm.describe(),
        "median": med,
        # How much the steps vary (this VM's speed swings): the 10th and 90th percentiles.
        "spread": {"scheduler_ms": _spread(r["scheduler_ms"] for r in rows)},
        "alone": {
            "scheduler_ms": _median(x["ms"] for x in alone),
            "spread_ms": _spread(x["ms"] for x in alone),
            "core_ms": _median(x["core_ms"] for x in alone),
            "steps": alone,
        }
        if alone
        else None,
        "baseline_hit_rate": (base.hits / max(base.distinct, 1)) if base else None,
        # Layers the mapped stack mapped by replaying a CUDA graph (0: eagerly, the CPU).
        "map_graph_replays": mapper.replays if am is not None else None,
        "steps": rows,
    }


def _cpu_model() -> str:
    """The CPU's model name where Linux says it (`platform.processor()` is often empty), so
    that runs on different machines tell apart."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _caches() -> str:
    """Core 0's L2 and L3 as Linux reports them (", L2 1024K, L3 32768K"; empty where it does
    not): the same code's step moves between VMs whose memory systems differ
    (benches/RESULTS.md, "Decode step, block mode")."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    out = []
    try:
        for index in sorted(os.listdir(root)):
            if not index.startswith("index"):
                continue
            with open(f"{root}/{index}/level") as lf, open(f"{root}/{index}/size") as sf:
                level = lf.read().strip()
                if level in ("2", "3"):
                    out.append(f"L{level} {sf.read().strip()}")
    except OSError:
        return ""
    return "".join(f", {c}" for c in out)


def _memory_pages() -> str:
    """The page sizes the run could get, which move its figures (benches/RESULTS.md, "Memory
    system: huge pages, allocators, caches"): transparent huge pages' mode, the 2 MB pages
    reserved, and whether the extension's allocator was told to use them."""

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    thp = read("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp[thp.index("[") + 1 : thp.index("]")] if thp and "[" in thp else "unknown"
    reserved = read("/proc/sys/vm/nr_hugepages") or "unknown"
    large = os.environ.get("MIMALLOC_ALLOW_LARGE_OS_PAGES", "") not in ("", "0")
    return (
        f"THP {mode}, {reserved} huge pages reserved, allocator's large OS pages "
        f"{'on' if large else 'off'}"
    )


def _median(values) -> float | None:
    """Median of the values that are defined (a ratio is None in a step without its
    denominator: read amplification in a step that moved nothing); None if none is."""
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def _spread(values) -> tuple[float, float]:
    """The 10th and 90th percentiles (the extremes below ten values)."""
    v = sorted(values)
    if len(v) < 10:
        return (v[0], v[-1])
    q = statistics.quantiles(v, n=10)
    return (q[0], q[-1])


def _fmt_spread(s) -> str:
    return f"p10-p90 {s[0]:.2f}-{s[1]:.2f}" if s else ""


def format_report(r: dict) -> str:
    c, m = r["config"], r["median"]
    budget = f"device budget {c['budget']:.0%} ({r['device_pages']} of {r['objects']} objects)"
    if r["device_pages"] > math.ceil(c["budget"] * r["objects"]) * 1.01:
        # Small shapes: `sizes` raises the device to what one step's selections need.
        budget = (
            f"device budget {c['budget']:.0%} raised to {r['device_pages']} slots for "
            f"{r['objects']} objects (what one step's selections need)"
        )
    lines = [
        f"bench decode: {c['mode']} mode, {c['layers']} layers, batch {c['batch']}, "
        f"pages of {c['page_size']} tokens, contexts {c['context_min']}-{c['context_max']}, "
        f"{budget}, "
        f"locality {c['locality']}, prefetch {'on' if c['prefetch'] else 'off'}, "
        f"{c.get('io_backend', 'cpu')} engine, rows as {c.get('entry_dtype', 'int64')}",
        f"  selection entries per step: {r['lookups_per_step']}; distinct pages per step "
        f"(median): {m['pages']:.0f}; loaded: {m['loaded']:.0f}; "
        f"hit rate {fmt_ratio(m['hit_rate'], 'nothing selected')}; "
        f"read amplification {fmt_ratio(m['read_amplification'], 'nothing moved')}",
        f"  warm-up: {r['warmup']}",
        f"  step scheduler: {m['scheduler_ms']:.2f} ms CPU per step (median of "
        f"{len(r['steps'])}, {_fmt_spread(r.get('spread', {}).get('scheduler_ms'))}; "
        f"in-core share {m['scheduler_core_cpu_ms']:.2f} ms)",
    ]
    if r.get("alone"):
        al = r["alone"]
        lines.append(
            f"  step scheduler alone (its steps back to back after the paired run, no other "
            f"stack between): {al['scheduler_ms']:.2f} ms (median of {len(al['steps'])}, "
            f"{_fmt_spread(al.get('spread_ms'))}; in-core {al['core_ms']:.2f} ms)"
        )
    if "cpu_plan_ms" in m:
        lines.append(
            "  in-core split (ms, medians): "
            f"plan {m['cpu_plan_ms']:.2f} (rows {m['cpu_rows_ms']:.2f}, resolve "
            f"{m['cpu_resolve_ms']:.2f}, submit {m['cpu_submit_ms']:.2f}, prefetch "
            f"{m['cpu_prefetch_ms']:.2f} with end_step's), ready {m['cpu_ready_ms']:.2f}, "
            f"finish {m['cpu_finish_ms']:.2f}, append {m['cpu_append_ms']:.2f}, end_step "
            f"{m['cpu_end_step_ms']:.2f}"
        )
    if "unkept_ms" in m:
        lines.append(
            f"  kept selections off: {m['unkept_ms']:.2f} ms CPU per step (hit rate "
            f"{fmt_ratio(m['unkept_hit_rate'], 'nothing selected')}); kept selections save "
            f"{m['kept_ratio']:.1f}x (median of per-step ratios)"
        )
    if "mapped_ms" in m:
        lines.append(
            f"  tokens mapped to pages on {c['map_device']} (sparsetier.token_map, "
            f"{'a CUDA graph' if r['map_graph_replays'] else 'eager ops'}): "
            f"{m['mapped_ms']:.2f} ms CPU per step (in core {m['mapped_core_cpu_ms']:.2f}, "
            f"rows {m['mapped_rows_ms']:.2f}; read amplification "
            f"{fmt_ratio(m['mapped_read_amplification'], 'nothing moved')}); the core's "
            f"mapping plus copying the token rows from {c['map_device']} "
            f"({m['core_d2h_ms']:.2f} ms) / this: {m['mapped_ratio']:.2f}x (median of per-step "
            "ratios)"
        )
    if "baseline_ms" in m:
        lines.append(
            f"  per-request calls (today's pattern): {m['baseline_ms']:.2f} ms CPU per step; "
            f"hit rate {r['baseline_hit_rate']:.3f}"
        )
        lines.append(f"  ratio (median of per-step baseline / scheduler): {m['ratio']:.1f}x")
    lines.append(f"  {r['machine']}, {r['date']}")
    if r.get("memory"):
        lines.append(f"  memory pages: {r['memory']}")
    return "\n".join(lines)
