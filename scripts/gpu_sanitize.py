"""Round trips through both CUDA engines, small enough to run under compute-sanitizer
(`scripts/gpu-check.sh run` does): an out-of-bounds or misaligned access in the copy kernel or
the direct engine's batches is reported there as an error, and the exit status is non-zero."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_cuda import gpu_round_trip

for backend in ("kernel", "direct"):
    for granularity in ("page", "token"):
        gpu_round_trip(backend, "layer_page_first", "KV", granularity)
        gpu_round_trip(backend, "layer_first", "INDEXER", granularity, dim=132, dtype="fp8_e4m3")
        print(backend, granularity, "ok", flush=True)
