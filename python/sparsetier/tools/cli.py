"""The ``sparsetier`` command line.

``sparsetier plan`` shows how a model's KV, Indexer-K, SWA and draft pools are laid out across
GPU (device) and pinned-host memory. Bad flags exit with status 2 and the error message.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

from sparsetier._core import Plan, PoolSpec, plan_stack
from sparsetier.errors import ConfigError, SparsetierError
from sparsetier.presets import PRESETS, ModelPreset


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _specs(args: argparse.Namespace, pages: int) -> list[PoolSpec]:
    if args.model is not None:
        return PRESETS[args.model].specs(pages)
    ps = args.page_size
    specs = [PoolSpec("KV", args.layers, args.kv_heads, args.head_dim, args.dtype, ps, pages)]
    if args.indexer_layers:
        specs.append(
            PoolSpec(
                "INDEXER",
                args.indexer_layers,
                args.indexer_heads,
                args.indexer_head_dim,
                args.indexer_dtype,
                ps,
                pages,
            )
        )
    if args.swa_window is not None:
        swa_layers = args.swa_layers if args.swa_layers is not None else args.layers
        specs.append(
            PoolSpec("SWA", swa_layers, args.kv_heads, args.head_dim, args.dtype, ps, pages)
        )
    if args.draft_layers:
        specs.append(
            PoolSpec(
                "DRAFT", args.draft_layers, args.kv_heads, args.head_dim, args.dtype, ps, pages
            )
        )
    return specs


def _device_pages(args: argparse.Namespace) -> int:
    if args.device_pages is not None:
        _at_least(args, 1, "device_pages")
        return int(args.device_pages)
    gb = args.device_gb
    if not (math.isfinite(gb) and gb > 0):
        raise ConfigError.of("device_gb", str(gb), "a finite decimal GB figure > 0")
    per_page = sum(s.page_bytes_all_layers for s in _specs(args, 1))
    pages = int(gb * 1e9) // per_page
    if pages < 1:
        raise ConfigError.of("device_gb", str(gb), f">= {per_page / 1e9:.6f} GB")
    return pages


def build_plan(args: argparse.Namespace) -> Plan:
    """The plan for the model geometry and budgets given as CLI flags."""
    return plan_stack(
        _specs(args, _device_pages(args)),
        page_size=args.page_size,
        hicache_size=args.hicache_size,
        hicache_ratio=args.hicache_ratio,
        layout=args.layout,
        io_backend=args.io_backend,
        device_reserve=args.device_reserve,
        host_reserve=args.host_reserve,
        swa_window=args.swa_window,
        storage_backend=args.storage_backend,
    )


#: The shape flags a --model preset sets, with their defaults without one.
SHAPE_DEFAULTS = {
    "layers": None, "kv_heads": None, "head_dim": None, "dtype": "bf16",
    "indexer_layers": None, "indexer_heads": 1, "indexer_head_dim": 128, "indexer_dtype": "bf16",
    "swa_window": None, "swa_layers": None, "draft_layers": 0, "page_size": 64,
}  # fmt: skip


def _plan_shape(args: argparse.Namespace) -> None:
    """Fills in the shape from --model, or checks that it was given. A flag that would be
    ignored (a shape flag with --model, --swa-layers without --swa-window, --topk without
    --context) is refused."""
    given = [f for f in SHAPE_DEFAULTS if getattr(args, f) is not None]
    if args.topk is not None and args.context is None:
        raise ConfigError.of("topk", str(args.topk), "unset without --context")
    if args.topk is None:
        args.topk = 2048
    if args.model is not None:
        if given:
            raise ConfigError.of(given[0], str(getattr(args, given[0])), "unset with --model")
        preset = PRESETS[args.model]
        args.page_size = preset.page_size
        args.layers = preset.layers
        return
    if args.swa_layers is not None and args.swa_window is None:
        raise ConfigError.of("swa_layers", str(args.swa_layers), "unset without --swa-window")
    for f, default in SHAPE_DEFAULTS.items():
        if getattr(args, f) is None:
            setattr(args, f, default)
    for f in ("layers", "kv_heads", "head_dim"):
        if getattr(args, f) is None:
            raise ConfigError.of(f, "None", "an integer >= 1 (or --model)")
    if args.indexer_layers is None:
        args.indexer_layers = args.layers
    # (Checked here: the pool specs would name their own field, "layers", not the flag.)
    _at_least(args, 0, "indexer_layers", "draft_layers")
    _at_least(args, 1, "swa_layers")


def format_model(m: ModelPreset) -> str:
    """A preset's rows: parts, bytes per token per layer and per page per layer."""
    lines = [f"model {m.name}: {m.layers} layers, {m.page_size}-token pages ({m.source})"]
    for comp, row in (("KV", m.kv), ("INDEXER", m.indexer)):
        parts = " + ".join(f"{p.count} {p.dtype} {p.name}" for p in row.parts)
        lines.append(
            f"  {comp}: {row.bytes} B per token per layer ({parts}), "
            f"{row.page_bytes(m.page_size):,} B per page per layer, {row.page_layout}"
        )
    return "\n".join(lines) + "\n"


