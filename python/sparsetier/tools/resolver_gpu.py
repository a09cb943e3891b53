"""The device resolver's CUDA kernel on a GPU, alone: checked and timed (`python -m
sparsetier.tools.resolver_gpu`, parts `kernel` and `resolver` of `scripts/gpu-check.sh`; test
builds).

A batch of requests with their own pages (homes) in a pinned host pool, a device pool of slots, and
decode steps whose selections keep `locality` of the last step's pages. Each step the host grants
slots as the core does (free slots, then victims: objects the last step did not read first), and
each layer is the two launches of `cuda/resolve.cu` (the layer's marks, then the resolve) on
torch's stream, between two CUDA events (the launch's read-back checks made before the first, so
that the events time the launches: an eager launch's host work, its argument checks and the two
`cuLaunchKernel` calls, still falls between them while the GPU waits; a graph's replay is the GPU's
time alone). After each launch (outside the events) the check: every cell's slot holds its object's
tag (the host pool's page, copied by the kernel over unified addressing), each layer counts every
object it read once (a hit or a miss), no cell went without a slot, and no slot is named twice.
This is the kernel alone; the runtime's decode steps on a GPU are part `resolver`'s `demo --device
cuda --resolve device`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class ResolverGpuConfig:
    rows: int = 64
    context: int = 131072  # tokens a request
    topk: int = 2048  # tokens a row selects (block mode: topk / page_size pages)
    page_size: int = 64
    row_bytes: int = 656  # DeepSeek-V3.2's FP8 KV row
    layers: int = 1
    steps: int = 10
    warmup: int = 2  # steps not timed (the first fills the device)
    tokens: bool = False  # token mode: every token of the selected pages a cell
    locality: float = 0.9
    seed: int = 0
    device: str = "cuda:0"  # or "cpu": the same source on CPU threads (test builds)
    graph: bool = False  # the layers' launches captured in a CUDA graph once, then replayed


def run(cfg: ResolverGpuConfig) -> dict:
    from sparsetier import testing

    dev = torch.device(cfg.device)
    on_gpu = dev.type == "cuda"
    if cfg.graph and not on_gpu:
        raise ValueError("graph = True: allowed on a CUDA device only")
    g = torch.Generator(device="cpu").manual_seed(cfg.seed)
    pages = cfg.context // cfg.page_size  # a request's pages
    kp = cfg.topk // cfg.page_size  # pages a row selects
    homes = cfg.rows * pages
    entries = homes * cfg.layers
    page_bytes = cfg.page_size * cfg.row_bytes
    assert page_bytes % 8 == 0 and page_bytes >= 16
    # The grant, as the core sizes it: one layer's cells, or twice the last step's misses
    # (later layers fill again what earlier ones filled once it is spent). The device holds a
    # step's objects and such a grant.
    cells_n = cfg.rows * kp
    slots = cells_n * (3 * cfg.layers + 1)
    last = 0
    host = torch.empty((entries, page_bytes), dtype=torch.uint8, pin_memory=on_gpu)
    tags = torch.arange(1, entries + 1, dtype=torch.int64)
    host.view(torch.int64)[:, 0] = tags
    host.view(torch.int64)[:, -1] = tags
    devpool = torch.zeros((slots, page_bytes), dtype=torch.uint8, device=dev)
    i32 = {"dtype": torch.int32, "device": dev}
    t = {
        "host": host,
        "dev": devpool,
        "planes": torch.tensor(
            [host.data_ptr(), devpool.data_ptr()], dtype=torch.int64, device=dev
        ),
        "mirror": torch.full((entries,), -1, **i32),
        "marks": torch.zeros(entries, **i32),
        "filled": torch.zeros(entries, **i32),
        "rows": torch.arange(cfg.rows, **i32),
        "tables": torch.arange(homes, **i32).view(cfg.rows, pages),
        "lens": torch.full((cfg.rows,), cfg.context, dtype=torch.int64, device=dev),
        "st": torch.zeros(testing.ResolveKernel.ST_LEN, **i32),
        "counts": torch.zeros(2 * cfg.layers, **i32),
        "tok": torch.zeros(3, dtype=torch.int64, device=dev),
    }
    kernel = testing.ResolveKernel((dev.index or 0) if on_gpu else "cpu")
    abi = testing.ResolveKernel  # the buffers' layout, from the kernel's own ABI
    sel_pages = torch.stack([torch.randperm(pages, generator=g)[:kp] for _ in range(cfg.rows)])
    k = kp * cfg.page_size if cfg.tokens else kp
    cells = cfg.rows * k
    # Fixed buffers, written in place each step (a captured graph reads the same addresses);
    # each layer its own table of slots.
    t["sel"] = torch.empty(cells, **i32)
    tables_out = torch.empty((cfg.layers, cells), **i32)
    t["grant"] = torch.zeros(2 * slots, **i32)
    t["deferred"] = torch.empty(2 * slots, **i32)
    cap = cells * cfg.layers
    t["log"] = torch.empty(cap * abi.LOG_INTS, **i32)
    per_layer = [dict(t, table=tables_out[layer]) for layer in range(cfg.layers)]
    shape = {"k": k, "layers": cfg.layers, "page_size": cfg.page_size, "tokens": cfg.tokens}
    div = cfg.page_size if cfg.tokens else 1
    graph = None
    out = {"config": asdict(cfg), "steps": []}
    for step in range(cfg.steps):
        serial = step + 1
        if step:
            # Keep `locality` of each row's pages; the rest drawn anew among the others.
            for r in range(cfg.rows):
                keep = torch.rand(kp, generator=g) < cfg.locality
                others = torch.randperm(pages, generator=g)
                others = others[~torch.isin(others, sel_pages[r])][: int((~keep).sum())]
                sel_pages[r, ~keep] = others
        if cfg.tokens:
            within = torch.arange(cfg.page_size)
            sel = (sel_pages[:, :, None] * cfg.page_size + within).reshape(cfg.rows, -1)
        else:
            sel = sel_pages
        t["sel"].copy_(sel.reshape(-1))
        # The grant, as the core makes it: free slots, then victims the last step did not
        # read, then those it read. A graph's step takes every layer's misses from it (its
        # layers are checked after the replay, so none may fill a slot another read).
        mirror = t["mirror"].cpu()
        marks = t["marks"].cpu()
        named = torch.nonzero(mirror >= 0).view(-1)
        used = torch.zeros(slots, dtype=torch.bool)
        used[mirror[named].long()] = True
        assert int(used.sum()) == named.numel(), "a slot named twice"
        free = torch.nonzero(~used).view(-1)
        read = marks[named] == serial - 1
        victims = torch.cat([named[~read], named[read]])
        grant_n = cells_n * cfg.layers if cfg.graph else max(cells_n, 2 * last)
        gslots = torch.cat([free, mirror[victims].long()])[:grant_n]
        gvict = torch.cat([torch.full((free.numel(),), -1), victims])[:grant_n]
        n = gslots.numel()
        t["grant"].view(slots, 2)[:n] = torch.stack([gslots, gvict], 1).to(**i32)
        t["deferred"].view(slots, 2)[:, 0] = 0
        t["deferred"].view(slots, 2)[:, 1] = abi.NOT_YET
        t["log"].view(cap, abi.LOG_INTS)[:, 4] = abi.NOT_YET
        for name in ("st", "counts", "tok"):
            t[name].zero_()
        t["st"][abi.ST_GRANT_LEN] = n
        t["st"][abi.ST_SERIAL] = serial
        t["st"][abi.ST_LOG_CAP] = cap
        t["st"][abi.ST_ROWS] = cfg.rows
        layer_ms = []
        if cfg.graph and step >= 1:
            # Step 0 ran eagerly; the layers' launches are captured once, then replayed each
            # step after the same checks a launch makes (`check`: nothing is read back inside
            # a capture).
            for layer in range(cfg.layers):
                kernel.check(per_layer[layer], layer=layer, call=layer + 1, **shape)
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    raw = torch.cuda.current_stream().cuda_stream
                    for layer in range(cfg.layers):
                        kernel.launch(
                            raw, per_layer[layer], layer=layer, call=layer + 1, capture=True,
                            **shape,
                        )  # fmt: skip
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            layer_ms = [a.elapsed_time(b) / cfg.layers] * cfg.layers
            for layer in range(cfg.layers):
                _check_layer(per_layer[layer], cfg.rows, pages, homes, layer, k, div)
        else:
            stream = torch.cuda.current_stream(dev).cuda_stream if on_gpu else 0
            for layer in range(cfg.layers):
                launch = {"layer": layer, "call": layer + 1, **shape}
                if on_gpu:
                    # The launch's checks read its buffers back (a host wait): made first, so
                    # that the events time the layer's launches, not the checks.
                    kernel.check(per_layer[layer], **launch)
                    a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    a.record()
                start = time.perf_counter()
                kernel.launch(stream, per_layer[layer], capture=on_gpu, **launch)
                took = (time.perf_counter() - start) * 1e3  # on the CPU the launch has run
                if on_gpu:
                    b.record()
                # Before the next layer's launch: it may fill again what this one filled.
                _check_layer(per_layer[layer], cfg.rows, pages, homes, layer, k, div)
                if on_gpu:
                    b.synchronize()
                    took = a.elapsed_time(b)
                layer_ms.append(took)
        c = t["counts"].cpu()
        misses = [int(c[2 * layer + 1]) for layer in range(cfg.layers)]
        st = t["st"].cpu()
        assert int(st[abi.ST_OVERFLOW]) == 0 and int(st[abi.ST_BAD]) == 0, st
        last = sum(misses)
        out["steps"].append({"layer_ms": layer_ms, "misses": misses, "cells": cells})
    timed = out["steps"][cfg.warmup :] or out["steps"]
    per_layer = [ms for s in timed for ms in s["layer_ms"]]
    miss = [m for s in timed for m in s["misses"]]
    ms = statistics.median(per_layer)
    out["summary"] = {
        "layer_ms_median": ms,
        "misses_per_layer_median": statistics.median(miss),
        "cells_per_layer": timed[0]["cells"],
        "copied_gb_per_s": statistics.median(miss) * page_bytes / (ms / 1e3) / 1e9 if ms else 0,
        "device": torch.cuda.get_device_name(dev) if on_gpu else "cpu (the kernel's source)",
        "checked": True,
    }
    return out


def _check_layer(t, rows: int, pages: int, homes: int, layer: int, k: int, div: int) -> None:
    """The checks after one layer's launches (see the module docs); an entry's page is entry // div
    (the page size in token mode, else 1)."""
    table = t["table"].view(rows, k).long()
    assert bool((table >= 0).all()), "a cell without a slot"
    page = t["sel"].view(rows, k).long() // div
    # Homes are the requests' own: row r's page p is home r * pages + p.
    h = torch.arange(rows, device=table.device)[:, None] * pages + page
    want = layer * homes + h + 1
    got = t["dev"].view(torch.int64)
    bad = (got[table, 0] != want) | (got[table, -1] != want)
    assert not bool(bad.any()), f"layer {layer}: {int(bad.sum())} cells read another object"
    c = t["counts"].cpu()
    distinct = int(torch.unique(h).numel())
    counted = int(c[2 * layer]) + int(c[2 * layer + 1])
    assert counted == distinct, f"layer {layer}: {counted} objects counted, {distinct} read"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, v in asdict(ResolverGpuConfig()).items():
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(v, bool) else type(v)
        p.add_argument("--" + f.replace("_", "-"), type=kind, default=v)
    p.add_argument("--json", help="write the run here (-: to standard output)")
    a = vars(p.parse_args(argv))
    path = a.pop("json")
    r = run(ResolverGpuConfig(**a))
    s = r["summary"]
    print(
        f"resolver kernel on {s['device']}: {s['layer_ms_median'] * 1e3:.0f} us a layer (median), "
        f"{s['cells_per_layer']} cells, {s['misses_per_layer_median']} misses "
        f"({s['copied_gb_per_s']:.1f} GB/s copied), every cell checked"
    )
    if path == "-":
        print(json.dumps(r))
    elif path:
        with open(path, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
