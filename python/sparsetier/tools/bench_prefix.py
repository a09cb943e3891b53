"""``sparsetier bench prefix``: the prefix cache on the peers' workload and serve loop.

Phases, as SGLang's peer benchmark (`bench_sglang_radix.py` in `--peers-dir`) runs them: fill
(match, alloc, insert into an unbounded pool), hot match (fresh queries that hit a shared
prompt, and full re-queries), lock/unlock, and the serve loop: a pool of 25 % of the cached
tokens, each request does match, lock, evict on demand, alloc, insert, re-lock, and 32 requests
stay locked. Every op is timed through the Python binding, one call per op; the serve loop also
runs in Rust alone in the same process, for the binding's share. With ``--peers-python`` the
SGLang peer runs on the same workload in the same command, and the report gives the ratios."""

from __future__ import annotations

import collections
import gc
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from sparsetier import testing
from sparsetier._core import HiCache
from sparsetier.errors import OutOfPagesError
from sparsetier.tools.workload import Workload, WorkloadSpec, as_tokens, load_stream


def _stats(ns: list[int] | np.ndarray) -> dict[str, float]:
    a = np.asarray(ns, dtype=np.float64)
    return {
        "n": len(a),
        "mean_us": float(a.mean() / 1e3),
        "p99_us": float(np.percentile(a, 99) / 1e3),
        "ops_per_s": float(len(a) / (a.sum() / 1e9)),
    }


def _serve_python(seqs, ps: int, cap_pages: int, inflight: int):
    c = HiCache(ps, cap_pages, drop_unbacked=True)
    held: collections.deque[int] = collections.deque()
    lat = np.empty(len(seqs), np.int64)
    hit = tot = failed = 0
    clock = time.perf_counter_ns
    for i, s in enumerate(seqs):
        t = clock()
        # Schedule: match, lock the match, allocate the rest (evicting on demand): one call.
        try:
            m = c.match_prefix(s, lock=True, alloc=True)
        except OutOfPagesError:  # everything else is locked; nothing stays held
            failed += 1
            lat[i] = clock() - t
            continue
        # Finish: insert (the match's pages), lock the full path, drop the match's lock.
        r = c.insert(s, m, lock=True, unlock=m.device_node)
        held.append(r.last_node)
        if len(held) > inflight:
            c.unlock(held.popleft())
        lat[i] = clock() - t
        hit += m["device_len"]
        tot += len(s)
    c.validate()
    return lat, hit, tot, failed