def format_plan(plan: Plan) -> str:
    """The plan as a table: per pool and tier, then totals and the budget."""
    head = ("component", "tier", "layout", "page_bytes", "pages", "tokens", "bytes")
    rows = [
        (
            p.component,
            p.tier,
            p.layout,
            str(p.page_bytes),
            str(p.pages),
            str(p.tokens),
            f"{p.bytes} ({_human(p.bytes)})",
        )
        for p in plan.pools
    ]
    d = plan.to_dict()
    for tier in ("device", "host"):
        t = d["totals"][tier]
        rows.append(
            (
                "total",
                tier,
                "",
                "",
                str(t["pages"]),
                str(t["tokens"]),
                f"{t['bytes']} ({_human(t['bytes'])})",
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    target, actual = plan.target_bytes, plan.actual_bytes
    lines.append("")
    lines.append(
        f"host budget: target {target} B ({_human(target)}), actual {actual} B "
        f"({_human(actual)}), difference {actual - target:+d} B"
    )
    lines.append(
        f"page_size {plan.page_size}, layout {plan.layout}, io_backend {plan.io_backend}, "
        f"reserve pages: device {plan.device_reserve}, host {plan.host_reserve}"
    )
    if plan.storage_backend is not None:
        host_page = sum(p.page_bytes for p in plan.pools if p.tier == "host")
        lines.append(
            f"L3: {plan.storage_backend} store under the host tier, {host_page} B per page "
            f"(every host pool of a page as one unit), written back on host eviction by "
            f"default; capacity is the store's"
        )
    return "\n".join(lines)


def prefix_hit_estimate(plan: Plan, context: int, topk: int) -> dict:
    """Bytes a prefix hit of `context` tokens moves to the device, per layer group of the plan:
    a full restore (every pool of every matched page, SWA its window; SGLang's HiCache) against
    the joined mode (Indexer-K and draft of every page, SWA its window, and the main KV of one
    decode step's `topk` selected tokens per layer). The selected tokens packed into whole
    pages is the ideal; one page per selected token the worst case."""
    full = sparse = 0
    kv_token = kv_page = 0
    for p in plan.pools:
        if p.tier != "host":
            continue
        per_token = p.bytes // max(p.tokens, 1)
        tokens = min(p.window, context) if p.window else context
        full += per_token * tokens
        if p.component == "KV":
            kv_token, kv_page = per_token, p.page_bytes
        else:
            sparse += per_token * tokens
    sel = min(topk, context)
    ideal = sparse + kv_token * sel
    pages = min(sel, -(-context // plan.page_size))
    worst = sparse + min(kv_page * pages, kv_token * context)
    return {
        "context": context,
        "topk": topk,
        "full_restore_bytes": full,
        "joined_bytes_ideal": ideal,
        "joined_bytes_worst": worst,
        "ratio_ideal": full / ideal if ideal else 0.0,
        "ratio_worst": full / worst if worst else 0.0,
    }


def format_estimate(e: dict) -> str:
    return (
        f"prefix hit of {e['context']} tokens, top-{e['topk']} per layer: a full restore moves "
        f"{_human(e['full_restore_bytes'])}; the joined mode {_human(e['joined_bytes_ideal'])}"
        f" ({e['ratio_ideal']:.2f}x fewer) with the selection packed in whole pages, up to "
        f"{_human(e['joined_bytes_worst'])} ({e['ratio_worst']:.2f}x) with one page per "
        "selected token. One decode step's selection: a suffix prefill reads the union of its "
        "tokens' selections (see benches/RESULTS.md)."
    )


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show the pool layout across GPU and host memory")
    p.add_argument(
        "--model", choices=sorted(PRESETS), help="a model's cache formats (instead of the shape)"
    )
    p.add_argument("--layers", type=int, help="main attention layers")
    p.add_argument("--kv-heads", type=int, help="KV heads (GQA: not query heads)")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", help="bf16 (default), fp16, fp32 or fp8_e4m3")
    p.add_argument("--indexer-layers", type=int, default=None, help="default: --layers; 0: none")
    p.add_argument("--indexer-heads", type=int, help="default 1")
    p.add_argument("--indexer-head-dim", type=int, help="default 128")
    p.add_argument("--indexer-dtype", help="default bf16")
    p.add_argument("--swa-window", type=int, default=None, help="SWA window in tokens")
    p.add_argument("--swa-layers", type=int, default=None, help="SWA layers (default: --layers)")
    p.add_argument("--draft-layers", type=int, help="MTP draft layers (default 0)")
    p.add_argument("--page-size", type=int, help="tokens per page (default 64)")
    dev = p.add_mutually_exclusive_group(required=True)
    dev.add_argument("--device-pages", type=int, help="pages per device pool")
    dev.add_argument("--device-gb", type=float, help="device budget in decimal GB")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--hicache-size", type=float, help="host budget in decimal GB")
    host.add_argument("--hicache-ratio", type=float, help="host pages = device pages x ratio")
    p.add_argument("--layout", default="layer_first", help="layer_first or layer_page_first")
    p.add_argument("--io-backend", default="cpu", help="kernel, direct or cpu")
    p.add_argument("--device-reserve", type=int, default=1, help="reserved device pages")
    p.add_argument("--host-reserve", type=int, default=0, help="reserved host pages")
    p.add_argument(
        "--storage-backend", choices=["file", "mooncake"], help="an L3 store under the host tier"
    )
    p.add_argument(
        "--context", type=int, help="estimate the bytes a prefix hit of this many tokens moves"
    )
    p.add_argument("--topk", type=int, help="with --context: tokens selected (default 2048)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks, as ratios to a baseline from the same run",
        description="Each benchmark reports a ratio against a baseline measured in the same "
        "run (figures: benches/RESULTS.md).",
    )
    benches = p.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", metavar="PATH",
                     help="also write the rows as JSON (a .jsonl path gets one line appended a "
                          "run, so that repeated runs collect in one file)")  # fmt: skip
    _bench_decode_parser(benches, out)
    _bench_prefix_parser(benches, out)
    _bench_prefix_sparse_parser(benches, out)
    _bench_vllm_parser(benches, out)
    _bench_tiered_parser(benches, out)
    b = benches.add_parser("l3", parents=[out],
                           help="put/get throughput of the L3 backends vs memcpy, and the serve "
                           "loop's hits with and without L3")  # fmt: skip
    b.add_argument("--backends", "--l3-backends", dest="l3_backends", nargs="+",
                   choices=["file", "mooncake"], default=["file", "mooncake"])  # fmt: skip
    b.add_argument("--serve-reqs", type=int, default=500, help="served requests")
    b.set_defaults(bench=_bench_l3)
    b = benches.add_parser("transfer", parents=[out],
                           help="copy-engine GB/s vs the baselines")  # fmt: skip
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    b.add_argument("--total-mb", type=int, default=128, help="bytes per copy, MiB")
    b.set_defaults(bench=_bench_transfer)
    b = benches.add_parser("directory", parents=[out],
                           help="the directory binding's overhead vs the Rust loop")  # fmt: skip
    b.add_argument("--batches", type=int, nargs="+", default=[64, 2048, 16384])
    b.add_argument("--hit-rates", type=float, nargs="+", default=[1.0, 0.9, 0.5])
    b.set_defaults(bench=_bench_directory)
    b = benches.add_parser("replay", parents=[out],
                           help="seconds to replay a 1M-key trace at 10 budgets, LRU and "
                           "MIN")  # fmt: skip
    b.set_defaults(bench=_bench_replay)


def _bench_tiered_parser(benches: argparse._SubParsersAction, out: argparse.ArgumentParser) -> None:
    from sparsetier.tools.bench_tiered import TieredBenchConfig

    d = TieredBenchConfig()
    p = benches.add_parser("tiered", parents=[out],
                           help="decode tokens/s with a share of the KV on the device vs "
                           "all-resident (the demo's model and conversations)")  # fmt: skip
    p.add_argument("--pairs", type=int, default=d.pairs,
                   help="tiered/resident pairs timed, after one warm-up pair")  # fmt: skip
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    p.add_argument("--selection", choices=["block", "token"], default=d.selection)
    p.add_argument("--resolve", choices=["host", "device"], default=d.resolve,
                   help="both runs resolve their layers this way")  # fmt: skip
    p.add_argument("--graphs", action="store_true",
                   help="both runs' device-resolved steps as CUDA graphs (--device cuda, "
                   "--resolve device)")  # fmt: skip
    p.add_argument("--budget", type=float, default=d.budget,
                   help="the tiered run's device share of the main KV")  # fmt: skip
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrent", type=int, default=d.concurrent,
                   help="requests decoded at once")  # fmt: skip
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps a request")
    p.add_argument("--context-min", type=int, default=d.context_min,
                   help="a first turn's shortest prompt, tokens")  # fmt: skip
    p.add_argument("--context-max", type=int, default=d.context_max,
                   help="its longest (longer prompts: a step's floor of device pages is a "
                   "smaller share of the KV, as token mode needs for a quarter)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(bench=_bench_tiered)


def _bench_tiered(args: argparse.Namespace) -> dict:
    from sparsetier.tools import bench_tiered

    r = bench_tiered.run(bench_tiered.config_from_args(args))  # (checks its flags first)
    print(bench_tiered.format_table(r))
    return r


def _bench_decode_parser(benches: argparse._SubParsersAction, out: argparse.ArgumentParser) -> None:
    from sparsetier.tools.bench_decode import DecodeBenchConfig

    dd = DecodeBenchConfig()
    p = benches.add_parser("decode", parents=[out],
                           help="CPU per decode step in the step scheduler vs per-request calls "
                           "(DeepSeek-V3.2's shape)")  # fmt: skip
    p.add_argument("--mode", choices=["block", "token"], default=dd.mode)
    p.add_argument("--layers", type=int, default=dd.layers, help="model layers")
    p.add_argument("--batch", type=int, default=dd.batch, help="requests per step")
    p.add_argument("--page-size", type=int, default=dd.page_size, help="tokens per page")
    p.add_argument("--context-min", type=int, default=dd.context_min)
    p.add_argument("--context-max", type=int, default=dd.context_max)
    p.add_argument("--budget", type=float, default=dd.budget, help="device share")
    p.add_argument("--blocks", type=int, default=dd.blocks, help="blocks per request")
    p.add_argument("--tokens", type=int, default=dd.tokens, help="token mode's top-k")
    p.add_argument("--token-pages", type=int, default=dd.token_pages,
                   help="hot pages token mode draws from")  # fmt: skip
    p.add_argument("--locality", type=float, default=dd.locality,
                   help="chance a selected block stays from one step to the next")  # fmt: skip
    p.add_argument("--steps", type=int, default=dd.steps, help="timed steps")
    p.add_argument("--warmup", type=int, default=dd.warmup,
                   help="untimed steps first (default: until the device has turned over, the "
                   "steady state)")  # fmt: skip
    p.add_argument("--prefetch", action="store_true", help="prefetch on")
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline")
    p.add_argument("--map-device", choices=["cpu", "cuda"],
                   help="token mode: a fourth stack mapping tokens to pages on this torch "
                   "device (sparsetier.token_map)")  # fmt: skip
    p.add_argument("--no-unkept", action="store_true",
                   help="skip the stack without kept selections")  # fmt: skip
    p.add_argument("--alone-steps", type=int, default=None,
                   help="then this many steps of the scheduler alone, back to back (default: "
                   "as many as --steps; 0: none)")  # fmt: skip
    p.add_argument("--io-backend", choices=["cpu", "kernel", "direct"], default="cpu",
                   help="every stack's copy engine (kernel or direct: device pools on the GPU, "
                   "pinned host pools, ready as a stream wait)")  # fmt: skip
    p.add_argument("--entry-dtype", choices=["int64", "int32"], default=dd.entry_dtype,
                   help="the selections' dtype (int64: torch.topk's; int32: half the bytes, as "
                   "top-k kernels often return)")  # fmt: skip
    p.add_argument("--trace", metavar="PATH", help="write the scheduler's trace (.npz)")
    p.add_argument(
        "--resolve",
        choices=["host", "device"],
        default="host",
        help="device: the joined scheduler's steps resolved by the device resolver "
        "(one grant a step), paired against the same steps planned on the host",
    )
    p.add_argument(
        "--kernel-threads",
        type=int,
        metavar="N",
        help="with --resolve device, in a build with the host kernel (make build): resolve "
        "with the CUDA kernel's source on N CPU threads, through the protocol a GPU gets "
        "(its host work counted in the core's time)",
    )
    p.set_defaults(bench=_bench_decode)


def _bench_prefix_parser(benches: argparse._SubParsersAction, out: argparse.ArgumentParser) -> None:
    p = benches.add_parser("prefix", parents=[out],
                           help="the prefix cache's serve loop (vs SGLang's radix cache with "
                           "--peers-python)")  # fmt: skip
    p.add_argument("--page-size", type=int, default=1, help="tokens per page")
    p.add_argument("--num-seqs", type=int, default=500, help="fill sequences")
    p.add_argument("--num-queries", type=int, default=300, help="hot-match queries")
    p.add_argument("--serve-reqs", type=int, default=500, help="served requests")
    p.add_argument("--followup-frac", type=float, default=0.0, help="multi-turn share")
    p.add_argument("--stream", help="replay a stream from the peers' workload.py --dump")
    p.add_argument("--peers-python", help="python of a venv with SGLang, to run it too")
    p.add_argument("--peers-dir", default=os.environ.get("SPARSETIER_PEERS_DIR"),
                   help="the peer scripts (bench_sglang_radix.py); default: "
                   "$SPARSETIER_PEERS_DIR")  # fmt: skip
    p.add_argument("--paired", action="store_true",
                   help="SGLang and sparsetier alternately in one process (the peers' python, "
                   "--peers-python), median and spread of the paired ratios")  # fmt: skip
    p.add_argument("--token-type", choices=["q", "numpy", "uint32", "list"], default="q",
                   help="the token container both sides get (q: array('q'))")  # fmt: skip
    p.add_argument("--reps", type=int, help="--paired and --containers: repetitions (7)")
    p.add_argument("--containers", action="store_true",
                   help="the serve loop per token container, alternating")  # fmt: skip
    p.add_argument("--max-len", type=int, help="--paired: longest prompt (4096)")
    p.set_defaults(bench=_bench_prefix)


def _bench_prefix_sparse_parser(
    benches: argparse._SubParsersAction, out: argparse.ArgumentParser
) -> None:
    from sparsetier.tools.bench_prefix_sparse import PrefixSparseConfig
    from sparsetier.tools.selection_model import SelectionModel

    d, m = PrefixSparseConfig(), SelectionModel()
    p = benches.add_parser("prefix-sparse", parents=[out],
                           help="bytes a prefix hit moves under sparse attention: full "
                           "restore, Indexer-K only, predicted pages, prefix x suffix "
                           "lengths")  # fmt: skip
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--prefixes", type=int, nargs="+", default=list(d.prefixes))
    p.add_argument("--suffixes", type=int, nargs="+", default=list(d.suffixes))
    p.add_argument("--topk", type=int, default=m.topk_pages * m.page_size, help="tokens")
    p.add_argument("--page-size", type=int, default=m.page_size)
    p.add_argument("--sink-pages", type=int, default=m.sink_pages)
    p.add_argument("--window", type=int, default=m.window, help="local window, tokens")
    p.add_argument("--zipf-s", type=float, default=m.zipf_s)
    sel = p.add_mutually_exclusive_group()
    sel.add_argument("--churn", type=float,
                     help=f"share of a token's Zipf draws not its predecessor's (default "
                     f"{m.churn})")  # fmt: skip
    sel.add_argument("--overlap", type=float,
                     help="set the churn from a measured overlap instead: the share of a "
                     "token's top-k that the next token selects too (pages)")  # fmt: skip
    p.add_argument("--overlap-context", type=int, default=d.overlap_context,
                   help="the context length, tokens, the --overlap was measured at")  # fmt: skip
    p.add_argument("--copy-overhead", type=int, default=d.copy_overhead,
                   help="a copy's fixed cost in bytes, in the policy's cost model (the "
                   "engines' defaults: cpu 16384, kernel 2048, direct 196608)")  # fmt: skip
    p.add_argument("--selections", metavar="NPZ",
                   help="replay selections recorded from a real model (sel [layers, tokens, "
                   "k] page ids, page_size) instead of the parametric model")  # fmt: skip
    p.add_argument("--lru-ratio", type=float,
                   help="also simulate a decode-side LRU of selected KV holding this share "
                   "of each prefix length (as the context) and report its misses a step, "
                   "to compare the model with published miss counts")  # fmt: skip
    p.add_argument("--lru-query-tokens", type=int,
                   help="with --lru-ratio: query tokens a decode step (1 + MTP draft "
                   "tokens), default 1")  # fmt: skip
    p.add_argument("--measure", action="store_true",
                   help="also run the cells through the core (a StepScheduler on the cpu "
                   "engine at these row sizes: full, Indexer-K only, auto) and count what it "
                   "moves")  # fmt: skip
    p.add_argument("--measure-max-prefix", type=int,
                   help="with --measure: the cells up to this prefix, default 32768 (the "
                   "pools take about 140 KiB a token of prefix and suffix, 4.4 GiB at "
                   "32k)")  # fmt: skip
    p.set_defaults(bench=_bench_prefix_sparse)


def _bench_prefix_sparse(args: argparse.Namespace) -> dict:
    from sparsetier.errors import ConfigError
    from sparsetier.tools import bench_prefix_sparse as bps
    from sparsetier.tools.selection_model import SelectionModel

    _at_least(args, 1, "page_size", "lru_query_tokens")
    if args.measure_max_prefix is not None and not args.measure:
        raise ConfigError.of("measure_max_prefix", str(args.measure_max_prefix), "with --measure")
    if args.measure_max_prefix is None:
        args.measure_max_prefix = 32768
    if args.topk < args.page_size or args.topk % args.page_size:
        raise ConfigError.of(
            "topk", str(args.topk), f"a multiple of the page size {args.page_size}, >= 1 page"
        )
    if args.lru_query_tokens is not None and args.lru_ratio is None:
        raise ConfigError.of("lru_query_tokens", str(args.lru_query_tokens), "with --lru-ratio")
    if args.lru_ratio is not None and not 0 < args.lru_ratio <= 1:
        raise ConfigError.of("lru_ratio", str(args.lru_ratio), "a share of the context in (0, 1]")
    if args.lru_query_tokens is None:
        args.lru_query_tokens = 1
    for flag in ("churn", "overlap", "lru_ratio"):
        if args.selections and getattr(args, flag) is not None:
            allowed = "unset with --selections (recorded selections are replayed as they are)"
            raise ConfigError.of(flag, str(getattr(args, flag)), allowed)
    try:
        model = SelectionModel(
            page_size=args.page_size, topk_pages=args.topk // args.page_size,
            sink_pages=args.sink_pages, window=args.window, zipf_s=args.zipf_s,
            churn=SelectionModel.churn if args.churn is None else args.churn,
        )  # fmt: skip
        if args.overlap is not None:
            model = model.with_overlap(args.overlap, args.overlap_context)
        if args.selections:
            from sparsetier.tools.selection_model import RecordedSelections

            model = RecordedSelections.load(args.selections)
        cfg = bps.PrefixSparseConfig(
            layers=args.layers, model=model, prefixes=tuple(args.prefixes),
            suffixes=tuple(args.suffixes), copy_overhead=args.copy_overhead,
            overlap_context=args.overlap_context,
        )  # fmt: skip
        measured = [p for p in cfg.prefixes if args.measure and p <= args.measure_max_prefix]
        if args.measure:
            from sparsetier.tools.bench_prefix_measure import check_prefix

            for p in measured:
                check_prefix(p, model.page_size, "prefixes")
    except ValueError as e:
        field, _, rest = str(e).partition(" = ")
        value, _, allowed = rest.partition(": allowed ")
        raise ConfigError.of(field, value, allowed) from None
    if args.measure and not measured:
        allowed = f">= the shortest prefix ({min(cfg.prefixes)})"
        raise ConfigError.of("measure_max_prefix", str(args.measure_max_prefix), allowed)
    cells = bps.run(cfg)
    print(bps.format_report(cfg, cells))
    out = bps.to_json(cfg, cells)
    if args.lru_ratio is not None:
        lru = bps.lru_report(cfg, args.lru_ratio, args.lru_query_tokens)
        print(bps.format_lru(lru))
        out["lru"] = lru
    if args.measure:
        from sparsetier.tools import bench_prefix_measure as bpm

        shape = (cfg.kv_token_bytes, cfg.idx_token_bytes, cfg.copy_overhead)
        rows = [
            r
            for c in cells
            if c.prefix in measured
            for r in bpm.measure(cfg.model, c.prefix, c.suffix, cfg.layers, shape)
        ]
        print(bpm.format_measured(rows))
        out["measured"] = bpm.to_json(rows)
    return out


def _bench_vllm_parser(benches: argparse._SubParsersAction, out: argparse.ArgumentParser) -> None:
    from sparsetier.tools.bench_vllm import VllmBenchConfig

    dv = VllmBenchConfig()
    p = benches.add_parser("vllm", parents=[out],
                           help="scheduler CPU per request of sparsetier.vllm's manager vs "
                           "vLLM's CPUOffloadingManager, paired in one process")  # fmt: skip
    p.add_argument("--requests", type=int, default=dv.requests)
    p.add_argument("--prompt-tokens", type=int, default=dv.prompt_tokens)
    p.add_argument("--prefixes", type=int, default=dv.prefixes,
                   help="shared prefixes (Zipf popularity)")  # fmt: skip
    p.add_argument("--prefix-blocks", type=int, default=dv.prefix_blocks)
    p.add_argument("--kv-groups", type=int, default=dv.groups,
                   help="KV-cache groups (2: DeepSeek-V3.2's MLA and indexer)")  # fmt: skip
    p.add_argument("--pool-requests", type=float, default=dv.pool_requests,
                   help="host pool, in prompts (fewer than the stream: evicts)")  # fmt: skip
    p.add_argument("--policy", choices=["lru", "arc"], default=dv.policy)
    p.set_defaults(bench=_bench_vllm)


def _write_json(path: str, r) -> None:
    """`r` as JSON at `path`: one line appended where the path ends in .jsonl (runs collect),
    else the file written over, indented."""
    if path.endswith(".jsonl"):
        with open(path, "a") as f:
            f.write(json.dumps(r) + "\n")
    else:
        with open(path, "w") as f:
            json.dump(r, f, indent=2)


def _at_least(args: argparse.Namespace, lo: int, *names: str) -> None:
    """Each flag `names` given (not None) is at least `lo`, else a ConfigError naming it."""
    for name in names:
        v = getattr(args, name)
        if v is not None and v < lo:
            raise ConfigError.of(name, str(v), f"an integer >= {lo}")


def _bench_vllm(args: argparse.Namespace) -> dict:
    from sparsetier.tools import bench_vllm

    _at_least(args, 1, "kv_groups")  # (the config calls it groups)
    cfg = bench_vllm.VllmBenchConfig(
        requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        prefixes=args.prefixes,
        prefix_blocks=args.prefix_blocks,
        groups=args.kv_groups,
        pool_requests=args.pool_requests,
        policy=args.policy,
    )
    r = bench_vllm.run(cfg, progress=True)
    print(bench_vllm.format_report(r))
    return r


def _bench_replay(args: argparse.Namespace) -> dict:
    from sparsetier.replay import bench as bench_replay

    r = bench_replay()
    print(
        f"replay of a {r['keys']}-key synthetic trace at {r['budgets']} budgets: "
        f"LRU (the directory) {r['lru_s']:.2f} s, MIN {r['min_s']:.2f} s"
    )
    return r


def _bench_l3(args: argparse.Namespace) -> dict:
    from sparsetier.tools import bench_l3

    _at_least(args, 1, "serve_reqs")
    r = bench_l3.run(args.l3_backends, requests=args.serve_reqs)
    print(bench_l3.format_report(r))
    return r


def _bench_decode(args: argparse.Namespace) -> dict:
    from sparsetier.tools import bench_decode

    cfg = bench_decode.DecodeBenchConfig(
        layers=args.layers, batch=args.batch, page_size=args.page_size,
        context_min=args.context_min, context_max=args.context_max, budget=args.budget,
        mode=args.mode, blocks=args.blocks, tokens=args.tokens,
        token_pages=args.token_pages, locality=args.locality, steps=args.steps,
        warmup=args.warmup,
        prefetch=args.prefetch, baseline=not args.no_baseline, trace=args.trace,
        unkept=not args.no_unkept,
        map_device=args.map_device, io_backend=args.io_backend,
        alone_steps=args.alone_steps, entry_dtype=args.entry_dtype,
    )  # fmt: skip
    if args.kernel_threads is not None and args.resolve != "device":
        raise ConfigError.of("kernel_threads", str(args.kernel_threads), "with --resolve device")
    _at_least(args, 1, "kernel_threads")
    if args.resolve == "device":
        from sparsetier.tools import bench_resolve

        if args.io_backend != "cpu" or args.map_device is not None or args.trace:
            raise ConfigError.of(
                "resolve", "device", "with --io-backend cpu, no --map-device and no --trace "
                "(the device resolver runs its reference implementation on the CPU)"
            )  # fmt: skip
        r = bench_resolve.run(cfg, progress=True, kernel_threads=args.kernel_threads)
        print(bench_resolve.format_report(r))
        return r
    r = bench_decode.run(cfg, progress=True)
    print(bench_decode.format_report(r))
    return r


def _bench_prefix(args: argparse.Namespace) -> dict | None:
    from sparsetier.tools import bench_prefix

    for name, default, used in (("reps", 7, args.paired or args.containers),
                                ("max_len", 4096, args.paired)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not used:
            allowed = "with --paired" + (" or --containers" if name == "reps" else "")
            raise ConfigError.of(name, str(getattr(args, name)), allowed)
    _at_least(args, 1, "page_size", "num_seqs", "num_queries", "serve_reqs", "reps", "max_len")
    if not 0.0 <= args.followup_frac <= 1.0:
        raise ConfigError.of("followup_frac", str(args.followup_frac), "a share in [0, 1]")
    kw = {
        "page_size": args.page_size,
        "num_seqs": args.num_seqs,
        "num_queries": args.num_queries,
        "serve_reqs": args.serve_reqs,
        "followup_frac": args.followup_frac,
    }
    if args.containers:
        rc = bench_prefix.compare_containers(
            args.page_size, args.serve_reqs, args.reps, args.num_seqs
        )
        print(bench_prefix.format_containers(rc))
        return None
    if (args.paired or args.peers_python) and not args.peers_dir:
        raise ConfigError.of(
            "peers_dir", "None", "the folder of the peer scripts (--peers-dir or "
            "$SPARSETIER_PEERS_DIR) to run SGLang"
        )  # fmt: skip
    if args.paired:
        if not args.peers_python:
            raise ConfigError.of("peers_python", "None", "the peers' python for --paired")
        if args.token_type != "q":
            raise ConfigError.of(
                "token_type", args.token_type, "q with --paired (SGLang accepts array('q') only)"
            )
        print(bench_prefix.run_paired(args))
        return None
    r = bench_prefix.run(**kw, stream=args.stream, token_type=args.token_type)
    peers = {}
    if args.peers_python:
        for impl in ("unified-rust", "radix"):
            peer = bench_prefix.run_peer(
                args.peers_python, args.peers_dir, impl, args.page_size, kw
            )
            peers[f"sglang {impl}"] = bench_prefix.peer_ops(peer)
    print(bench_prefix.format_report(r, peers))
    return {"sparsetier": r, "peers": peers}


def _bench_transfer(args: argparse.Namespace) -> dict:
    from sparsetier.tools import bench

    _at_least(args, 1, "total_mb")
    if args.device == "cpu":
        rows = bench.bench_transfer_cpu(args.total_mb)
    else:
        from sparsetier.tools import bench_gpu

        rows = bench_gpu.bench_transfer_cuda(args.total_mb)
    print(bench.format_transfer(rows))
    return bench.transfer_json(rows)


def _bench_directory(args: argparse.Namespace) -> dict:
    from sparsetier.tools import bench

    for b in args.batches:
        if b < 1:
            raise ConfigError.of("batches", str(b), "integers >= 1")
    for h in args.hit_rates:
        if not 0.0 <= h <= 1.0:
            raise ConfigError.of("hit_rates", str(h), "numbers in [0, 1]")
    rows = bench.bench_directory(tuple(args.batches), tuple(args.hit_rates))
    print(bench.format_directory(rows))
    return bench.directory_json(rows)


def _run_bench(args: argparse.Namespace) -> None:
    r = args.bench(args)
    if args.json and r is not None:
        _write_json(args.json, r)


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    from sparsetier.tools.demo import DemoConfig

    d = DemoConfig()
    p = sub.add_parser("demo", help="sparse decode with tiered KV, checked against all-resident")
    p.add_argument(
        "--device",
        default=d.device,
        help="cpu or cuda (device pools on the GPU, the kernel engine)",
    )
    p.add_argument("--budget", type=float, default=d.budget, help="device share of the main KV")
    p.add_argument(
        "--selection",
        choices=["block", "token"],
        default=d.selection,
        help="block: NSA-style top-k blocks; token: DSA-style top-k tokens",
    )
    p.add_argument("--topk", type=int, default=d.topk, help="blocks each query reads (block)")
    p.add_argument(
        "--topk-tokens",
        type=int,
        default=d.topk_tokens,
        help="tokens each query reads (token mode)",
    )
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="tokens per selection block (0: the page size); divides or is a "
        "multiple of the page size",
    )
    p.add_argument(
        "--faults",
        action="store_true",
        help="inject load, backup and restore failures (any engine) and report them",
    )
    p.add_argument(
        "--restart-failed",
        action="store_true",
        help="restart each failed request once from where it stood (DecodeRuntime.restart; "
        "default: it ends, and its conversation with it)",
    )
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrent", type=int, default=d.concurrent, help="requests decoding at once")
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps per request (max)")
    p.add_argument("--context-min", type=int, default=d.context_min)
    p.add_argument("--context-max", type=int, default=d.context_max)
    p.add_argument("--no-prefetch", action="store_true", help="submit each load just before use")
    p.add_argument("--turns", type=int, default=d.turns, help="most turns of a conversation")
    p.add_argument(
        "--layout",
        choices=["layer_first", "layer_page_first"],
        default=d.layout,
        help="host pool layout (per-layer objects address (host page, layer) in it)",
    )
    p.add_argument(
        "--kv-format",
        choices=["bf16", "fp8"],
        default=d.kv_format,
        help="fp8: main KV as FP8 values + fp32 scales per row, Indexer-K in FP8 "
        "values-then-scales pages (DeepSeek-V3.2's formats)",
    )
    p.add_argument(
        "--token-map",
        choices=["core", "device"],
        default=d.token_map,
        help="token mode: map tokens to pages in the core (default) or on the model's device "
        "(sparsetier.token_map), the core then plans page rows with counts",
    )
    p.add_argument(
        "--resolve",
        choices=["host", "device"],
        default=d.resolve,
        help="where a decode layer's top-k becomes slots: the core, one call a layer (host), "
        "or the device resolver, one grant a step (device: its reference implementation on "
        "the cpu, its CUDA kernel with --device cuda)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="with --device cuda --resolve device: replay the tiered runs' device-resolved "
        "decode steps as CUDA graphs, one per batch size and history bucket",
    )
    p.add_argument(
        "--restore",
        choices=["auto", "indexer", "full", "predicted"],
        default=d.restore,
        help="what a prefix hit restores of its main KV: by the core's cost model (auto), "
        "Indexer-K only with KV on demand (indexer), all of it in bulk (full), or in bulk the "
        "pages predicted to be selected by their position, the rest on demand (predicted)",
    )
    p.add_argument(
        "--storage-backend",
        choices=["file", "mooncake"],
        default=d.storage_backend,
        help="L3 under the tiered run's prefix tier (mooncake: a local master started here), "
        "with a host tier too small for the conversations",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="write the full record (per step and totals)")
    p.add_argument("--trace", metavar="PATH", help="write the tiered run's trace (.npz) for replay")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: hit rate, bytes, exposed wait")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a recorded trace at other device budgets: LRU (the directory) vs MIN",
    )
    p.add_argument("trace", help="a .npz trace (sparsetier demo --trace PATH)")
    p.add_argument(
        "--budgets",
        default="5,10,15,20,25,30,40,50,60,70,80,90,100",
        help="device budgets, %% of the peak live pages, comma-separated",
    )
    p.add_argument("--bandwidth", type=float, help="link GB/s: transfer time per step")
    p.add_argument("--window-ms", type=float, help="with --bandwidth: overlap per step, ms")
    p.add_argument("--hit-rate", type=float, default=0.9, help="the sizing line's target")
    p.add_argument("--json", metavar="PATH", help="write every row")
    p.add_argument("--plot", metavar="PNG", help="hit rate against budget, per policy")


def _soak_parser(sub: argparse._SubParsersAction) -> None:
    from sparsetier.tools.soak import SoakConfig

    d = SoakConfig()
    p = sub.add_parser("soak", help="a long run of the joined scheduler: RSS and p99 over time")
    for name in ("requests", "concurrent", "layers", "device_slots", "host_pages",
                 "indexer_pages", "prompts", "steps", "every", "seed"):  # fmt: skip
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--faults", type=float, default=d.faults, help="fault chance per step")
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument(
        "--engine",
        choices=("python", "rust"),
        default="rust",
        help="the loop: rust (faster, for long runs) or python (through the bindings)",
    )
    p.add_argument("--json", metavar="PATH", help="write every report as a JSON line")
    p.add_argument("--plot", metavar="PNG", help="RSS and plan p99 over requests")


def _run_soak(args: argparse.Namespace) -> int:
    from sparsetier.tools import soak

    names = ("requests", "concurrent", "layers", "device_slots", "host_pages", "indexer_pages",
             "prompts", "steps", "every", "seed", "faults", "page_size")  # fmt: skip
    cfg = soak.SoakConfig(**{n: getattr(args, n) for n in names})
    out = open(args.json, "w") if args.json else None
    try:
        reports = soak.run(cfg, out, engine=args.engine)
    finally:
        if out is not None:
            out.close()
    if args.plot and reports:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
        x = [r["requests"] for r in reports]
        ax[0].plot(x, [r["rss_mib"] for r in reports])
        ax[0].set_ylabel("RSS MiB")
        ax[1].plot(x, [r["plan_p99_us"] for r in reports], label="plan")
        ax[1].plot(x, [r["end_step_p99_us"] for r in reports], label="end_step")
        ax[1].set_ylabel("p99 us")
        ax[1].legend()
        ax[1].set_xlabel("requests")
        fig.tight_layout()
        fig.savefig(args.plot)
    checked = reports[-1]["rows_checked"] if reports else 0
    print(
        "invariants checked: every request ended, nothing pinned or in flight; "
        f"data patterns checked: {checked:,} rows, all as written"
    )
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from sparsetier.tools import demo

    cfg = demo.DemoConfig(
        requests=args.requests,
        concurrent=args.concurrent,
        steps=args.steps,
        context_min=args.context_min,
        context_max=args.context_max,
        page_size=args.page_size,
        topk=args.topk,
        topk_tokens=args.topk_tokens,
        selection=args.selection,
        block_size=args.block_size,
        faults=args.faults,
        restart_failed=args.restart_failed,
        budget=args.budget,
        prefetch=not args.no_prefetch,
        turns=args.turns,
        layout=args.layout,
        kv_format=args.kv_format,
        token_map=args.token_map,
        resolve=args.resolve,
        graphs=args.graphs,
        restore=args.restore,
        storage_backend=args.storage_backend,
        trace=args.trace,
        device=args.device,
        seed=args.seed,
    )
    r = demo.run_demo(cfg, progress=not args.quiet)  # (checks cfg first)
    print(demo.format_summary(r))
    if args.json:
        demo.write_json(r, args.json)
    if args.plot:
        demo.plot(r, args.plot)
    return 0 if r["totals"]["correct"] else 1


def _check_paths(args: argparse.Namespace) -> None:
    """Files the command will write or read, checked before it runs (not after a long run)."""
    outputs = ("json", "plot") + (("trace",) if args.command in ("demo", "bench") else ())
    inputs = ("selections", "stream") + (("trace",) if args.command == "replay" else ())
    for name in outputs:
        path = getattr(args, name, None)
        if not isinstance(path, str):
            continue  # (plan's --json is a switch)
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.exists(path):  # (written over, or appended to: .jsonl, /dev/stdout)
            ok = not os.path.isdir(path) and os.access(path, os.W_OK)
        else:
            ok = os.path.isdir(parent) and os.access(parent, os.W_OK)
        if not ok:
            raise ConfigError.of(
                name, path, "a writable file, or a new one in a writable directory"
            )
    for name in inputs:
        path = getattr(args, name, None)
        if isinstance(path, str) and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError.of(name, path, "a readable file")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsetier", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    _bench_parser(sub)
    _demo_parser(sub)
    _replay_parser(sub)
    _soak_parser(sub)
    args = parser.parse_args(argv)
    try:
        _check_paths(args)
        if args.command == "demo":
            return _run_demo(args)
        if args.command == "replay":
            from sparsetier import replay

            return replay.run(args)
        if args.command == "soak":
            return _run_soak(args)
        if args.command == "plan":
            _plan_shape(args)
            plan = build_plan(args)
            est = None
            if args.context is not None:
                _at_least(args, 1, "context", "topk")
                est = prefix_hit_estimate(plan, args.context, args.topk)
            if args.json:
                d = plan.to_dict()
                if args.model is not None:
                    d["model"] = PRESETS[args.model].to_dict()
                if est is not None:
                    d["prefix_hit_estimate"] = est
                print(json.dumps(d, indent=2))
            else:
                if args.model is not None:
                    print(format_model(PRESETS[args.model]))
                print(format_plan(plan))
                if est is not None:
                    print(format_estimate(est))
        elif args.command == "bench":
            _run_bench(args)
    except SparsetierError as e:
        print(f"sparsetier {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
