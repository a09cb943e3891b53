#!/usr/bin/env bash
# The one prepared script for the GPU machine (issue 4). Two steps:
#
#   here, once:   scripts/gpu-check.sh build
#       builds an abi3 wheel with a manylinux_2_28 tag (maturin --zig) into .whl/, which
#       `.git/info/exclude` must ignore (`echo /.whl/ >> .git/info/exclude`).
#   there:        device run, carry [".whl"], command: bash scripts/gpu-check.sh run
#       installs the wheel offline into /tmp/site (the machine has Python 3.12, torch with
#       CUDA 13.0, hypothesis and pytest, and no network), then writes under $OUT:
#         env.txt             versions, GPU name, driver
#         pytest.txt          tests/test_cuda.py (CUDA round trips, stream wait, NVRTC),
#                             tests/test_transfer.py and tests/test_hicache.py (GPU round trips)
#         demo_cuda.txt/.json `sparsetier demo --device cuda` (tiered == resident on the GPU,
#                             block mode, through the step scheduler with stream waits)
#         demo_cuda_token.txt the same in token mode
#         bench_transfer.txt  `sparsetier bench transfer --device cuda` table
#         bench_transfer.json the same rows as JSON
# Each step has its own timeout, so a hang leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-run}" in
build)
    set -e
    VENV=${SPARSETIER_VENV:-$HOME/.cache/sparsetier/venv}
    "$VENV/bin/python" -m pip install -q ziglang
    rm -rf .whl && mkdir -p .whl
    "$VENV/bin/maturin" build --release --zig --compatibility manylinux_2_28 -i python3.11 --out .whl
    ls -la .whl
    ;;
run)
    OUT=${OUT:-/tmp/sparsetier-out}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sparsetier-*.whl \
        || { echo "wheel install failed" > "$OUT/env.txt"; exit 1; }
    export PYTHONPATH=/tmp/site
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
        python3 -c "import sparsetier, torch; print('sparsetier', sparsetier.__version__, 'torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name()); print('cuda_status', sparsetier.cuda_status())"
    } > "$OUT/env.txt" 2>&1
    timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_transfer.py \
        tests/test_hicache.py > "$OUT/pytest.txt" 2>&1
    echo "exit $?" >> "$OUT/pytest.txt"
    timeout 120 python3 -m sparsetier.cli demo --device cuda --quiet --json "$OUT/demo_cuda.json" \
        > "$OUT/demo_cuda.txt" 2>&1
    echo "exit $?" >> "$OUT/demo_cuda.txt"
    timeout 90 python3 -m sparsetier.cli demo --device cuda --quiet --selection token \
        > "$OUT/demo_cuda_token.txt" 2>&1
    echo "exit $?" >> "$OUT/demo_cuda_token.txt"
    timeout 240 python3 -m sparsetier.cli bench transfer --device cuda --total-mb 256 \
        --json "$OUT/bench_transfer.json" > "$OUT/bench_transfer.txt" 2>&1
    echo "exit $?" >> "$OUT/bench_transfer.txt"
    tail -n 5 "$OUT/pytest.txt" "$OUT/demo_cuda.txt" "$OUT/demo_cuda_token.txt" \
        "$OUT/bench_transfer.txt"
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
