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
    topk: int = 8
    budget: float = 0.25
    prefetch: bool = True
    share_prompts: bool = True
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


def _run(
    cfg: DemoConfig, model: TinySparseModel, work, device_slots: int, host_slots: int, progress
):
    ps = cfg.page_size
    idx_pages = sum(-(-(len(t) + s) // ps) for t, s, _ in work) + 8
    rt = DecodeRuntime(
        model,
        page_size=ps,
        device_slots=device_slots,
        host_slots=host_slots,
        indexer_pages=idx_pages,
        topk=cfg.topk,
        prefetch=cfg.prefetch,
        io_backend="cpu" if cfg.device == "cpu" else "kernel",
        device=cfg.device,
    )
    queue = list(enumerate(work))
    outputs: dict[int, torch.Tensor] = {}
    arrivals = completions = 0
    while queue or rt.requests:
        while queue and len(rt.requests) < cfg.concurrent:
            rid, (prompt, steps, shared) = queue.pop(0)
            rt.add_request(rid, prompt, steps, shared)
            arrivals += 1
        rt.step()
        if progress is not None:
            progress.update(1)
        for rid in [r.rid for r in rt.requests.values() if r.done]:
            outputs[rid] = torch.stack(rt.finish_request(rid).outputs)
            completions += 1
    return rt, outputs


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    if cfg.device not in ("cpu", "cuda") or (
        cfg.device == "cuda" and not torch.cuda.is_available()
    ):
        from sparsetier.errors import ConfigError

        raise ConfigError.of("device", cfg.device, "cpu, or cuda where a GPU is present")
    torch.manual_seed(cfg.seed)
    model = TinySparseModel(ModelConfig(seed=cfg.seed)).to(cfg.device)
    work = _workload(cfg, model.c.vocab)
    ps, layers = cfg.page_size, model.c.layers
    # Main KV objects are (request, block, layer): the most alive at once.
    longest = sorted((-(-(len(t) + s) // ps) for t, s, _ in work), reverse=True)
    peak = sum(longest[: cfg.concurrent]) * layers
    host = sum(-(-(len(t) + s) // ps) for t, s, _ in work) * layers + 8
    device = max(math.ceil(cfg.budget * peak), cfg.concurrent * (layers + cfg.topk) + 1)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="tiered decode", unit="step")
    t0 = time.perf_counter()
    rt, out = _run(cfg, model, work, device, host, bar)
    tiered_s = time.perf_counter() - t0
    if bar is not None:
        bar.close()
        bar = tqdm(desc="resident check", unit="step")
    _, ref = _run(cfg, model, work, host, host, bar)
    if bar is not None:
        bar.close()
    exact = all(torch.equal(out[r], ref[r]) for r in ref)
    recs = rt.records
    totals = {
        "requests": len(work),
        "steps": len(recs),
        "tokens": sum(r.requests for r in recs),
        "prompt_tokens": int(sum(len(t) for t, _, _ in work)),
        "prefix_device_hits": rt.prefix_device_hits,
        "prefix_host_hits": rt.prefix_host_hits,
        "prefix_exposed_wait_s": rt.prefix_exposed_wait_s,
        "device_slots": device,
        "peak_objects": peak,
        "budget": cfg.budget,
        "selected": sum(r.selected for r in recs),
        "distinct": sum(r.distinct for r in recs),
        "ready": sum(r.ready for r in recs),
        "loads": sum(r.loads for r in recs),
        "inflight_reuse": sum(r.inflight_reuse for r in recs),
        "bytes_needed": sum(r.bytes_needed for r in recs),
        "bytes_transferred": sum(r.bytes_transferred for r in recs),
        "exposed_wait_s": sum(r.exposed_wait_s for r in recs),
        "tiered_s": tiered_s,
        "failed_transfers": rt.directory.stats()["totals"]["failed_transfers"],
        "retries": rt.directory.stats()["totals"]["retries"],
        "quarantined_slots": rt.directory.stats()["device_quarantined"],
        "aborted_requests": rt.aborted,
        "correct": exact,
    }
    totals["device_byte_hit_rate"] = totals["ready"] / max(totals["distinct"], 1)
    totals["read_amplification"] = totals["bytes_transferred"] / max(totals["bytes_needed"], 1)
    return {"config": asdict(cfg), "totals": totals, "steps": [asdict(r) for r in recs]}


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def format_summary(r: dict) -> str:
    t = r["totals"]
    rows = [
        ("requests / steps / tokens decoded", f"{t['requests']} / {t['steps']} / {t['tokens']}"),
        (
            "device budget",
            f"{t['device_slots']} KV blocks, {t['budget']:.0%} of the {t['peak_objects']} the"
            " running requests would hold unshared",
        ),
        ("device byte hit rate", f"{t['device_byte_hit_rate']:.3f}"),
        (
            "bytes needed / transferred",
            f"{_mib(t['bytes_needed'])} / {_mib(t['bytes_transferred'])}",
        ),
        ("read amplification", f"{t['read_amplification']:.3f}"),
        ("in-flight reuse", f"{t['inflight_reuse']} blocks"),
        ("exposed wait", f"{t['exposed_wait_s'] * 1e3:.2f} ms over {t['tiered_s']:.2f} s"),
        (
            "prefix hits (device / host)",
            f"{t['prefix_device_hits']} / {t['prefix_host_hits']} shared-prompt blocks"
            f" (load-back wait {t['prefix_exposed_wait_s'] * 1e3:.2f} ms)",
        ),
        ("failed transfers", str(t["failed_transfers"])),
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

    steps = r["steps"]
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    ax[0].plot(x, [s["ready"] / max(s["distinct"], 1) for s in steps])
    ax[0].set_ylabel("device hit rate")
    ax[1].plot(x, [s["bytes_transferred"] / (1 << 20) for s in steps])
    ax[1].set_ylabel("MiB moved")
    ax[2].plot(x, [s["exposed_wait_s"] * 1e3 for s in steps])
    ax[2].set_ylabel("exposed wait (ms)")
    ax[2].set_xlabel("decode step")
    fig.tight_layout()
    fig.savefig(path)
