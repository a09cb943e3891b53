"""Times each call of the device path's decode steps one by one, at `bench decode`'s default
shape (block mode, int32 rows), past the steps the bench sizes its pools for: the slowest
calls show stalls that medians hide. Run data for RESULTS, "Decode step: the device
resolver" (stalls). Usage: python benches/results/decode/2026-12-03-step-stalls.py [steps]"""

import sys
import time

import numpy as np

from sparsetier.tools import bench_resolve as br

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 380
cfg = br.DecodeBenchConfig(steps=40)
lens, device_pages, _ = br.sizes(cfg)
dev = br.JoinedStack(cfg, lens, device_pages, "device")
sels = br.Selections(cfg, lens)
rids = np.arange(cfg.batch, dtype=np.int64)
s, pc, times = dev.s, time.perf_counter, []
for _ in range(steps):
    sel = br.as_given(cfg, sels.next()).astype(np.int32)
    t0 = pc()
    s.append(rids)
    t1 = pc()
    s.begin_device_step(rids, sel.shape[2])
    t2 = pc()
    for layer in range(sel.shape[0]):
        dev.resolver.resolve(layer, rids, sel[layer], False)
    t3 = pc()
    s.end_step()
    times.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (pc() - t3) * 1e3))
for j, name in enumerate(("append", "begin_device_step", "end_step")):
    v = sorted(t[j] for t in times)
    print(f"{name}: median {v[len(v) // 2]:.3f} ms, max {v[-1]:.1f} ms")
print("calls over 2 ms (step: append, begin, end):")
for i, t in enumerate(times):
    if max(t) > 2:
        print(f"  {i}: " + ", ".join(f"{x:.1f}" for x in t))
