"""``sparsetier replay``: what a device budget buys on a recorded workload, under sparsetier's
LRU (the residency directory itself, re-run on the trace) and under Belady's MIN (the offline
optimum for that budget: the headroom any eviction policy could still win).

A trace is the journal of every call the step scheduler's directory served during a run
(``ResidencyDirectory.start_journal`` / ``take_journal``), saved as compressed ``.npz``:
allocations, resolves with their keys, prefetches, releases, load and backup completions,
namespace drops and step markers. ``sparsetier demo --trace PATH`` writes one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from sparsetier._checks import count, positive, real
from sparsetier._core import replay_trace, trace_peak_live
from sparsetier.errors import ConfigError

POLICIES = ("lru", "min")
ARRAYS = ("ops", "args", "flags", "starts", "ns", "version", "page", "layer", "home")


def save_trace(path: str, trace: dict) -> None:
    """Writes a trace (the dict `take_journal` returns) as compressed `.npz`."""
    missing = [k for k in (*ARRAYS, "object_bytes", "device_slots") if k not in trace]
    if missing:
        raise ConfigError.of("trace", f"a dict without {missing}", "a trace from take_journal")
    np.savez_compressed(
        path,
        **{k: trace[k] for k in ARRAYS},
        object_bytes=np.uint64(trace["object_bytes"]),
        device_slots=np.uint64(trace["device_slots"]),
    )


def load_trace(path: str) -> dict:
    """Reads a trace written by `save_trace`."""
    try:
        z = np.load(path)
    except (OSError, ValueError) as e:
        raise ConfigError.of("trace", path, f"a .npz trace from sparsetier ({e})") from e
    missing = [k for k in (*ARRAYS, "object_bytes", "device_slots") if k not in z]
    if missing:
        raise ConfigError.of("trace", path, f"a sparsetier trace (missing {missing})")
    try:
        t = {k: z[k] for k in (*ARRAYS, "object_bytes", "device_slots")}
    except ValueError as e:  # an object (pickled) array, which numpy will not load
        raise ConfigError.of("trace", path, f"a sparsetier trace ({e})") from e
    for k in ("object_bytes", "device_slots"):
        # Scalars as save_trace wrote them: int() would truncate a float, take a negative.
        v = t[k]
        t[k] = count(k, v[()] if v.shape == () else v, 1)
    return t


@dataclass
class Row:
    policy: str
    budget: int  # device slots (pages of one layer)
    share: float  # of the peak live objects
    feasible: bool
    accesses: int
    hits: int
    loads: int
    prefetch_loads: int
    forced_backups: int
    steps: int
    hit_rate: float
    bytes_loaded: int
    transfer_ms_per_step: float | None = None
    exposed_ms_per_step: float | None = None


def _link(link: dict) -> tuple[float | None, float | None]:
    """The link options `(bandwidth_gbps, window_ms)`: a misspelt one would be ignored, a
    NaN or a negative one give transfer times that mean nothing."""
    extra = sorted(set(link) - {"bandwidth_gbps", "window_ms"})
    if extra:
        raise ConfigError.of("link", extra, "bandwidth_gbps, window_ms")
    bw, window = link.get("bandwidth_gbps"), link.get("window_ms")
    bw = None if bw is None else positive("bandwidth_gbps", bw)
    return bw, None if window is None else real("window_ms", window)


def replay_one(trace: dict, budget: int, policy: str, peak: int, **link) -> Row:
    budget, peak = count("budget", budget, 1), count("peak", peak)
    bw, window = _link(link)
    s = replay_trace(trace, budget, policy)
    ob = trace["object_bytes"]
    row = Row(
        policy=policy,
        budget=budget,
        share=budget / max(peak, 1),
        feasible=s["feasible"],
        accesses=s["accesses"],
        hits=s["hits"],
        loads=s["loads"],
        prefetch_loads=s["prefetch_loads"],
        forced_backups=s["forced_backups"],
        steps=s["steps"],
        hit_rate=s["hits"] / s["accesses"] if s["accesses"] else 1.0,
        bytes_loaded=s["loads"] * ob,
    )
    if bw and row.steps:
        # Transfer time per step over the link; the part the overlap window does not hide is
        # exposed (a step's loads overlap `window` ms of compute, no more).
        row.transfer_ms_per_step = row.bytes_loaded / row.steps / (bw * 1e9) * 1e3
        if window is not None:
            row.exposed_ms_per_step = max(0.0, row.transfer_ms_per_step - window)
    return row


def sweep(trace: dict, shares, policies=POLICIES, **link) -> list[Row]:
    """Replays at each share of the peak live objects (plus the recorded budget)."""
    _link(link)
    shares = list(shares)  # read twice below: an iterator would be spent by the checks
    for s in shares:  # NaN would fail in round(), a share <= 0 become a budget of 1
        positive("shares", s)
    peak = trace_peak_live(trace)
    budgets = sorted({max(1, round(s * peak)) for s in shares} | {int(trace["device_slots"])})
    return [replay_one(trace, b, p, peak, **link) for p in policies for b in budgets]


def budget_for(trace: dict, policy: str, hit_rate: float) -> int | None:
    """The smallest budget reaching `hit_rate` (binary search over the replay), or None."""
    hit_rate = real("hit_rate", hit_rate, 0.0, 1.0)  # NaN or > 1: "unreachable" for no reason
    peak = trace_peak_live(trace)
    lo, hi = 1, max(peak, int(trace["device_slots"]))

    def ok(b: int) -> bool:
        r = replay_trace(trace, b, policy)
        return r["feasible"] and (r["hits"] / r["accesses"] if r["accesses"] else 1.0) >= hit_rate

    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def sizing_line(trace: dict, hit_rate: float) -> str:
    ob = trace["object_bytes"]
    out = []
    for p in POLICIES:
        b = budget_for(trace, p, hit_rate)
        out.append("unreachable" if b is None else f"{b} pages = {_human(b * ob)}")
    return (
        f"for a hit rate of {hit_rate:.0%} you need {out[0]} per GPU under LRU, {out[1]} under MIN"
    )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def format_table(rows: list[Row], trace: dict) -> str:
    rec = int(trace["device_slots"])
    head = ["policy", "budget", "share", "hit rate", "loads", "loaded", "forced wt"]
    link = any(r.transfer_ms_per_step is not None for r in rows)
    exposed = any(r.exposed_ms_per_step is not None for r in rows)
    if link:
        head += ["xfer ms/step"] + (["exposed ms/step"] if exposed else [])
    lines = []
    for r in rows:
        mark = "*" if r.budget == rec else ""
        cells = [
            r.policy,
            f"{r.budget}{mark}",
            f"{r.share:.0%}",
            f"{r.hit_rate:.4f}" if r.feasible else "infeasible",
            str(r.loads),
            _human(r.bytes_loaded),
            str(r.forced_backups),
        ]
        if link:
            t, x = r.transfer_ms_per_step, r.exposed_ms_per_step
            cells.append("-" if t is None else f"{t:.3f}")
            if exposed:
                cells.append("-" if x is None else f"{x:.3f}")
        lines.append(cells)
    w = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.rjust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    out = [fmt(head), fmt(["-" * x for x in w]), *map(fmt, lines)]
    out.append(f"(* the budget the trace was recorded with: {rec} pages)")
    return "\n".join(out)


def plot(rows: list[Row], trace: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in POLICIES:
        pts = [(r.share, r.hit_rate) for r in rows if r.policy == p and r.feasible]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label={"lru": "LRU", "min": "MIN"}[p])
    peak = trace_peak_live(trace)
    ax.axvline(int(trace["device_slots"]) / max(peak, 1), ls="--", c="grey", label="recorded")
    ax.set_xlabel("device budget (share of peak live pages)")
    ax.set_ylabel("hit rate (objects)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def synthetic_trace(objects: int, reads: int, batch: int, seed: int = 0) -> dict:
    """A trace of `objects` pages written through, then `reads` resolves of `batch` pages each
    (Zipf-skewed, so budgets matter), built directly as arrays: a benchmark input of
    `reads * batch` keys."""
    rng = np.random.default_rng(seed)
    ops, args, starts, ns = [], [], [], []
    pos = 0

    def entry(op, arg, keys):
        nonlocal pos
        ops.append(op)
        args.append(arg)
        starts.append(pos)
        ns.append(keys)
        pos += len(keys)

    allk = np.arange(objects, dtype=np.uint64)
    entry(0, 0, allk)  # Alloc
    entry(7, 0, allk)  # Backup 0
    entry(8, 0, np.empty(0, np.uint64))  # BackupDone 0
    w = 1.0 / np.arange(1, objects + 1) ** 0.8
    picks = rng.choice(objects, size=(reads, batch), p=w / w.sum())
    for r in range(reads):
        entry(2, r, np.unique(picks[r]).astype(np.uint64))  # Resolve r
        entry(4, r, np.empty(0, np.uint64))  # Release r
        if r % 64 == 63:
            entry(13, 0, np.empty(0, np.uint64))  # Step
    keys = np.concatenate(ns)
    n = len(keys)
    return {
        "ops": np.array(ops, np.uint8),
        "args": np.array(args, np.uint64),
        "flags": np.zeros(len(ops), np.uint32),
        "starts": np.array(starts, np.uint64),
        "ns": keys,
        "version": np.zeros(n, np.uint32),
        "page": np.zeros(n, np.uint32),
        "layer": np.zeros(n, np.int32),
        "home": np.full(n, -1, np.int64),
        "object_bytes": 64 << 10,
        "device_slots": objects,
    }


def bench(keys: int = 1_000_000, budgets: int = 10) -> dict:
    """Seconds to replay a `keys`-key synthetic trace at `budgets` budgets, per policy."""
    import time

    trace = synthetic_trace(objects=100_000, reads=keys // 128, batch=128)
    peak = trace_peak_live(trace)
    out = {"keys": len(trace["ns"]), "budgets": budgets}
    for p in POLICIES:
        t = time.perf_counter()
        for i in range(1, budgets + 1):
            replay_trace(trace, max(1, peak * i // budgets), p)
        out[f"{p}_s"] = time.perf_counter() - t
    return out


def run(args) -> int:
    trace = load_trace(args.trace)
    shares = [float(x) / 100 for x in args.budgets.split(",")]
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise ConfigError.of("budgets", args.budgets, "percentages in (0, 100], comma-separated")
    if args.bandwidth is not None and args.bandwidth <= 0:
        raise ConfigError.of("bandwidth", str(args.bandwidth), "GB/s > 0")
    if not 0 < args.hit_rate <= 1:
        raise ConfigError.of("hit_rate", str(args.hit_rate), "0 < hit_rate <= 1")
    rows = sweep(trace, shares, bandwidth_gbps=args.bandwidth, window_ms=args.window_ms)
    print(format_table(rows, trace))
    line = sizing_line(trace, args.hit_rate)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": [asdict(r) for r in rows],
                    "peak_live": trace_peak_live(trace),
                    "recorded_budget": int(trace["device_slots"]),
                    "object_bytes": int(trace["object_bytes"]),
                    "sizing": line,
                },
                f,
                indent=2,
            )
    if args.plot:
        plot(rows, trace, args.plot)
    return 0


__all__ = ["budget_for", "load_trace", "replay_one", "save_trace", "sizing_line", "sweep"]
