"""``sparsetier bench tiered``: tiered decode against all-resident, in decode tokens/s.

The demo's model and conversations (``sparsetier demo``) run whole, alternating in one process:
tiered (the device holds ``budget`` of the running requests' main KV, or the floor a step needs
where more; the rest waits in pinned host memory) and resident (the device holds all of it),
resolved the same way (``--resolve``), the order swapped from pair to pair. One pair first warms
up (the CUDA context, the kernels' compilation, the allocator) and is not counted; before each
run the last one's runtime is collected (and, on a GPU, its work finished), outside the timers.
A run's figure is its decode tokens over its decode steps' seconds; a pair's ratio is tiered over
resident, and the bench reports the median paired ratio. Prefills are not the same work on both
sides (a tiered prefill loads matched pages from host and makes room on the device), so each pair
also gives the ratio with the prefills' seconds added. Every tiered run's outputs must equal its
resident twin's, or the bench fails.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from sparsetier.errors import ConfigError
from sparsetier.tools.demo import DemoConfig, _run, _sizing, _workload, check_config
from sparsetier.tools.model import ModelConfig, TinySparseModel


@dataclass(frozen=True)
class TieredBenchConfig:
    pairs: int = 3
    device: str = "cpu"
    selection: str = "block"
    resolve: str = "device"
    graphs: bool = False  # both runs' device-resolved steps as CUDA graphs
    budget: float = 0.25
    requests: int = 16
    concurrent: int = 8  # requests decoded at once (the device's floor is a smaller share)
    steps: int = 48
    # A first turn's prompt, tokens (longer: a step's floor of device pages a smaller share).
    context_min: int = 1024
    context_max: int = 3072
    seed: int = 0


def _rates(rt) -> tuple[int, float, float]:
    """Decode tokens, the seconds of the steps that decoded them, and the prefills' seconds."""
    recs = [r for r in rt.records if r.requests]
    return sum(r.requests for r in recs), sum(r.step_s for r in recs), sum(rt.ttfts)


def run(cfg: TieredBenchConfig) -> dict:
    if cfg.pairs < 1:
        raise ConfigError.of("pairs", str(cfg.pairs), "an integer >= 1")
    demo = DemoConfig(
        requests=cfg.requests, concurrent=cfg.concurrent, steps=cfg.steps,
        context_min=cfg.context_min, context_max=cfg.context_max,
        selection=cfg.selection, budget=cfg.budget, resolve=cfg.resolve,
        graphs=cfg.graphs, device=cfg.device, seed=cfg.seed,
    )  # fmt: skip
    check_config(demo)  # what the demo's workload cannot serve, refused before anything runs
    torch.manual_seed(cfg.seed)
    model = TinySparseModel(ModelConfig(seed=cfg.seed)).to(cfg.device)
    work = _workload(demo, model.c.vocab)
    peak, device, resident, host_pages, idx_pages, _ = _sizing(demo, model, work)
    sizes = (host_pages, idx_pages)

    def once(slots: int) -> tuple[dict, int, float, float]:
        # The last run's runtime (held by reference cycles) freed here, not inside a timed
        # step of this one; and on a GPU nothing of it still queued.
        gc.collect()
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        rt, out, *_ = _run(demo, model, work, slots, sizes, None, {}, resolve=cfg.resolve)
        return (out, *_rates(rt))

    rows = []
    for i in range(cfg.pairs + 1):  # the first pair warms up
        t0 = time.perf_counter()
        # The order alternates from pair to pair (tiered first, then resident first).
        if i % 2 == 0:
            tiered, resident_run = once(device), once(resident)
        else:
            resident_run, tiered = once(resident), once(device)
        out_t, tok_t, s_t, p_t = tiered
        out_r, tok_r, s_r, p_r = resident_run
        same = out_t.keys() == out_r.keys() and all(torch.equal(out_t[r], out_r[r]) for r in out_r)
        if not same:
            raise RuntimeError(f"pair {i}: the tiered run's outputs differ from the resident run's")
        rows.append(
            {
                "pair": i,
                "warmup": i == 0,
                "tiered_first": i % 2 == 0,
                "tokens": tok_t,
                "resident_tokens": tok_r,
                "tiered_tokens_per_s": tok_t / s_t,
                "resident_tokens_per_s": tok_r / s_r,
                "ratio": (tok_t / s_t) / (tok_r / s_r),
                # Prefills differ too: a tiered prefill loads matched pages from host and
                # makes room on the device. Decode tokens over prefill and decode seconds:
                "tiered_prefill_s": p_t,
                "resident_prefill_s": p_r,
                "whole_ratio": (tok_t / (s_t + p_t)) / (tok_r / (s_r + p_r)),
                "wall_s": time.perf_counter() - t0,
            }
        )
    timed = [r for r in rows if not r["warmup"]]
    gpu = torch.cuda.get_device_name() if cfg.device == "cuda" else None
    return {
        "config": asdict(cfg),
        "machine": {"cpu": platform.processor() or platform.machine(), "gpu": gpu},
        "date": time.strftime("%Y-%m-%d"),
        "device_slots": device,
        "resident_slots": resident,
        "peak_objects": peak,
        "rows": rows,
        "median_ratio": statistics.median(r["ratio"] for r in timed),
        "median_whole_ratio": statistics.median(r["whole_ratio"] for r in timed),
        "median_tiered_tokens_per_s": statistics.median(r["tiered_tokens_per_s"] for r in timed),
        "median_resident_tokens_per_s": statistics.median(
            r["resident_tokens_per_s"] for r in timed
        ),
        "correct": True,
    }


def format_table(r: dict) -> str:
    c, gpu = r["config"], r["machine"]["gpu"]
    graphs = ", graphs" if c["graphs"] else ""
    share = r["device_slots"] / r["peak_objects"]
    on = f"{c['device']} ({gpu})" if gpu else c["device"]
    lines = [
        f"tiered decode against all-resident: {c['selection']} mode, resolve {c['resolve']}"
        f"{graphs}, {r['device_slots']} KV pages on the device, {share:.0%} of the "
        f"{r['peak_objects']} the running requests hold (resident: {r['resident_slots']}), "
        f"device {on}",
        f"{'pair':>5} {'tiered tok/s':>13} {'resident tok/s':>15} {'ratio':>7} "
        f"{'with prefills':>14}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['pair']:>5} {row['tiered_tokens_per_s']:>13.0f} "
            f"{row['resident_tokens_per_s']:>15.0f} {row['ratio']:>7.3f} "
            f"{row['whole_ratio']:>14.3f}"
            + ("  (warm-up)" if row["warmup"] else "")
            + ("" if row["tiered_first"] else "  (resident first)")
        )
    lines.append(
        f"median paired ratio {r['median_ratio']:.3f} over {c['pairs']} pairs, decode steps "
        f"alone ({r['median_whole_ratio']:.3f} with the prefills' time); outputs bit-identical "
        "in every pair"
    )
    return "\n".join(lines)


def config_from_args(args) -> TieredBenchConfig:
    return replace(
        TieredBenchConfig(),
        **{k: getattr(args, k) for k in TieredBenchConfig.__dataclass_fields__},
    )
