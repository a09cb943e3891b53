"""``sparsetier bench vllm``: the scheduler's CPU per request in vLLM's offloading manager.

Both managers get the same request stream and the calls vLLM's ``OffloadingConnector`` makes
for each request (its scheduler thread makes them):

1. ``on_new_request``;
2. ``lookup`` of each key, head first, until the first miss (each KV group);
3. ``prepare_load`` and ``complete_load`` of the hit keys;
4. per prefill step (``--step-tokens``), ``prepare_store`` of the step's new keys and, a step
   later, ``complete_store``; ``get_stats`` each step;
5. ``on_request_finished``.

The stream: ``--prompt-tokens`` prompts in 16-token blocks; each begins with one of
``--prefixes`` shared prefixes of ``--prefix-blocks`` blocks, chosen with Zipf(``--zipf``)
popularity, then blocks of its own; the pool holds ``--pool-requests`` prompts' worth of
chunks, so stores evict. The keys are vLLM's (a 32-byte block hash and the group index), held
as ``bytes``, with the token positions the connector records on the request's context; making
them is outside the timer. The two managers run the same requests alternately in one process
(vLLM's first on even requests, ours on odd ones): each request's time is paired with the other
side's time for the same request, and the report gives the median of the paired ratios.
"""

from __future__ import annotations

import gc
import hashlib
import statistics
import time
from dataclasses import asdict, dataclass, field

from sparsetier.errors import ConfigError


@dataclass
class VllmBenchConfig:
    requests: int = 120
    warmup: int = 20
    prompt_tokens: int = 65_536
    block_tokens: int = 16
    prefix_blocks: int = 3_000
    prefixes: int = 16
    zipf: float = 1.1
    groups: int = 1
    pool_requests: float = 6.0
    step_tokens: int = 2_048
    policy: str = "lru"
    seed: int = 0

    def __post_init__(self) -> None:
        from sparsetier import _checks

        _checks.count("warmup", self.warmup, 0)
        # (Two requests at least: the report's spread takes quantiles of the paired ratios.)
        _checks.count("requests", self.requests, 2)
        _checks.count("prefix_blocks", self.prefix_blocks, 0)  # (0: no shared prefix)
        for name in ("prompt_tokens", "block_tokens", "prefixes", "groups", "step_tokens"):
            _checks.count(name, getattr(self, name), 1)
        _checks.count("seed", self.seed, 0)
        _checks.real("zipf", self.zipf)
        # (At least one request's blocks: the pool's chunks.)
        _checks.real("pool_requests", self.pool_requests, 1.0)
        if self.prefix_blocks > self.prompt_tokens // self.block_tokens:
            raise ConfigError.of("prefix_blocks", self.prefix_blocks,
                                 f"<= the prompt's {self.prompt_tokens // self.block_tokens} "
                                 "blocks")  # fmt: skip


@dataclass
class Side:
    total_ms: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    hits: int = 0
    evictions: int = 0


def _keys(cfg: VllmBenchConfig):
    """The request stream: for each request, its keys per group, head first."""
    import numpy as np
    from vllm.v1.kv_offload.base import make_offload_key

    rng = np.random.default_rng(cfg.seed)
    blocks = cfg.prompt_tokens // cfg.block_tokens
    ranks = np.arange(1, cfg.prefixes + 1, dtype=np.float64)
    weights = ranks ** (-cfg.zipf)
    weights /= weights.sum()
    choice = rng.choice(cfg.prefixes, size=cfg.requests, p=weights)

    def digest(text: str) -> bytes:
        return hashlib.blake2b(text.encode(), digest_size=32).digest()

    prefix_hashes = {}
    stream = []
    for i, p in enumerate(choice):
        if p not in prefix_hashes:
            prefix_hashes[p] = [digest(f"p{p}:{b}") for b in range(cfg.prefix_blocks)]
        hashes = prefix_hashes[p] + [digest(f"r{i}:{b}") for b in range(blocks - cfg.prefix_blocks)]
        stream.append([[make_offload_key(h, g) for h in hashes] for g in range(cfg.groups)])
    return stream


def _context(name: str, per_group: list[list[bytes]], block_tokens: int):
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=name)
    for keys in per_group:
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * block_tokens)
    return ctx


