#!/usr/bin/env bash
# The one prepared script for the GPU machine (issue 4). Two steps:
#
#   here, once:   scripts/gpu-check.sh build
#       builds an abi3 wheel with a manylinux_2_28 tag (maturin --zig) into .whl/, and has
#       `.git/info/exclude` ignore it (so that it travels as a carried path, never committed).
#   there:        device run, carry [".whl"], timeout_s 560, command:
#                     bash scripts/gpu-check.sh run [PART...]
#       PARTs (default: all, in this order): resolver tiered kernel tests demos sanitizer token
#       decode transfer
#       The whole run keeps to GPU_CHECK_BUDGET seconds (default 480): each step's timeout is
#       cut to what is left, and a step with less than 20 s left is skipped and says so.
#       installs the wheel offline into /tmp/site (the machine has Python 3.12, torch with
#       CUDA 13.0, hypothesis and pytest, and no network), then writes under $OUT:
#         env.txt             versions, GPU name, driver, the cost of a stream look-up
#         pytest.txt          tests/test_cuda.py (CUDA round trips, stream wait, NVRTC),
#                             tests/test_hicache.py (GPU round trips) and
#                             tests/test_gpu_runtime.py (the decode runtime on the GPU) and
#                             tests/test_packed.py (packed FP8 rows through both engines),
#                             tests/test_decode.py (its prefix-restore test on the GPU too),
#                             tests/test_token_map.py (the mapping on the GPU, eager and graphed),
#                             tests/test_block_mover.py (the vLLM worker's block moves:
#                             DeepSeek-V3.2-shaped MLA and indexer blocks to pinned host pools
#                             and back, and a failed copy, through the kernel and direct engines)
#         resolver.txt        the device resolver's kernel launched on the GPU alone
#                             (`python -m sparsetier.tools.resolver_gpu`): every cell of every
#                             layer checked against its object's bytes, the objects counted
#                             once, and its GPU time a layer (part kernel, below), each run's
#                             JSON after its line; the runtime's
#                             resolver captured in torch CUDA graphs and replayed
#                             (tests/test_resolver_capture.py); the runtime's decode
#                             through it (`demo --device cuda --resolve device`, block and
#                             token, and test_gpu_runtime.py's device_resolve cases: tiered ==
#                             resident, layers under torch's sync debug mode "error"); then
#                             tests/test_resolver_gpu.py's GPU cases; the runtime's whole
#                             decode steps as CUDA graphs (tests/test_step_graphs.py's cuda
#                             cases, `demo --device cuda --resolve device --graphs`).
#                             Part kernel (into resolver.txt too): the kernel alone at that
#                             shape, eager and as a CUDA graph (one layer's two launches
#                             captured), block and token mode; part resolver runs it graphed
#                             at a smaller shape, 4 layers a graph.
#         demo_cuda.txt       `sparsetier demo --device cuda` (tiered == resident on the GPU,
#                             through the step scheduler with stream waits), block and token
#                             selection, with and without prefetch, in FP8 (--kv-format),
#                             and with --faults (load, backup and restore failures through
#                             the CUDA engines' fault hook, failed turns restarted with
#                             --restart-failed) in both selections
#         tiered.jsonl        `sparsetier bench tiered --device cuda` (block, token, block with
#                             --graphs): decode tokens/s with a quarter of the KV on the device
#                             against all-resident, paired in one process (tables in
#                             resolver.txt)
#         bench_transfer.txt  `sparsetier bench transfer --device cuda` table
#         bench_transfer.json the same rows as JSON
#         (pytest.txt, after the tests) compute-sanitizer memcheck over scripts/gpu_sanitize.py
#                             and over a small run of the resolver's GPU check
#         bench_decode.txt    `sparsetier bench decode` on the machine's CPU: token mode with a
#                             fourth stack mapping tokens to pages on the GPU (--map-device)
#                             and scripts/token_map_timing.py's split of one layer's mapping
#                             (eager ops against TokenMapper's CUDA graph replay), then block
#                             mode with its three stacks (issue 10's figure) on the kernel
#                             engine (pools on the GPU) and on the cpu engine
# Each step has its own timeout, so a hang leaves the others' results; the steps run in order
# of worth (what never ran on a GPU first), so a run cut short by the budget loses the least
# worth. Output is unbuffered, so a step killed at its timeout keeps its last lines.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-run}" in
build)
    set -e
    VENV=${SPARSETIER_VENV:-$HOME/.cache/sparsetier/venv}
    "$VENV/bin/python" -m pip install -q ziglang
    export PATH="$VENV/bin:$PATH"  # maturin finds zig as `python3 -m ziglang`
    rm -rf .whl && mkdir -p .whl
    grep -qx /.whl/ .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    "$VENV/bin/maturin" build --release --features testing --zig --compatibility manylinux_2_28 \
        -i python3.11 --out .whl  # the tests and demo --faults need the test hooks
    ls -la .whl
    ;;
