"""``sparsetier demo``: decode steps of a sparse-attention model whose main KV does not fit on
the device, checked against the same run with everything resident.

Workload: conversations over shared system prompts with Zipf popularity. A conversation's first
request is a system prompt plus a unique user message; each later turn's prompt is the previous
turn's prompt, its answer and a new message, so it hits the previous turn's pages in the prefix
cache. Requests arrive and complete during the run. The tiered run keeps `budget` of the
requests' main KV on the device; the resident run keeps all of it. Their outputs must be
bit-identical.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from sparsetier.errors import ConfigError, RequestFailedError
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.record import fmt_ratio
from sparsetier.tools.runtime import DecodeRuntime
from sparsetier.tools.workload import Workload, WorkloadSpec


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
    turns: int = 3  # most turns of one conversation
    layout: str = "layer_first"
    kv_format: str = "bf16"  # or fp8: DeepSeek-V3.2's packed FP8 rows and Indexer-K pages
    token_map: str = "core"  # token mode: where tokens become pages (core, or device)
    # Where the tiered run's decode layers become slots: the core ("host") or the device
    # resolver ("device"); the resident run always plans on the host.
    resolve: str = "host"
    # With resolve "device" on a GPU: the tiered runs' device-resolved steps replayed as CUDA
    # graphs (`DecodeRuntime(graphs=True)`).
    graphs: bool = False
    # What a prefix hit restores of its main KV: by the core's cost model ("auto"), Indexer-K
    # only ("indexer"), everything ("full"), or the pages predicted selected ("predicted");
    # both runs alike.
    restore: str = "auto"
    # L3 under the tiered run's prefix tier ("file" or "mooncake": a local master started and
    # stopped here), with a host tier too small for the conversations: a later turn's prefix
    # comes back from the store. None: no L3.
    storage_backend: str | None = None
    faults: bool = False
    # A request that failed (a load and its retry, or its Indexer-K restore) is restarted once
    # by the runtime (`DecodeRuntime.restart`); off: it ends, and its conversation with it.
    restart_failed: bool = False
    trace: str | None = None  # write the tiered run's directory trace here (.npz)
    device: str = "cpu"
    seed: int = 0


@dataclass
class Turn:
    """One request of a conversation: the new message, and how many tokens to decode."""

    message: torch.Tensor
    steps: int


def _workload(cfg: DemoConfig, vocab: int) -> list[list[Turn]]:
    """Conversations: the first turn's message is a system prompt plus a user suffix; later
    turns add a short message after the previous prompt and answer."""
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
    convs: list[list[Turn]] = []
    left = cfg.requests
    for _, toks in wl.stream(cfg.requests, 1):
        if left == 0:
            break
        n = min(left, int(rng.integers(1, cfg.turns + 1)))
        left -= n
        turns = []
        for i in range(n):
            steps = int(rng.integers(cfg.steps // 2, cfg.steps + 1))
            msg = toks if i == 0 else rng.integers(1, vocab, size=int(rng.integers(8, 64)))
            turns.append(Turn(torch.from_numpy(msg % vocab), steps))
        convs.append(turns)
    return convs


#: What `--faults` arms, by global decode step: one load failure (the retry succeeds), a
#: failed write-through (retried at the next step), and a failed Indexer-K restore of the next
#: prefix hit restored from host (that request fails in its prefill).
FAULT_PLAN = {
    1: ("restore", 1, None),
    3: ("load", 1, None),
    15: ("backup", 1, None),
}

#: A layer whose load and retry both fail (the requests that needed it fail), armed at the
#: first step from the first of these on at which a follow-up turn runs, or at the second at
#: the latest: failing only first turns would end their conversations before any prefix hit
#: is restored from host, and the restore fault would have nothing to fail.
FOLLOW_UP_FAULT = (9, 40, ("load", 2, 1))

#: On the cpu engine the single load failure is a copy worker's panic instead: a bug in the
#: copy path, which the engine contains as a failed copy (the CUDA engines copy on the GPU,
#: with no worker of theirs to panic, and take the plain failure).
PANIC_STEP = 3


def fault_plan(device: str) -> dict:
    """What `--faults` arms on `device`: by global decode step, and `"follow_up"`
    (`FOLLOW_UP_FAULT`)."""
    plan: dict = dict(FAULT_PLAN)
    if device == "cpu":
        plan[PANIC_STEP] = (*plan[PANIC_STEP], None, True)
    plan["follow_up"] = FOLLOW_UP_FAULT
    return plan


@dataclass
class FailureLog:
    """What failed in a run, as the resident run replays it: requests that failed in a step
    (by step), prefills that failed (rid, "add" or "restart"), and the requests restarted."""

    failed_at: dict[int, list[int]] = field(default_factory=dict)
    refused: set[tuple[int, str]] = field(default_factory=set)
    restarted: list[int] = field(default_factory=list)


def _run(
    cfg: DemoConfig, model, work, device_slots, sizes, progress, faults, replay=None,
    trace=None, resolve="host", storage=None,
):  # fmt: skip
    """Runs the conversations; `faults` arms failures by step. Returns what failed as a
    `FailureLog`; the resident reference takes the tiered run's as `replay` and ends the same
    requests at the same points (after the same step, or right after the same prefill). A
    turn's follow-up is queued when it finishes, with the answer in its prompt."""
    host_pages, idx_pages = sizes
    token = cfg.selection == "token"
    rt = DecodeRuntime(
        model,
        page_size=cfg.page_size,
        device_slots=device_slots,
        host_pages=host_pages,
        indexer_pages=idx_pages,
        topk=cfg.topk_tokens if token else cfg.topk,
        prefetch=cfg.prefetch,
        io_backend="cpu" if cfg.device == "cpu" else "kernel",
        device=cfg.device,
        selection=cfg.selection,
        block_size=cfg.block_size or None,
        layout=cfg.layout,
        kv_format=cfg.kv_format,
        token_map=cfg.token_map,
        keep_records=None,  # every step goes into the summary and the JSON
        resolve=resolve,
        restore=cfg.restore,
        storage=storage,
        graphs=cfg.graphs and resolve == "device",
    )
    prefill_bytes = 0  # matched-block KV first loaded by the suffix prefills
    if trace:
        rt.scheduler.start_journal()
    # (conversation, turn, prompt); rids are numbered as turns are queued.
    queue = [(c, 0, turns[0].message) for c, turns in enumerate(work)]
    rids: dict[tuple[int, int], int] = {}
    live: dict[int, tuple[int, int]] = {}
    outputs: dict[int, torch.Tensor] = {}
    admissions: dict[int, dict] = {}
    log = FailureLog()
    play = replay or FailureLog()
    restores: list[dict] = []  # each finished request's restore (restore_status)

    def arm(step: int) -> None:
        if step in faults:
            rt.inject_faults(*faults.pop(step))
        if "follow_up" in faults:
            first, last, fault = faults["follow_up"]
            if step >= last or (step >= first and any(i > 0 for _, i in live.values())):
                del faults["follow_up"]
                rt.inject_faults(*fault)

    def admit(rid: int, attempt: str, call) -> bool:
        """Runs a prefill (`attempt`: "add" or "restart"); False if it failed here or, in the
        resident run, where the tiered run's failed (then the request is ended at once)."""
        try:
            call()
        except RequestFailedError:
            log.refused.add((rid, attempt))  # reported in rt.failures
            return False
        if (rid, attempt) in play.refused:
            rt.abort(rid)
            return False
        return True

    def ended(rid: int) -> None:
        """A request that failed (or was ended where the tiered run's failed): with
        `restart_failed` the runtime restarts it once, in both runs alike; otherwise its
        conversation ends there."""
        if cfg.restart_failed and rid not in log.restarted:
            log.restarted.append(rid)

            def again():
                admissions[rid] = rt.restart(rid)

            if not admit(rid, "restart", again):
                ended(rid)

    while queue or rt.requests:
        while queue and len(rt.requests) < cfg.concurrent:
            c, i, prompt = queue.pop(0)
            rid = rids.setdefault((c, i), len(rids))
            before = rt.prefix_stats()["prefix_kv_bytes_first"]
            arm(rt.steps)
            live[rid] = (c, i)

            def add(rid=rid, c=c, i=i, prompt=prompt):
                admissions[rid] = rt.add_request(rid, prompt, work[c][i].steps)

            if admit(rid, "add", add):
                prefill_bytes += rt.prefix_stats()["prefix_kv_bytes_first"] - before
            else:
                ended(rid)
        step = rt.steps
        arm(step)
        rec = rt.step()
        if progress is not None:
            progress.update(1)
        if rec.failed:
            log.failed_at[step] = list(rec.failed)
        for rid in play.failed_at.get(step, []):
            if rid in rt.requests:
                rt.abort(rid)
                # As the failure did: that step's output is not the request's.
                del rt.ended[rid].outputs[-1]
        for rid in sorted(set(rec.failed) | set(play.failed_at.get(step, []))):
            ended(rid)
        for rid in [r.rid for r in rt.requests.values() if r.done]:
            r = rt.finish_request(rid)
            outputs[rid] = torch.stack(r.outputs)
            if r.restore is not None:
                restores.append(r.restore)
            c, i = live.pop(rid)
            if i + 1 < len(work[c]):
                nxt = torch.cat([torch.from_numpy(r.tokens()), work[c][i + 1].message])
                queue.append((c, i + 1, nxt))
    rt.drain()
    if trace:
        from sparsetier.replay import save_trace

        save_trace(trace, rt.scheduler.take_journal())
    return rt, outputs, admissions, prefill_bytes, log, restores