def _serve(manager, ctx, per_group, cfg: VllmBenchConfig, side: Side) -> None:
    """One request's manager calls (module docs), timed by phase. What only the harness does
    (slicing the step's offers) is outside the timers."""
    from vllm.v1.kv_offload.base import LookupResult

    t = time.perf_counter_ns
    hit = LookupResult.HIT
    t0 = t()
    manager.on_new_request(ctx)
    hit_blocks = len(per_group[0])
    for keys in per_group:
        n = 0
        for k in keys:
            if manager.lookup(k, ctx) is not hit:
                break
            n += 1
        hit_blocks = min(hit_blocks, n)
    t1 = t()
    hit_keys = [k for keys in per_group for k in keys[:hit_blocks]]
    t2 = t()
    if hit_keys:
        manager.prepare_load(hit_keys, ctx)
        manager.complete_load(hit_keys, ctx)
    t3 = t()
    step = cfg.step_tokens // cfg.block_tokens
    offers = [
        [k for keys in per_group for k in keys[lo : lo + step]]
        for lo in range(hit_blocks, len(per_group[0]), step)
    ]
    stored = []
    t4 = t()
    pending = None
    for offer in offers:
        out = manager.prepare_store(offer, ctx)
        if pending is not None:
            manager.complete_store(pending, ctx)
        pending = out.keys_to_store if out is not None else None
        stored.append(out)
        manager.get_stats()
    if pending is not None:
        manager.complete_store(pending, ctx)
    manager.on_request_finished(ctx)
    t5 = t()
    side.evictions += sum(len(out.evicted_keys) for out in stored if out is not None)
    side.hits += len(hit_keys)
    marks = {"lookup": t1 - t0, "load": t3 - t2, "store+finish": t5 - t4}
    side.total_ms.append(sum(marks.values()) / 1e6)
    for k, v in marks.items():
        side.phases.setdefault(k, []).append(v / 1e6)


def run(cfg: VllmBenchConfig, progress: bool = True) -> dict:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from sparsetier.tools.bench_decode import _cpu_model
    from sparsetier.vllm import SparsetierOffloadingManager

    stream = _keys(cfg)
    blocks = cfg.prompt_tokens // cfg.block_tokens
    num_chunks = int(cfg.pool_requests * blocks * cfg.groups)
    kw = dict(num_chunks=num_chunks, cache_policy=cfg.policy)
    sides = {"vllm": Side(), "sparsetier": Side()}
    managers = {"vllm": CPUOffloadingManager(**kw), "sparsetier": SparsetierOffloadingManager(**kw)}
    it = range(cfg.requests)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="bench vllm", unit="req")
    gc_was = gc.isenabled()
    gc.disable()  # a collection inside one side's timer would charge it to that side
    try:
        for i in it:
            order = ["vllm", "sparsetier"] if i % 2 == 0 else ["sparsetier", "vllm"]
            for name in order:
                ctx = _context(f"{name}-{i}", stream[i], cfg.block_tokens)
                _serve(managers[name], ctx, stream[i], cfg, sides[name])
            if i % 8 == 7:
                gc.collect()
    finally:
        if gc_was:
            gc.enable()
    a, b = sides["vllm"], sides["sparsetier"]
    assert a.hits == b.hits and a.evictions == b.evictions, "the managers disagreed"
    w = min(cfg.warmup, cfg.requests // 5)
    ratios = [x / y for x, y in zip(a.total_ms[w:], b.total_ms[w:], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    phases = {
        p: {
            "vllm_ms": statistics.median(a.phases[p][w:]),
            "sparsetier_ms": statistics.median(b.phases[p][w:]),
        }
        for p in a.phases
    }
    return {
        "config": asdict(cfg),
        "machine": _cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "paired": len(ratios),
        "keys_per_request": blocks * cfg.groups,
        "hit_keys_per_request": a.hits / cfg.requests,
        "evictions": a.evictions,
        "vllm_ms": statistics.median(a.total_ms[w:]),
        "sparsetier_ms": statistics.median(b.total_ms[w:]),
        "ratio_median": statistics.median(ratios),
        "ratio_q1": q[0],
        "ratio_q3": q[2],
        "phases": phases,
    }


def format_report(r: dict) -> str:
    c = r["config"]
    lines = [
        f"bench vllm ({r['date']}, {r['machine']}): {r['paired']} requests "
        f"paired after {c['requests'] - r['paired']} warm-up, {c['prompt_tokens']}-token prompts "
        f"({r['keys_per_request']} keys), {c['prefixes']} prefixes of {c['prefix_blocks']} "
        f"blocks (Zipf {c['zipf']}), pool of {c['pool_requests']} prompts, {c['policy']}",
        f"  hit keys per request: {r['hit_keys_per_request']:.0f}; evictions: {r['evictions']}",
        f"  {'phase':<14}{'vLLM ms':>10}{'sparsetier ms':>15}{'ratio':>8}",
    ]
    for p, v in r["phases"].items():
        ratio = v["vllm_ms"] / v["sparsetier_ms"] if v["sparsetier_ms"] else float("inf")
        lines.append(f"  {p:<14}{v['vllm_ms']:>10.2f}{v['sparsetier_ms']:>15.3f}{ratio:>8.1f}")
    lines.append(
        f"  {'request':<14}{r['vllm_ms']:>10.2f}{r['sparsetier_ms']:>15.3f}"
        f"{r['vllm_ms'] / r['sparsetier_ms']:>8.1f}"
    )
    lines.append(
        f"  median paired ratio (vLLM / sparsetier): {r['ratio_median']:.1f}x "
        f"(quartiles {r['ratio_q1']:.1f}-{r['ratio_q3']:.1f})"
    )
    return "\n".join(lines)