run)
    shift
    parts=" ${*:-resolver tiered kernel tests demos sanitizer token decode transfer} "
    has() { [[ $parts == *" $1 "* ]]; }
    export PYTHONUNBUFFERED=1
    T0=$SECONDS
    BUDGET=${GPU_CHECK_BUDGET:-480}
    # step CAP CMD...: CMD under a timeout of CAP seconds, cut to what is left of the budget.
    step() {
        local cap=$1 left=$((BUDGET - (SECONDS - T0)))
        shift
        if ((left < 20)); then
            echo "skipped (${left} s of the budget left): $*"
            return 125
        fi
        ((cap > left)) && cap=$left
        timeout -k 10 "$cap" "$@"
    }
    # pytest: the project's addopts (-q) left out, so the summary line and FAILED lines show.
    PYTEST=(python3 -m pytest -o addopts= -q -rfEs -p no:cacheprovider)
    OUT=${OUT:-/tmp/sparsetier-out}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/sparsetier-*.whl \
        || { echo "wheel install failed" > "$OUT/env.txt"; exit 1; }
    export PYTHONPATH=/tmp/site
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
        lscpu | grep -E "Model name|^CPU\(s\)" || true
        python3 -c "import sparsetier, torch; print('sparsetier', sparsetier.__version__, 'torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name()); print('cuda_status', sparsetier.cuda_status())"
        # What one look-up of torch's current stream costs (every scheduler call on a CUDA
        # engine makes one): the raw getter the engines use, and current_stream() before it.
        python3 -c "import timeit, torch; torch.cuda.init(); n = 20000; raw = torch._C._cuda_getCurrentRawStream; print('stream lookup us: raw', round(min(timeit.repeat(lambda: raw(0), number=n, repeat=5)) / n * 1e6, 3), 'current_stream', round(min(timeit.repeat(lambda: torch.cuda.current_stream(0).cuda_stream, number=n, repeat=5)) / n * 1e6, 3))" || true
    } > "$OUT/env.txt" 2>&1
    # The checks in order of worth; each has its own timeout so a hang leaves the others.
    per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=60)
    if has resolver; then
        # The runtime's decode steps through the kernel on CUDA pools (bit-identical to the
        # all-resident run), block and token; then its layers under torch's sync debug mode.
        for mode in block token; do
            step 60 python3 -m sparsetier.tools.cli demo --device cuda --quiet --resolve device \
                --selection "$mode" >> "$OUT/resolver.txt" 2>&1
            echo "resolver demo $mode: exit $?" >> "$OUT/resolver.txt"
        done
        step 120 "${PYTEST[@]}" tests/test_gpu_runtime.py \
            -k device_resolve >> "$OUT/resolver.txt" 2>&1
        echo "resolver runtime pytest: exit $?" >> "$OUT/resolver.txt"
        # (The kernel alone at DeepSeek-V3.2's shape, eager and graphed: part kernel.)
        # DeepSeek-V3.2's packed FP8 rows through the kernel.
        step 60 python3 -m sparsetier.tools.cli demo --device cuda --quiet --resolve device \
            --kv-format fp8 >> "$OUT/resolver.txt" 2>&1
        echo "resolver demo block fp8: exit $?" >> "$OUT/resolver.txt"
        # With injected faults: the host-planned steps take them, the kernel's steps none.
        step 60 python3 -m sparsetier.tools.cli demo --device cuda --quiet --resolve device \
            --faults >> "$OUT/resolver.txt" 2>&1
        echo "resolver demo block faults: exit $?" >> "$OUT/resolver.txt"
        # Under CUDA graph capture: a step's 4 layers captured once, replayed each step.
        step 90 python3 -m sparsetier.tools.resolver_gpu --graph true --layers 4 --rows 16 \
            --context 32768 --steps 8 --json - >> "$OUT/resolver.txt" 2>&1
        echo "resolver graph: exit $?" >> "$OUT/resolver.txt"
        step 90 "${PYTEST[@]}" $per_test \
            tests/test_resolver_gpu.py -k gpu_passes >> "$OUT/resolver.txt" 2>&1
        echo "resolver pytest: exit $?" >> "$OUT/resolver.txt"
        # The runtime's resolver captured in torch CUDA graphs and replayed step after step
        # (graph_epoch, will_replay), every cell checked against the rows the model wrote.
        step 90 "${PYTEST[@]}" $per_test \
            tests/test_resolver_capture.py -k cuda >> "$OUT/resolver.txt" 2>&1
        echo "resolver capture pytest: exit $?" >> "$OUT/resolver.txt"
        # The runtime's whole decode steps as CUDA graphs (DecodeRuntime(graphs=True)):
        # tiered == resident through captures and replays, in the tests and the demo.
        step 120 "${PYTEST[@]}" $per_test \
            tests/test_step_graphs.py -k cuda >> "$OUT/resolver.txt" 2>&1
        echo "step graphs pytest: exit $?" >> "$OUT/resolver.txt"
        step 90 python3 -m sparsetier.tools.cli demo --device cuda --quiet --resolve device \
            --graphs >> "$OUT/resolver.txt" 2>&1
        echo "resolver demo block graphs: exit $?" >> "$OUT/resolver.txt"
    fi
    if has kernel; then
        # The kernel alone at batch 64, top-2048 of 128k, eager and as a CUDA graph.
        for tok in false true; do
            for graph in false true; do
                step 90 python3 -m sparsetier.tools.resolver_gpu --tokens "$tok" --graph "$graph" \
                    --steps "$([ $tok = true ] && echo 5 || echo 8)" --json - \
                    >> "$OUT/resolver.txt" 2>&1
                echo "resolver tokens=$tok graph=$graph: exit $?" >> "$OUT/resolver.txt"
            done
        done
    fi
    if has tiered; then
        # Tiered decode (a quarter of the KV on the device) against all-resident, in decode
        # tokens/s, alternating in one process; outputs bit-identical in every pair.
        # (Token mode with longer prompts: at the demo's, a step's floor holds 61 % of the KV.)
        for args in "--selection block" "--selection token --context-min 4096 --context-max 12288" \
            "--selection block --graphs"; do
            step 120 python3 -m sparsetier.tools.cli bench tiered --device cuda --pairs 3 \
                $args --json "$OUT/tiered.jsonl" >> "$OUT/resolver.txt" 2>&1
            echo "tiered $args: exit $?" >> "$OUT/resolver.txt"
        done
    fi
    if has tests; then
        # The files never run on a GPU first, in a process of their own; then the rest. The
        # cpu cases are CI's; the device resolver's runtime cases run in part resolver.
        step 90 "${PYTEST[@]}" -v $per_test tests/test_token_map.py tests/test_block_mover.py \
            -k "not cpu or mapping_on_the_gpu" >> "$OUT/pytest.txt" 2>&1
        echo "exit (token map, block mover) $?" >> "$OUT/pytest.txt"
        step 120 "${PYTEST[@]}" $per_test tests/test_cuda.py tests/test_hicache.py \
            tests/test_gpu_runtime.py tests/test_packed.py tests/test_decode.py \
            -k "not cpu and not device_resolve" >> "$OUT/pytest.txt" 2>&1
        echo "exit $?" >> "$OUT/pytest.txt"
    fi
    if has demos; then
        for mode in block token; do
            # Injected load, backup and restore failures through the CUDA engine's fault hook;
            # each failed turn restarted once (the resident run restarts the same ones).
            step 60 python3 -m sparsetier.tools.cli demo --device cuda --quiet --faults \
                --restart-failed --selection "$mode" >> "$OUT/demo_cuda.txt" 2>&1
            echo "demo $mode faults restarted: exit $?" >> "$OUT/demo_cuda.txt"
        done
        step 60 python3 -m sparsetier.tools.cli demo --device cuda --quiet --kv-format fp8 \
            >> "$OUT/demo_cuda.txt" 2>&1
        echo "demo block prefetch fp8: exit $?" >> "$OUT/demo_cuda.txt"
        for mode in block token; do
            for pf in prefetch no-prefetch; do
                flag=$([ "$pf" = no-prefetch ] && echo --no-prefetch)
                step 60 python3 -m sparsetier.tools.cli demo --device cuda --quiet \
                    --selection "$mode" $flag >> "$OUT/demo_cuda.txt" 2>&1
                echo "demo $mode $pf: exit $?" >> "$OUT/demo_cuda.txt"
            done
        done
    fi
    if has sanitizer; then
        # Out-of-bounds or misaligned accesses of the copy kernel and the direct engine.
        command -v compute-sanitizer >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
        # (Into pytest.txt: at most 8 files come back.)
        echo "== compute-sanitizer" >> "$OUT/pytest.txt"
        # (torch's caching allocator off: buffers packed into one segment would hide an
        # out-of-bounds access from one into the next.)
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 step 100 compute-sanitizer --tool memcheck \
            --leak-check no --error-exitcode 9 python3 scripts/gpu_sanitize.py \
            >> "$OUT/pytest.txt" 2>&1
        echo "sanitizer exit $?" >> "$OUT/pytest.txt"
        # The device resolver's kernel under memcheck: its cells' reads of the host pool over
        # unified addressing and its writes of slots, log and counts stay in bounds.
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 step 100 compute-sanitizer --tool memcheck \
            --leak-check no --error-exitcode 9 python3 -m sparsetier.tools.resolver_gpu \
            --rows 4 --context 8192 --layers 2 --steps 3 --warmup 0 >> "$OUT/pytest.txt" 2>&1
        echo "resolver sanitizer exit $?" >> "$OUT/pytest.txt"
    fi
    if has token; then
        # Token mode: the core's mapping of tokens to pages against map_tokens on the GPU.
        step 200 python3 -m sparsetier.tools.cli bench decode --steps 8 --mode token \
            --map-device cuda >> "$OUT/bench_decode.txt" 2>&1
        echo "token exit $?" >> "$OUT/bench_decode.txt"
        # Where one layer's device mapping spends its CPU (8 files at most come back).
        step 60 python3 scripts/token_map_timing.py >> "$OUT/bench_decode.txt" 2>&1
        echo "token map timing exit $?" >> "$OUT/bench_decode.txt"
    fi
    if has decode; then
        # The pools on the GPU and the kernel engine: copies by the GPU, `ready` a stream
        # wait (the deployment issue 10's CPU figure is about), first.
        step 150 python3 -m sparsetier.tools.cli bench decode --steps 30 --mode block \
            --io-backend kernel >> "$OUT/bench_decode.txt" 2>&1
        echo "block kernel exit $?" >> "$OUT/bench_decode.txt"
        # The same on the cpu engine (issue 10's run: block mode, its three stacks; the GPU
        # idle), whose figures RESULTS already has.
        step 150 python3 -m sparsetier.tools.cli bench decode --steps 30 --mode block \
            >> "$OUT/bench_decode.txt" 2>&1
        echo "block exit $?" >> "$OUT/bench_decode.txt"
    fi
    if has transfer; then
        # Every row alternates with the peak copy (the median paired ratio).
        step 240 python3 -m sparsetier.tools.cli bench transfer --device cuda --total-mb 256 \
            --json "$OUT/bench_transfer.json" > "$OUT/bench_transfer.txt" 2>&1
        echo "exit $?" >> "$OUT/bench_transfer.txt"
    fi
    cd "$OUT" && tail -n 4 pytest.txt bench_decode.txt 2>/dev/null
    grep -E "^resolver|exit|passed|failed|median paired" resolver.txt 2>/dev/null
    tail -n 12 bench_transfer.txt 2>/dev/null
    grep -E "exit|correctness|end state|faults" demo_cuda.txt 2>/dev/null
    ;;
*)
    echo "usage: $0 build | run [resolver] [tiered] [kernel] [tests] [demos] [sanitizer]" \
        "[token] [decode] [transfer]" >&2
    exit 2
    ;;
esac