def run(
    page_size: int = 1,
    num_seqs: int = 500,
    num_queries: int = 300,
    serve_reqs: int = 500,
    inflight: int = 32,
    capacity_frac: float = 0.25,
    followup_frac: float = 0.0,
    stream: str | None = None,
    token_type: str = "q",
) -> dict:
    ps = page_size
    wl = Workload(WorkloadSpec(num_seqs=num_seqs, followup_frac=followup_frac, align=ps))
    fill = [t for _, t in wl.stream(num_seqs, 1)]
    fresh = [t for _, t in wl.stream(num_queries, 2)]
    serve = load_stream(stream) if stream else [t for _, t in wl.stream(serve_reqs, 3)]
    # Token ids in the container users hold (array('q'), SGLang's, by default); any conversion
    # happens inside the timed calls, as it does for the peers.
    fill, fresh, serve = ([as_tokens(token_type, t) for t in x] for x in (fill, fresh, serve))
    out: dict = {
        "page_size": ps, "num_seqs": num_seqs, "serve_reqs": len(serve), "stream": stream,
        "token_type": token_type,
    }  # fmt: skip
    total = sum(len(s) // ps for s in fill)
    c = HiCache(ps, total + 16, drop_unbacked=True)
    t_match, t_ins, nodes = [], [], []
    clock = time.perf_counter_ns
    gc.disable()
    for s in fill:
        a = clock()
        m = c.match_prefix(s)
        b = clock()
        new = c.alloc_device(len(s) // ps - m["device_len"] // ps)
        pages = np.concatenate([m["device_pages"], new])
        d = clock()
        r = c.insert(s, pages)
        e = clock()
        t_match.append(b - a)
        t_ins.append(e - d)
        nodes.append(r["last_node"])
    cached = c.stats()["device_in_tree"] * ps
    out["fill.match"] = _stats(t_match)
    out["fill.insert"] = _stats(t_ins)
    q_new, q_full = [], []
    for s in fresh:
        a = clock()
        c.match_prefix(s)
        q_new.append(clock() - a)
    for s in fill[:num_queries]:
        a = clock()
        c.match_prefix(s)
        q_full.append(clock() - a)
    out["match.prompt_hit"] = _stats(q_new)
    out["match.full_requery"] = _stats(q_full)
    t_lock, t_unlock = [], []
    for n in nodes[:num_queries]:
        a = clock()
        c.lock(n)
        b = clock()
        c.unlock(n)
        t_lock.append(b - a)
        t_unlock.append(clock() - b)
    out["lock"] = _stats(t_lock)
    out["unlock"] = _stats(t_unlock)
    cap_pages = int(capacity_frac * cached) // ps
    lat, hit, tot, failed = _serve_python(serve, ps, cap_pages, inflight)
    gc.enable()
    out["serve"] = {**_stats(lat), "hit_frac": hit / max(tot, 1), "failed": failed}
    rlat, rhit, rtot, rfailed = testing.bench_serve(serve, ps, cap_pages, inflight)
    out["serve.rust_alone"] = {**_stats(rlat), "hit_frac": rhit / max(rtot, 1), "failed": rfailed}
    out["cached_tokens"] = cached
    out["capacity_tokens"] = cap_pages * ps
    return out


def run_peer(peers_python: str, peers_dir: str, impl: str, page_size: int, args: dict) -> dict:
    """Runs `bench_sglang_radix.py` with the same workload; returns its JSON."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "peer.json"
        cmd = [
            peers_python, "-W", "ignore", str(Path(peers_dir) / "bench_sglang_radix.py"),
            "--impl", impl, "--page-size", str(page_size),
            "--num-seqs", str(args["num_seqs"]), "--num-queries", str(args["num_queries"]),
            "--serve-reqs", str(args["serve_reqs"]), "--followup-frac", str(args["followup_frac"]),
            "--out", str(path),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, cwd=peers_dir, timeout=1800)
        return json.loads(path.read_text())


def peer_ops(peer: dict) -> dict[str, dict]:
    ops = {o["op"]: o for o in peer["ops"]}
    prefixes = {
        "match.prompt_hit": "match.new_seq",
        "match.full_requery": "match.requery",
        "lock": "inc_lock_ref",
        "unlock": "dec_lock_ref",
        "serve": "serve.request",
    }
    pick = {ours: next((k for k in ops if k.startswith(p)), None) for ours, p in prefixes.items()}
    return {ours: ops[k] for ours, k in pick.items() if k}


def format_report(r: dict, peers: dict[str, dict] | None = None) -> str:
    lines = [
        f"page_size {r['page_size']}, {r['num_seqs']} fill sequences, {r['serve_reqs']} served, "
        f"cached {r['cached_tokens']} tokens, pool {r['capacity_tokens']} tokens",
        "op                    mean us    p99 us      ops/s",
    ]
    for k in ("fill.match", "fill.insert", "match.prompt_hit", "match.full_requery", "lock",
              "unlock", "serve", "serve.rust_alone"):  # fmt: skip
        s = r[k]
        lines.append(f"{k:<20} {s['mean_us']:>8.2f} {s['p99_us']:>9.2f} {s['ops_per_s']:>10.0f}")
    serve, alone = r["serve"], r["serve.rust_alone"]
    lines.append(
        f"serve hit fraction {serve['hit_frac']:.4f} (rust alone {alone['hit_frac']:.4f}), "
        f"failed {serve['failed']}; a serve request through the binding takes "
        f"{serve['mean_us'] / alone['mean_us']:.2f}x the Rust time"
    )
    for name, ops in (peers or {}).items():
        for k, o in ops.items():
            ours = r[k]["mean_us"]
            extra = f", hit {o['hit_tokens_frac']}" if "hit_tokens_frac" in o else ""
            lines.append(
                f"vs {name} {k}: {o['mean_us']:.2f} us -> {o['mean_us'] / ours:.1f}x faster{extra}"
            )
    return "\n".join(lines)


def run_paired(args: Any) -> str:
    """``bench prefix --paired``: `sparsetier.tools.bench_prefix_paired` in the peers' python, with
    this package importable there; returns its report."""
    import os
    import sys

    import sparsetier

    env = dict(os.environ)
    here = str(Path(sparsetier.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        args.peers_python, "-W", "ignore", "-m", "sparsetier.tools.bench_prefix_paired",
        "--peers-dir", str(Path(args.peers_dir).resolve()), "--page-size", str(args.page_size),
        "--num-seqs", str(args.num_seqs), "--num-queries", str(args.num_queries),
        "--serve-reqs", str(args.serve_reqs), "--reps", str(args.reps),
        "--tokens", args.token_type, "--max-len", str(args.max_len),
    ]  # fmt: skip
    if args.json:
        cmd += ["--json", args.json]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        print(r.stderr[-4000:], file=sys.stderr)
        raise RuntimeError(f"the paired run failed ({r.returncode})")
    return r.stdout


def compare_containers(
    page_size: int = 16, serve_reqs: int = 500, reps: int = 5, num_seqs: int = 500
) -> dict:
    """The serve loop on the same workload with the tokens in each container, alternating
    containers within each repetition in one process: µs per request (medians) and the median
    paired ratio to uint32 (the tree's own width, borrowed as is)."""
    import statistics

    from sparsetier.tools.bench_prefix_paired import fill_sparsetier, serve_sparsetier
    from sparsetier.tools.workload import TOKEN_TYPES

    ps = page_size
    wl = Workload(WorkloadSpec(num_seqs=num_seqs, align=ps))
    fill = [t for _, t in wl.stream(num_seqs, 1)]
    serve = [t for _, t in wl.stream(serve_reqs, 3)]
    probe = fill_sparsetier([as_tokens("uint32", t) for t in fill], ps, sum(map(len, fill)) + 16)
    cap = int(0.25 * probe.stats()["device_in_tree"] * ps)
    streams = {k: [as_tokens(k, t) for t in serve] for k in TOKEN_TYPES}
    us: dict[str, list[float]] = {k: [] for k in TOKEN_TYPES}
    for _ in range(reps):
        gc.collect()
        gc.disable()
        try:
            for k in TOKEN_TYPES:
                us[k].append(serve_sparsetier(streams[k], ps, cap, 32)[0])
        finally:
            gc.enable()
    return {
        "page_size": ps,
        "reps": reps,
        "serve_us": {k: statistics.median(v) for k, v in us.items()},
        "ratio_to_uint32": {
            k: statistics.median(a / b for a, b in zip(v, us["uint32"], strict=True))
            for k, v in us.items()
        },
    }


def format_containers(r: dict) -> str:
    lines = [
        f"serve loop by token container, page_size {r['page_size']}, {r['reps']} alternating "
        "repetitions",
        "",
        "container  us/request  time / uint32 (median paired ratio)",
        "---------  ----------  -----------------------------------",
    ]
    for k, v in r["serve_us"].items():
        lines.append(f"{k:<9}  {v:>10.2f}  {r['ratio_to_uint32'][k]:>6.2f}x")
    return "\n".join(lines)
