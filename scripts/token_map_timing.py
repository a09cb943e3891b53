"""Where one layer's token mapping spends its CPU time (`sparsetier.token_map`), at
DeepSeek-V3.2's shape (64 rows of top-2048 tokens, 64-token pages), on the GPU if there is one:
the batched ops (queued: eagerly, and as `TokenMapper`'s CUDA graph replay on the GPU), their
wait plus the copy of pages and counts to the CPU, and the per-token table gathered back.
Median microseconds of 200 runs each, the two mappings alternating."""

import statistics
import time

import torch

from sparsetier.token_map import TokenMapper, map_tokens

dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(1)
hot = torch.randint(0, 2048, (64, 128), generator=g) * 64  # 128 hot pages a row
pick = torch.randint(0, 128, (64, 2048), generator=g)
sel = (hot.gather(1, pick) + torch.randint(0, 64, (64, 2048), generator=g)).sort(1).values
sel = sel.to(dev)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


mapper = TokenMapper(64)
times = {
    "map (queue), eager": [],
    "map (queue), graph": [],
    "to_host (wait + copy)": [],
    "token_table": [],
    "sel.cpu()": [],
}
for i in range(220):
    sync()
    t0 = time.perf_counter()
    mapper(sel)
    t1 = time.perf_counter()
    sync()
    if i >= 20:
        times["map (queue), graph"].append(t1 - t0)
    t0 = time.perf_counter()
    tp = map_tokens(sel, 64)
    t1 = time.perf_counter()
    pages, counts = tp.to_host()
    t2 = time.perf_counter()
    table = torch.from_numpy(pages.astype("int32")).pin_memory() if dev == "cuda" else None
    t3 = time.perf_counter()
    if table is not None:
        tp.token_table(table.to(dev, non_blocking=True))
        sync()
    t4 = time.perf_counter()
    sel.cpu().numpy()  # what the core's mapping needs instead: the token rows on the CPU
    t5 = time.perf_counter()
    if i >= 20:
        times["map (queue), eager"].append(t1 - t0)
        times["to_host (wait + copy)"].append(t2 - t1)
        times["token_table"].append(t4 - t3)
        times["sel.cpu()"].append(t5 - t4)
print(f"device {dev}, pages per row {pages.shape[1]}, graph replays {mapper.replays}")
for k, v in times.items():
    print(f"{k:24s} {statistics.median(v) * 1e6:8.1f} us")
