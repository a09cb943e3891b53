"""``sparsetier demo``: decode steps of a sparse-attention model whose main KV does not fit on
the device, checked against the same run with everything resident.

Workload: requests over shared system prompts with Zipf popularity, each with a unique suffix;
requests arrive and complete during the run. The tiered run keeps `budget` of the requests'
main KV on the device; the resident run keeps all of it. Their outputs must be bit-identical.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from sparsetier.errors import ConfigError
from sparsetier.model import ModelConfig, TinySparseModel
from sparsetier.runtime import DecodeRuntime
from sparsetier.workload import Workload, WorkloadSpec


@dataclass
class DemoConfig:
    requests: int = 12
    concurrent: int = 4
    steps: int = 48
    prompts: int = 4
    context_min: int = 1024
    context_max: int = 3072
    page_size: int = 16
    selection: str = "block"
    block_size: int = 0  # 0: the page size
    topk: int = 8  # blocks (block mode); token mode reads topk_tokens tokens
    topk_tokens: int = 64
    budget: float = 0.25
    prefetch: bool = True
    share_prompts: bool = True
    faults: bool = False
    device: str = "cpu"
    seed: int = 0


def _workload(cfg: DemoConfig, vocab: int) -> list[tuple[torch.Tensor, int, tuple | None]]:
    wl = Workload(
        WorkloadSpec(
            num_seqs=cfg.requests,
            num_prompts=cfg.prompts,
            min_len=cfg.context_min,
            max_len=cfg.context_max,
            sys_min=cfg.context_min // 2,
            sys_max=cfg.context_min,
            vocab=vocab,
            seed=cfg.seed,
        )
    )
    rng = np.random.default_rng(cfg.seed + 1)
    out = []
    for pid, toks in wl.stream(cfg.requests, 1):
        steps = int(rng.integers(cfg.steps // 2, cfg.steps + 1))
        shared = (pid, len(wl.prompts[pid])) if pid >= 0 and cfg.share_prompts else None
        out.append((torch.from_numpy(toks % vocab), steps, shared))
    return out


#: What `--faults` arms, by global decode step: one load failure (the retry succeeds), a
#: layer whose load and retry both fail (the requests that needed it fail), and a failed
#: write-through (retried at the next step).
FAULT_PLAN = {3: ("load", 1, None), 9: ("load", 2, 1), 15: ("backup", 1, None)}


def _run(cfg: DemoConfig, model, work, device_slots, host_slots, progress, faults, aborts):
    """Runs the workload; `faults` arms failures by step, `aborts` ends requests after a step
    (how the resident reference replays the tiered run's failures)."""
    ps = cfg.page_size
    idx_pages = sum(-(-(len(t) + s) // ps) for t, s, _ in work) + 8
    token = cfg.selection == "token"
    rt = DecodeRuntime(
        model,
        page_size=ps,
        device_slots=device_slots,
        host_slots=host_slots,
        indexer_pages=idx_pages,
        topk=cfg.topk_tokens if token else cfg.topk,
        prefetch=cfg.prefetch,
        io_backend="cpu" if cfg.device == "cpu" else "kernel",
        device=cfg.device,
        selection=cfg.selection,
        block_size=cfg.block_size or None,
    )
    queue = list(enumerate(work))
    outputs: dict[int, torch.Tensor] = {}
    while queue or rt.requests:
        while queue and len(rt.requests) < cfg.concurrent:
            rid, (prompt, steps, shared) = queue.pop(0)
            rt.add_request(rid, prompt, steps, shared)
        step = len(rt.records)
        if step in faults:
            rt.inject_faults(*faults[step])
        rt.step()
        if progress is not None:
            progress.update(1)
        for rid in aborts.get(step, []):
            if rid in rt.requests:
                rt.abort(rid)
        for rid in [r.rid for r in rt.requests.values() if r.done]:
            outputs[rid] = torch.stack(rt.finish_request(rid).outputs)
    rt.drain()
    return rt, outputs


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    if cfg.device not in ("cpu", "cuda") or (
        cfg.device == "cuda" and not torch.cuda.is_available()
    ):
        raise ConfigError.of("device", cfg.device, "cpu, or cuda where a GPU is present")
    if cfg.faults and cfg.device != "cpu":
        raise ConfigError.of("faults", "True", "the cpu engine (its fault hook)")
    torch.manual_seed(cfg.seed)
    model = TinySparseModel(ModelConfig(seed=cfg.seed)).to(cfg.device)
    work = _workload(cfg, model.c.vocab)
    ps, layers = cfg.page_size, model.c.layers
    # Main KV objects are (request, page, layer): the most alive at once.
    pages = [-(-(len(t) + s) // ps) for t, s, _ in work]
    longest = sorted(pages, reverse=True)
    peak = sum(longest[: cfg.concurrent]) * layers
    host = sum(pages) * layers + 8
    # Floor: a prefill allocates its pages for every layer at once, and each layer's plan
    # pins the batch's selection next to every running request's page being written.
    per_entry = max(1, (cfg.block_size or ps) // ps)
    read = cfg.topk_tokens if cfg.selection == "token" else cfg.topk * per_entry
    floor = longest[0] * layers + cfg.concurrent * (2 * layers + 2 * read) + 1
    device = max(math.ceil(cfg.budget * peak), floor)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="tiered decode", unit="step")
    faults = FAULT_PLAN if cfg.faults else {}
    t0 = time.perf_counter()
    rt, out = _run(cfg, model, work, device, host, bar, faults, {})
    tiered_s = time.perf_counter() - t0
    if bar is not None:
        bar.close()
        bar = tqdm(desc="resident check", unit="step")
    aborts: dict[int, list[int]] = {}
    for step, rid, _ in rt.failures:
        aborts.setdefault(step, []).append(rid)
    _, ref = _run(cfg, model, work, host, host, bar, {}, aborts)
    if bar is not None:
        bar.close()
    failed = sorted({rid for _, rid, _ in rt.failures})
    exact = out.keys() == ref.keys() and all(torch.equal(out[r], ref[r]) for r in ref)
    # End state: every request ended; nothing pinned, in flight, quarantined or leaked.
    end = rt.scheduler.stats()
    rt.scheduler.validate()
    recs = rt.records
    core = rt.scheduler.totals()
    step_s = [r.step_s for r in recs if r.requests]
    decode_tokens = sum(r.requests for r in recs)
    totals = {
        **{k: core[k] for k in core if k not in ("step", "device_used", "device_capacity")},
        "requests": len(work),
        "steps": len(recs),
        "tokens": decode_tokens,
        "prompt_tokens": int(sum(len(t) for t, _, _ in work)),
        "selection": cfg.selection,
        "prefix_device_hits": rt.prefix_device_hits,
        "prefix_host_hits": rt.prefix_host_hits,
        "prefix_exposed_wait_s": rt.prefix_exposed_wait_s,
        "device_slots": device,
        "peak_objects": peak,
        "budget": cfg.budget,
        "exposed_wait_s": core["exposed_wait_ns"] / 1e9,
        "queue_s": core["queue_ns"] / 1e9,
        "transfer_s": core["transfer_ns"] / 1e9,
        "scheduler_cpu_s": core["cpu_ns"] / 1e9,
        "tiered_s": tiered_s,
        "ttft_p50_s": _percentile(rt.ttfts, 50),
        "ttft_p99_s": _percentile(rt.ttfts, 99),
        "tpot_p50_s": _percentile(step_s, 50),
        "tpot_p99_s": _percentile(step_s, 99),
        "tokens_per_s": decode_tokens / max(sum(step_s), 1e-12),
        "failed_requests_list": failed,
        "failures": [{"step": s, "rid": r, "reason": why} for s, r, why in rt.failures],
        "aborted_requests": rt.aborted,
        "end_pins": end["pins"],
        "end_handles": end["handles"],
        "end_quarantined_slots": end["device_quarantined"] + end["host_quarantined"],
        "end_transfers_in_flight": end["transfers_in_flight"],
        "end_device_leaked": end["device_used"] - end["device_ready"] - end["device_loading"],
        "correct": exact,
    }
    steps = []
    for r in recs:
        d = {"step": r.step, "requests": r.requests, "step_s": r.step_s, "failed": r.failed}
        d.update(r.core)
        steps.append(d)
    return {"config": asdict(cfg), "totals": totals, "steps": steps}


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def format_summary(r: dict) -> str:
    t = r["totals"]
    rows = [
        ("requests / steps / tokens decoded", f"{t['requests']} / {t['steps']} / {t['tokens']}"),
        ("selection", f"{t['selection']} mode"),
        (
            "device budget",
            f"{t['device_slots']} KV pages, {t['budget']:.0%} of the {t['peak_objects']} the"
            " running requests would hold unshared",
        ),
        (
            "selected / distinct pages",
            f"{t['selected']} / {t['pages']} (ready {t['ready']}, loaded {t['loaded']}, "
            f"joined in flight {t['joined']})",
        ),
        ("device byte hit rate", f"{t['device_byte_hit_rate']:.3f}"),
        (
            "bytes needed / transferred",
            f"{_mib(t['bytes_needed'])} / {_mib(t['bytes_transferred'])} in "
            f"{t['load_submissions']} load submissions ({t['copy_segments']} copies)",
        ),
        ("read amplification", f"{t['read_amplification']:.3f} (moved / needed among moved)"),
        (
            "prefetch",
            f"accuracy {t['prefetch_accuracy']:.3f}, loaded {t['prefetch_loaded']} pages, "
            f"wasted {_mib(t['prefetch_wasted_bytes'])}, peak pins {t['prefetch_pinned_peak']}",
        ),
        (
            "wait",
            f"exposed {t['exposed_wait_s'] * 1e3:.2f} ms, queueing {t['queue_s'] * 1e3:.2f} ms,"
            f" transfer {t['transfer_s'] * 1e3:.2f} ms over {t['tiered_s']:.2f} s",
        ),
        (
            "TTFT / TPOT (p50, p99)",
            f"{t['ttft_p50_s'] * 1e3:.1f}, {t['ttft_p99_s'] * 1e3:.1f} ms / "
            f"{t['tpot_p50_s'] * 1e3:.1f}, {t['tpot_p99_s'] * 1e3:.1f} ms; "
            f"{t['tokens_per_s']:.0f} tokens/s",
        ),
        (
            "prefix hits (device / host)",
            f"{t['prefix_device_hits']} / {t['prefix_host_hits']} shared-prompt blocks"
            f" (load-back wait {t['prefix_exposed_wait_s'] * 1e3:.2f} ms)",
        ),
        (
            "faults",
            f"{t['failed_loads']} failed loads ({t['retried_loads']} retried), "
            f"{t['failed_backups']} failed backups, failed requests {t['failed_requests_list']}",
        ),
        (
            "end state",
            f"pins {t['end_pins']}, quarantined {t['end_quarantined_slots']}, leaked slots "
            f"{t['end_device_leaked']}, in flight {t['end_transfers_in_flight']}",
        ),
        ("correctness (tiered == resident)", "PASS" if t["correct"] else "FAIL"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def write_json(r: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(r, f, indent=2)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in r["steps"] if s["requests"]]
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    ax[0].plot(x, [s["device_byte_hit_rate"] for s in steps], label="device byte hit rate")
    ax[0].plot(x, [s["prefetch_accuracy"] for s in steps], label="prefetch accuracy")
    ax[0].legend(loc="lower right")
    ax[1].plot(x, [s["bytes_transferred"] / (1 << 20) for s in steps])
    ax[1].set_ylabel("MiB moved")
    ax[2].plot(x, [s["read_amplification"] for s in steps])
    ax[2].set_ylabel("read amplification")
    ax[3].plot(x, [s["exposed_wait_ns"] / 1e6 for s in steps], label="exposed wait")
    ax[3].plot(x, [s["step_s"] * 1e3 for s in steps], label="step (TPOT)")
    ax[3].set_ylabel("ms")
    ax[3].legend(loc="upper right")
    ax[3].set_xlabel("decode step")
    fig.tight_layout()
    fig.savefig(path)
