"""``sparsetier soak``: a long run of the joined step scheduler (prefix cache and per-layer
residency together) with no model: requests over Zipf-popular system prompts and their next
turns, decode steps with random selections, ends with and without insertion, random faults.
Every `--every` requests it prints (and writes as a JSON line) the RSS, live objects, tree
nodes, the p50/p99 latency of each call since the last report, and the fault counters; it ends
with every invariant checked.

Data patterns: every K, V and Indexer-K row written gets bytes derived from (token, position,
layer, plane), so a prefix's rows are the same whoever wrote them. Every page a plan selects is
read back through its slot table after `ready` and compared, and every admitted request's
Indexer-K (found on the device or restored from host) is compared after its restore: a load,
backup, restore or eviction that moved the wrong bytes, or a slot reused too early, fails the
soak. It shows whether memory and latency stay flat over millions of
requests (issue 17); CI runs a short one and asserts flat RSS after warm-up.

Two engines run the same workload with the same patterns and report the same fields:
`python` (this module's loop, through the bindings: what a Python caller of the scheduler
does, about 440 requests/s) and `rust` (`sparsetier.testing.run_soak`, the loop of
`src/scheduler/soak.rs` over the same core calls without the interpreter, for runs of ten
million requests). Their random streams differ, so their runs are not request-for-request
equal.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from sparsetier import testing
from sparsetier._core import PageTransferBinding, PoolSpec, StepScheduler, TransferEngine
from sparsetier.errors import ConfigError, InvariantError, OutOfPagesError, SparsetierError


@dataclass
class SoakConfig:
    requests: int = 100_000
    concurrent: int = 8
    layers: int = 4
    page_size: int = 16
    device_slots: int = 20_000
    host_pages: int = 100_000
    indexer_pages: int = 8_000
    prompts: int = 2_000
    steps: int = 8
    faults: float = 0.01  # chance per step of arming a fault
    every: int = 10_000
    seed: int = 0


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q) * 1e6) if xs else 0.0


ROW = 8  # bytes per token row per plane: small pools, all of them checked


_K = np.arange(ROW, dtype=np.uint32) * np.uint32(0x165667B1)


def pattern(tokens, positions, layer, plane) -> np.ndarray:
    """The bytes [..., ROW] of the rows of `tokens` at `positions` in `layer` and `plane` (0 K,
    1 V, 2 Indexer-K); the four broadcast together. uint32 arithmetic, wrapping."""
    with np.errstate(over="ignore"):
        base = (
            np.asarray(tokens, dtype=np.uint32) * np.uint32(0x9E3779B1)
            + np.asarray(positions, dtype=np.uint32) * np.uint32(0x85EBCA77)
            + np.asarray(layer, dtype=np.uint32) * np.uint32(0xC2B2AE3D)
            + np.asarray(plane, dtype=np.uint32) * np.uint32(0x27D4EB2F)
        )
        return ((base[..., None] + _K) >> np.uint32(17)).astype(np.uint8)


class _Patterns:
    """Writes and checks the rows of the soak's pools (see the module): every layer and both
    K/V planes in one numpy call each."""

    def __init__(self, s, kv: torch.Tensor, ik: torch.Tensor, ps: int, layers: int) -> None:
        self.s, self.kv, self.ik, self.ps, self.layers = s, kv.numpy(), ik.numpy(), ps, layers
        self.lay = np.arange(layers)[:, None]  # [layers, 1]
        self.kv_planes = np.array([0, 1])[:, None, None]  # [2, 1, 1]
        self.rows_checked = 0

    def write_kv(self, slots: np.ndarray, rows: np.ndarray, toks, pos) -> None:
        """Rows of `toks` at `pos` [N] into device `slots` [layers, N] at page rows `rows`."""
        want = pattern(toks, pos, self.lay, self.kv_planes)  # [2, layers, N, ROW]
        self.kv[:, 0, slots, rows, 0] = want

    def write_keys(self, pages: np.ndarray, toks, pos) -> None:
        """Indexer-K rows of `toks` at `pos` [N] into Indexer-K `pages` [N], every layer."""
        self.ik[0, self.lay, pages, pos % self.ps, 0] = pattern(toks, pos, self.lay, 2)

    def check_keys(self, rid: int, toks: np.ndarray, upto: int) -> None:
        if not upto:
            return
        pos = np.arange(upto)
        pages = self.s.indexer_pages(rid)[pos // self.ps]
        got = self.ik[0, self.lay, pages, pos % self.ps, 0]  # [layers, N, ROW]
        self._same(got, pattern(toks[:upto], pos, self.lay, 2), f"Indexer-K of {rid}")

    def check_plan(self, table, sel, lens, tokmat, layer: int, skip: set[int]) -> None:
        """The selected pages' rows, read through the slot table, hold their tokens' rows:
        the whole batch at once. `tokmat` [B, longest] holds each row's tokens, `lens` [B]
        how many have rows written; rows in `skip` (failed loads) are not read."""
        pos = sel[:, :, None] * self.ps + np.arange(self.ps)  # [B, K, ps]
        valid = (sel >= 0)[:, :, None] & (pos < lens[:, None, None])
        if skip:
            valid[sorted(skip)] = False
        b = np.broadcast_to(np.arange(len(sel))[:, None, None], pos.shape)[valid]
        slot = np.broadcast_to(table[:, :, None], pos.shape)[valid]
        p = pos[valid]
        got = self.kv[:, 0, slot, p % self.ps, 0]  # [2, N, ROW]
        want = pattern(tokmat[b, p], p, layer, self.kv_planes[:, 0])
        self._same(got, want, f"layer {layer}")

    def _same(self, got: np.ndarray, want: np.ndarray, what: str) -> None:
        if not np.array_equal(got, want):
            bad = np.argwhere((got != want).any(axis=-1))[0].tolist()
            raise AssertionError(f"soak data pattern broken: {what}, at {bad}")
        self.rows_checked += got.size // ROW


def _pick(rng: np.random.Generator, n: np.ndarray, k: int, layers: int) -> np.ndarray:
    """For each layer and row b, `min(k, n[b])` distinct pages of `n[b]`, ascending, -1
    padded: [layers, B, k]."""
    keys = rng.random((layers, len(n), int(n.max())))
    keys[:, np.arange(keys.shape[2]) >= n[:, None]] = np.inf
    kk = min(k, keys.shape[2])
    pick = np.sort(np.argpartition(keys, kk - 1, axis=2)[:, :, :kk], axis=2)
    ok = np.take_along_axis(keys, pick, axis=2) < np.inf
    out = np.full((layers, len(n), k), -1, dtype=np.int64)
    # Padding keys belong to indices >= n[b], so after the sort they come last.
    out[:, :, :kk] = np.where(ok, pick, -1)
    return out


ENGINES = ("python", "rust")


def _emit(rep: dict, out, quiet: bool) -> None:
    if out is not None:
        out.write(json.dumps(rep) + "\n")
        out.flush()
    if not quiet:
        print(
            f"{rep['requests']} requests  rss {rep['rss_mib']:.1f} MiB  objects "
            f"{rep['objects']}  nodes {rep['tree_nodes']}  plan p99 "
            f"{rep['plan_p99_us']:.0f} us  failed {rep['failed_requests']}  rows checked "
            f"{rep['rows_checked']}",
            flush=True,
        )


def run(cfg: SoakConfig, out=None, quiet: bool = False, engine: str = "python") -> list[dict]:
    """Runs the soak on `engine` (`python` or `rust`, see the module); returns the reports
    (and writes them to `out` as JSON lines). A row read back that differs from what was
    written, or a broken invariant, raises (InvariantError from the rust engine,
    AssertionError from the python one; InvariantError is an AssertionError)."""
    for field in ("requests", "concurrent", "layers", "steps", "every", "prompts", "page_size"):
        if getattr(cfg, field) < 1:
            raise ConfigError.of(field, str(getattr(cfg, field)), "an integer >= 1")
    if not 0.0 <= cfg.faults <= 1.0:
        raise ConfigError.of("faults", str(cfg.faults), "a chance in [0, 1]")
    if engine not in ENGINES:
        raise ConfigError.of("engine", repr(engine), "python or rust")
    if engine == "rust":
        return testing.run_soak(**asdict(cfg), on_report=lambda rep: _emit(rep, out, quiet))
    rng = np.random.default_rng(cfg.seed)
    ps, layers = cfg.page_size, cfg.layers
    kv = PoolSpec("KV", 1, 1, ROW, "fp8_e4m3", ps, cfg.device_slots)
    kv_host = PoolSpec("KV", layers, 1, ROW, "fp8_e4m3", ps, cfg.host_pages)
    ik = PoolSpec("INDEXER", layers, 1, ROW, "fp8_e4m3", ps, cfg.indexer_pages)
    ik_host = ik.with_pages(cfg.host_pages)
    z = lambda s: torch.zeros(s, dtype=torch.uint8)  # noqa: E731
    dev_kv, dev_ik = z(kv.shape()), z(ik.shape())
    s = StepScheduler.joined(
        PageTransferBinding(dev_kv, kv),
        PageTransferBinding(z(kv_host.shape()), kv_host),
        TransferEngine("cpu", threads=1),
        indexer_device=PageTransferBinding(dev_ik, ik),
        indexer_host=PageTransferBinding(z(ik_host.shape()), ik_host),
        prefetch=False,
    )  # fmt: skip
    data = _Patterns(s, dev_kv, dev_ik, ps, layers)
    idx: dict[int, np.ndarray] = {}  # rid -> its Indexer-K device pages
    w = 1.0 / np.arange(1, cfg.prompts + 1) ** 1.1
    w /= w.sum()
    sys_len = rng.integers(64, 512, cfg.prompts)
    running: dict[int, list] = {}  # rid -> [tokens, steps left]
    turns: list[np.ndarray] = []  # finished conversations, for next turns (bounded)
    lat: dict[str, list[float]] = {"admit": [], "plan": [], "end_step": [], "finish": []}
    reports: list[dict] = []
    done = failed = 0
    next_rid = 0
    t0 = time.perf_counter()

    def timed(name, f, *a):
        t = time.perf_counter()
        r = f(*a)
        lat[name].append(time.perf_counter() - t)
        return r

    while done < cfg.requests:
        while len(running) < cfg.concurrent:
            rid, next_rid = next_rid, next_rid + 1
            if turns and rng.random() < 0.3:
                base = turns[int(rng.integers(len(turns)))]
            else:
                p = int(rng.choice(cfg.prompts, p=w))
                base = (np.arange(sys_len[p]) * 7919 + p * 104729) % 50_000
            toks = np.concatenate([base, rng.integers(0, 50_000, int(rng.integers(8, 64)))])
            try:
                adm = timed("admit", s.admit, rid, toks)
            except OutOfPagesError:
                failed, done = failed + 1, done + 1
                continue
            try:
                for layer in range(layers):
                    s.wait_prefix(rid, layer)  # a failed restore ends the request
                start = adm["matched_pages"] * ps
                data.check_keys(rid, toks, start)  # found on the device or restored
                first, slots = s.extend(rid, len(toks) - start)
                pos = np.arange(start, len(toks))
                data.write_kv(slots[:, pos // ps - first], pos % ps, toks[pos], pos)
                idx[rid] = s.indexer_pages(rid)
                data.write_keys(idx[rid][pos // ps], toks[pos], pos)
                running[rid] = [list(toks), cfg.steps]
            except InvariantError:
                raise  # a bug, never a fault to end the request over
            except SparsetierError:
                idx.pop(rid, None)
                s.finish_request(rid)
                failed, done = failed + 1, done + 1
        if rng.random() < cfg.faults:
            testing.inject_faults(s, ["load", "backup", "restore"][int(rng.integers(3))], 1)
        rids = np.array(sorted(running), dtype=np.int64)
        try:
            slots_np, rows_np = s.append(rids)
            new = rng.integers(0, 50_000, len(rids))
            pos = np.array([len(running[rid][0]) for rid in rids.tolist()])
            ik_pages = np.empty(len(rids), dtype=np.int64)
            for b, rid in enumerate(rids.tolist()):
                running[rid][0].append(int(new[b]))
                if rows_np[b] == 0:  # a page started: its Indexer-K page is new
                    idx[rid] = s.indexer_pages(rid)
                ik_pages[b] = idx[rid][pos[b] // ps]
            data.write_kv(slots_np.T, rows_np, new, pos)
            data.write_keys(ik_pages, new, pos)
            lens = pos + 1
            tokmat = np.zeros((len(rids), int(lens.max())), dtype=np.int64)
            for b, rid in enumerate(rids.tolist()):
                tokmat[b, : lens[b]] = running[rid][0]
            bad: set[int] = set()
            sels = _pick(rng, -(-lens // ps), 4, layers)
            for layer in range(layers):
                sel = sels[layer]
                plan, table = timed("plan", s.plan, layer, rids, sel, ps)
                failed_rows, again = s.ready(plan)
                table = table if again is None else again
                bad |= {r for _, r, _ in failed_rows}
                skip = {int(np.flatnonzero(rids == r)[0]) for r in bad}
                data.check_plan(table, sel, lens, tokmat, layer, skip)
                s.finish(plan)
            timed("end_step", s.end_step)
        except OutOfPagesError:
            bad = set(running)  # the device holds too much not yet written through
        for rid in rids.tolist():
            running[rid][1] -= 1
            if rid in bad or running[rid][1] <= 0:
                toks = running.pop(rid)[0]
                idx.pop(rid, None)
                insert = rid not in bad and rng.random() < 0.9
                timed("finish", s.finish_request, rid, np.array(toks) if insert else None)
                if insert and len(turns) < 256:
                    turns.append(np.array(toks))
                elif insert:
                    turns[int(rng.integers(len(turns)))] = np.array(toks)
                failed += rid in bad
                done += 1
                if done % cfg.every == 0:
                    st = s.stats()
                    px = s.prefix_stats()
                    rep = {
                        "requests": done,
                        "seconds": time.perf_counter() - t0,
                        "rss_mib": rss_mib(),
                        "objects": st["objects"],
                        "tree_nodes": px["tree_nodes"],
                        "finishing": px["finishing"],
                        "failed_requests": failed,
                        "failed_loads": s.totals()["failed_loads"],
                        "failed_backups": s.totals()["failed_backups"],
                        "restores_failed": px["restores_failed"],
                        "rows_checked": data.rows_checked,
                        **{f"{k}_p50_us": _pct(v, 50) for k, v in lat.items()},
                        **{f"{k}_p99_us": _pct(v, 99) for k, v in lat.items()},
                    }
                    lat = {k: [] for k in lat}
                    reports.append(rep)
                    _emit(rep, out, quiet)
    for rid in list(running):
        s.finish_request(rid)
    s.drain()
    s.validate()
    st = s.stats()
    if st["pins"] or st["handles"] or st["transfers_in_flight"]:
        raise AssertionError(f"soak ended with pins/handles/transfers: {st}")
    return reports


__all__ = ["ENGINES", "SoakConfig", "rss_mib", "run"]