@contextmanager
def _storage(kind: str | None):
    """The L3 backend `kind` for the tiered run, and what it needs (a temporary directory, a
    local Mooncake master), gone afterwards; None without L3."""
    if kind is None:
        yield None
        return
    from sparsetier.l3 import MooncakeMaster, make_backend

    if kind == "file":
        with tempfile.TemporaryDirectory(prefix="sparsetier-l3-") as d:
            yield make_backend("file", {"path": d})
        return
    if kind != "mooncake":
        raise ConfigError.of("storage_backend", kind, "file or mooncake")
    master = MooncakeMaster()
    try:
        yield make_backend(
            "mooncake",
            {
                "master": master.master,
                "metadata_server": master.metadata_server,
                "global_segment_size": 64 << 20,
                "local_buffer_size": 16 << 20,
            },
        )
    finally:
        master.stop()


def _prefix_moved(rt: DecodeRuntime) -> int:
    """Bytes a run moved for its prefix hits' host-restored pages: Indexer-K restored and main
    KV loaded (re-loads included)."""
    px = rt.prefix_stats()
    return px["indexer_bytes_restored"] + px["prefix_kv_bytes_loaded"]


def _by_choice(restores: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for st in restores:
        c = out.setdefault(
            st["choice"],
            {"requests": 0, "loaded": 0, "bulk_submissions": 0, "on_demand": 0, "wait_s": 0.0},
        )
        c["requests"] += 1
        for k in ("loaded", "bulk_submissions", "on_demand"):
            c[k] += st[k]
        c["wait_s"] += st["exposed_wait_ns"] / 1e9
    return out


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def _sizing(cfg: DemoConfig, model, work) -> tuple[int, int, int, int, int, list[int]]:
    """The pools a run of `work` needs: the running requests' peak main KV objects, the tiered
    run's device slots (`budget` of that peak, above the floor a step needs), the resident
    run's, host pages, Indexer-K device pages, and each conversation's most pages."""
    ps, layers = cfg.page_size, model.c.layers
    # Main KV objects are (page, layer) of running requests: the most alive at once. A turn's
    # prompt grows by the previous answer and message (at most steps + 64 tokens a turn).
    longest_conv = max(len(t) for t in work)
    grow = (cfg.steps + 64) * (longest_conv - 1)
    pages = sorted((-(-(len(t[0].message) + grow + cfg.steps) // ps) for t in work), reverse=True)
    peak = sum(pages[: cfg.concurrent]) * layers
    # Host pages hold every running request's pages and the prefix tree (evicted LRU when
    # full); Indexer-K device pages the running requests' and the tree's device part.
    host_pages = 2 * sum(pages[: cfg.concurrent]) + 16
    idx_pages = sum(pages[: cfg.concurrent]) + 16
    # Floor: a prefill chunk allocates its pages for every layer at once, and each layer's
    # plan pins the chunk's or the batch's selection next to every running request's page
    # being written.
    per_entry = max(1, (cfg.block_size or ps) // ps)
    read = cfg.topk_tokens if cfg.selection == "token" else cfg.topk * per_entry
    chunk_pages = -(-256 // ps) + 1
    floor = (chunk_pages + pages[0]) * layers + cfg.concurrent * (2 * layers + 2 * read) + 1
    device = max(math.ceil(cfg.budget * peak), floor)
    resident = max(peak + 16 * layers, device)
    return peak, device, resident, host_pages, idx_pages, pages


def check_config(cfg: DemoConfig) -> None:
    """Refuses a configuration the demo's workload cannot serve (`ConfigError` naming the field,
    the value and what is allowed), before anything runs."""
    for name, value, ok, allowed in (
        ("budget", cfg.budget, 0 < cfg.budget <= 1, "0 < budget <= 1"),
        ("topk", cfg.topk, cfg.topk >= 2, "an integer >= 2"),
        ("topk_tokens", cfg.topk_tokens, cfg.topk_tokens >= 2, "an integer >= 2"),
        ("block_size", cfg.block_size, cfg.block_size >= 0, "0 or an integer >= 1"),
        ("page_size", cfg.page_size, cfg.page_size >= 1, "an integer >= 1"),
        ("requests", cfg.requests, cfg.requests >= 1, "an integer >= 1"),
        ("concurrent", cfg.concurrent, cfg.concurrent >= 1, "an integer >= 1"),
        ("steps", cfg.steps, cfg.steps >= 2, "an integer >= 2"),
        ("turns", cfg.turns, cfg.turns >= 1, "an integer >= 1"),
        ("seed", cfg.seed, cfg.seed >= 0, "an integer >= 0"),
        ("token_map", cfg.token_map, cfg.token_map == "core" or cfg.selection == "token",
         "core with block selection (device maps token selections)"),
        ("context_min", cfg.context_min, 16 <= cfg.context_min <= cfg.context_max,
         "16 <= context_min <= context_max"),
    ):  # fmt: skip
        if not ok:
            raise ConfigError.of(name, str(value), allowed)
    if cfg.device not in ("cpu", "cuda") or (
        cfg.device == "cuda" and not torch.cuda.is_available()
    ):
        raise ConfigError.of("device", cfg.device, "cpu, or cuda where a GPU is present")
    if cfg.graphs and (cfg.device != "cuda" or cfg.resolve != "device"):
        raise ConfigError.of("graphs", "True", "--device cuda with --resolve device")


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    check_config(cfg)
    torch.manual_seed(cfg.seed)
    model = TinySparseModel(ModelConfig(seed=cfg.seed)).to(cfg.device)
    work = _workload(cfg, model.c.vocab)
    peak, device, resident, host_pages, idx_pages, pages = _sizing(cfg, model, work)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="tiered decode", unit="step")
    faults = fault_plan(cfg.device) if cfg.faults else {}
    t0 = time.perf_counter()
    sizes = (host_pages, idx_pages)
    with _storage(cfg.storage_backend) as storage:
        # With L3 the tiered run's host tier holds the running requests' pages and little more.
        tiered_sizes = (sum(pages[: cfg.concurrent]) + 16, idx_pages) if storage else sizes
        rt, out, adms, prefill_bytes, failures, restores = _run(
            cfg, model, work, device, tiered_sizes, bar, faults, trace=cfg.trace,
            resolve=cfg.resolve, storage=storage,
        )  # fmt: skip
        l3 = rt.l3.stats() if rt.l3 is not None else None
        if rt.l3 is not None:
            rt.l3.close()
    tiered_s = time.perf_counter() - t0
    # What a full restore would have moved: the same run (conversations, budget, failures,
    # store) with every prefix hit restored whole. Its re-loads after eviction count too, as
    # this run's do: a full restore under the same budget does not keep the prefix resident.
    full_moved = _prefix_moved(rt)
    if cfg.restore != "full":
        if bar is not None:
            bar.close()
            bar = tqdm(desc="full-restore run", unit="step")
        with _storage(cfg.storage_backend) as storage:
            # It ends the requests this run's faults failed, where they failed (as the resident
            # check does), so that both runs serve the same work.
            frt = _run(
                replace(cfg, restore="full"), model, work, device, tiered_sizes, bar, {},
                failures, resolve=cfg.resolve, storage=storage,
            )[0]  # fmt: skip
            full_moved = _prefix_moved(frt)
            if frt.l3 is not None:
                frt.l3.close()
    if bar is not None:
        bar.close()
        bar = tqdm(desc="resident check", unit="step")
    _, ref, ref_adms, _, ref_failures, _ = _run(
        cfg, model, work, resident, sizes, bar, {}, failures
    )
    if bar is not None:
        bar.close()
    failed = sorted({rid for _, rid, _ in rt.failures})
    # (The resident run restarts what the tiered run restarted, under the same rids.)
    exact = failures.restarted == ref_failures.restarted
    exact = exact and out.keys() == ref.keys() and all(torch.equal(out[r], ref[r]) for r in ref)
    # Both runs must have matched the same prefixes, or the check compares different work.
    # (Whether a match's Indexer-K was still on the device may differ: a failed restore in
    # the tiered run leaves that prefix on host only, where the resident run restored it.)
    exact = exact and all(
        adms[r]["matched_pages"] == ref_adms.get(r, {}).get("matched_pages") for r in adms
    )
    px = rt.prefix_stats()
    moved = _prefix_moved(rt)
    needed = px["indexer_bytes_restored"] + px["prefix_kv_bytes_first"]
    # End state: every request ended; nothing pinned, in flight, quarantined or leaked.
    end = rt.scheduler.stats()
    rt.scheduler.validate()  # (the device resolver's slots among them: its pool, checked)
    # Slots the device resolver keeps in its pool are its own (a cache), not leaked.
    dstats = rt.scheduler.device_stats() if rt.resolve == "device" else {}
    pooled = dstats.get("pool", 0)
    recs = rt.records
    core = rt.scheduler.totals()
    step_s = [r.step_s for r in recs if r.requests]
    decode_tokens = sum(r.requests for r in recs)
    totals = {
        **{k: core[k] for k in core if k not in ("step", "device_used", "device_capacity")},
        "requests": len(adms),
        "steps": len(recs),
        "tokens": decode_tokens,
        "conversations": len(work),
        "selection": cfg.selection,
        "kv_format": cfg.kv_format,
        "prefix_hits": px["hits"],
        "prefix_hit_tokens": px["device_hit_tokens"] + px["host_hit_tokens"],
        "prefix_device_hit_tokens": px["device_hit_tokens"],
        "prefix_host_hit_tokens": px["host_hit_tokens"],
        "prefix_indexer_bytes_restored": px["indexer_bytes_restored"],
        "prefix_kv_bytes_loaded": px["prefix_kv_bytes_loaded"],
        "prefix_kv_bytes_first": px["prefix_kv_bytes_first"],
        "prefix_kv_bytes_first_in_prefill": prefill_bytes,
        "prefix_device_part_kv_bytes_loaded": px["device_part_kv_bytes_loaded"],
        "prefix_full_restore_bytes": px["full_restore_bytes"],
        "prefix_bytes_saved": px["full_restore_bytes"] - moved,
        "prefix_full_run_bytes": full_moved,
        # >= 1: the run moved no more prefix bytes than the same run restoring every hit whole.
        "prefix_restore_ratio": full_moved / moved if moved else 1.0,
        # Against a full restore whose pages then stay on the device (no re-loads).
        "prefix_restore_ratio_resident": px["full_restore_bytes"] / moved if moved else 1.0,
        "prefix_restore_ratio_first": px["full_restore_bytes"] / needed if needed else 1.0,
        "prefix_pages_inserted": px["pages_inserted"],
        "storage_backend": cfg.storage_backend,
        "l3_pages_written": l3["pages_written"] if l3 else 0,
        "l3_pages_fetched": rt.l3_pages_fetched,
        "l3_host_capacity": tiered_sizes[0] if l3 else None,
        "restores_full": px["restores_full"],
        "restores_predicted": px["restores_predicted"],
        # Per choice, over the requests that finished: what they loaded of their host-restored
        # pages (in bulk at admission, on demand) and what their layers waited.
        "restore_by_choice": _by_choice(restores),
        "restores_indexer_only": px["restores_indexer_only"],
        "restores_partial": px["restores_partial"],
        "restore_objects_predicted": px["restore_objects_predicted"],
        "restore_objects_loaded": px["restore_objects_loaded"],
        "restore_model_abs_error": px["restore_model_abs_error"],
        "failed_restores": px["restores_failed"],
        # Faults armed that found nothing of their kind to fail (say, a restore fault in a run
        # whose prefix hits were all on the device).
        "faults_unused": {
            k: end[f"faults_armed_{k}"]
            for k in ("loads", "backups", "restores")
            if end[f"faults_armed_{k}"]
        },
        # Copy-worker panics injected (cpu engine) with a submission, contained as failures.
        "copy_panics": end["copy_panics_injected"],
        "prefix_wait_s": rt.prefix_wait_s,
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
        # Requests the runtime restarted after they failed (--restart-failed).
        "restarted": failures.restarted,
        "end_pins": end["pins"],
        "end_handles": end["handles"],
        "end_quarantined_slots": end["device_quarantined"] + end["host_quarantined"],
        "end_transfers_in_flight": end["transfers_in_flight"],
        "end_device_leaked": end["device_used"]
        - end["device_ready"]
        - end["device_loading"]
        - pooled,
        "end_device_pool": pooled,
        # Host loads (prefills, steps planned on the host) that took an object from the
        # resolver's pool instead of copying it again.
        "device_pool_adopted": dstats.get("adopted", 0),
        # Objects the host's evictions and the grants' victims passed over because the last
        # device step read them.
        "device_second_chances": dstats.get("second_chances", 0),
        "device_grant_second_chances": dstats.get("grant_second_chances", 0),
        # Device-resolved steps as graphs (`--graphs`): captured, replayed, run eagerly.
        "graph_steps": rt.graphs.stats() if rt.graphs is not None else None,
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
        ("selection", f"{t['selection']} mode, {t['kv_format']} caches"),
        (
            "device budget",
            f"{t['device_slots']} KV pages, {t['device_slots'] / t['peak_objects']:.0%} of the "
            f"{t['peak_objects']} the running requests would hold unshared"
            # The floor a step needs (a prefill chunk's pages, each request's reads) can
            # exceed the budget's share: the share held is what the line says.
            + (
                f" (--budget {t['budget']:.0%}, raised to the floor a step needs)"
                if t["device_slots"] > math.ceil(t["budget"] * t["peak_objects"])
                else ""
            ),
        ),
        (
            "selected / distinct pages",
            f"{t['selected']} / {t['pages']} (ready {t['ready']}, loaded {t['loaded']}, "
            f"joined in flight {t['joined']})",
        ),
        ("device byte hit rate", fmt_ratio(t["device_byte_hit_rate"], "nothing selected")),
        (
            "bytes needed / transferred",
            f"{_mib(t['bytes_needed'])} / {_mib(t['bytes_transferred'])} in "
            f"{t['load_submissions']} load submissions ({t['copy_segments']} copies)",
        ),
        (
            "read amplification",
            fmt_ratio(t["read_amplification"], "nothing moved") + " (moved / needed among moved)",
        ),
        (
            "prefetch",
            # Off, nothing is predicted: an accuracy of 0 would read as a prediction that missed.
            f"accuracy {fmt_ratio(t['prefetch_accuracy'], 'nothing selected')}, "
            f"loaded {t['prefetch_loaded']} pages, "
            f"wasted {_mib(t['prefetch_wasted_bytes'])}, peak pins {t['prefetch_pinned_peak']}"
            if r["config"]["prefetch"] and r["config"]["resolve"] != "device"
            # The device resolver serves its misses itself: the scheduler stops prefetching.
            else "off (--resolve device)"
            if r["config"]["resolve"] == "device"
            else "off (--no-prefetch)",
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
            "prefix hits",
            f"{t['prefix_hits']} of {t['requests']} requests ({t['conversations']} "
            f"conversations), {t['prefix_hit_tokens']} tokens ({t['prefix_device_hit_tokens']}"
            f" with Indexer-K on the device, {t['prefix_host_hit_tokens']} restored)",
        ),
        (
            "prefix bytes moved",
            f"Indexer-K restored {_mib(t['prefix_indexer_bytes_restored'])} + KV blocks loaded "
            f"{_mib(t['prefix_kv_bytes_loaded'])} ({_mib(t['prefix_kv_bytes_first'])} first "
            f"loads, {_mib(t['prefix_kv_bytes_first_in_prefill'])} of them by the suffix "
            f"prefill); a full restore: {_mib(t['prefix_full_run_bytes'])} in the same run "
            f"({t['prefix_restore_ratio']:.2f}x), {_mib(t['prefix_full_restore_bytes'])} "
            f"kept resident ({t['prefix_restore_ratio_resident']:.2f}x all loads, "
            f"{t['prefix_restore_ratio_first']:.2f}x first loads; "
            f"restore wait {t['prefix_wait_s'] * 1e3:.2f} ms)",
        ),
        (
            "L3",
            f"{t['storage_backend']}: host tier {t['l3_host_capacity']} pages; "
            f"{t['l3_pages_written']} pages written, {t['l3_pages_fetched']} fetched back "
            "into host memory"
            if t["storage_backend"]
            else "none (--storage-backend file|mooncake)",
        ),
        (
            "restore policy",
            f"{t['restores_full']} full ({t['restores_partial']} cut short), "
            f"{t['restores_predicted']} predicted, "
            f"{t['restores_indexer_only']} Indexer-K only; model error "
            + (
                f"{t['restore_model_abs_error'] / t['restore_objects_predicted']:.2f} "
                f"(|predicted - loaded| / predicted objects)"
                if t["restore_objects_predicted"]
                else "none yet (no prediction checked)"
            ),
        ),
        (
            "restores by choice",
            "; ".join(
                f"{k}: {c['requests']} requests, {c['loaded']} objects ({c['bulk_submissions']}"
                f" bulk submissions, {c['on_demand']} on demand), waited "
                f"{c['wait_s'] * 1e3:.2f} ms"
                for k, c in sorted(t["restore_by_choice"].items())
            )
            or "none finished",
        ),
        (
            "faults",
            f"{t['failed_loads']} failed loads ({t['retried_loads']} retried"
            + (f"; {t['copy_panics']} of them a copy worker's panic" if t["copy_panics"] else "")
            + "), "
            f"{t['failed_backups']} failed backups, {t['failed_restores']} failed restores, "
            f"failed requests {t['failed_requests_list']}"
            + (f"; restarted {t['restarted']}" if t["restarted"] else "")
            + (
                "; armed but unused (nothing of that kind to fail): "
                + ", ".join(f"{k} {n}" for k, n in t["faults_unused"].items())
                if t["faults_unused"]
                else ""
            ),
        ),
        (
            "end state",
            f"pins {t['end_pins']}, quarantined {t['end_quarantined_slots']}, leaked slots "
            f"{t['end_device_leaked']}, in flight {t['end_transfers_in_flight']}"
            + (
                f", device resolver's pool {t['end_device_pool']} slots"
                f" ({t['device_pool_adopted']} objects adopted by host loads; host evictions"
                f" passed over {t['device_second_chances']} the device had just read, its"
                f" grants {t['device_grant_second_chances']})"
                if t["end_device_pool"]
                else ""
            ),
        ),
    ]
    if t.get("graph_steps"):
        gs = t["graph_steps"]
        rows.append((
            "step graphs",
            f"{gs['captures']} captured, {gs['replays']} replayed, {gs['eager']} eager "
            f"({gs['refused']} replays refused), {gs['graphs']} graphs",
        ))  # fmt: skip
    rows.append(("correctness (tiered == resident)", "PASS" if t["correct"] else "FAIL"))
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

    def series(key: str) -> list[float]:
        # A ratio without its denominator in a step (None) is a gap in the line, not a 0.
        return [math.nan if s[key] is None else s[key] for s in steps]

    ax[0].plot(x, series("device_byte_hit_rate"), label="device byte hit rate")
    ax[0].plot(x, series("prefetch_accuracy"), label="prefetch accuracy")
    ax[0].legend(loc="lower right")
    ax[1].plot(x, [s["bytes_transferred"] / (1 << 20) for s in steps])
    ax[1].set_ylabel("MiB moved")
    ax[2].plot(x, series("read_amplification"))
    ax[2].set_ylabel("read amplification")
    ax[3].plot(x, [s["exposed_wait_ns"] / 1e6 for s in steps], label="exposed wait")
    ax[3].plot(x, [s["step_s"] * 1e3 for s in steps], label="step (TPOT)")
    ax[3].set_ylabel("ms")
    ax[3].legend(loc="upper right")
    ax[3].set_xlabel("decode step")
    fig.tight_layout()
    fig.savefig(path)
