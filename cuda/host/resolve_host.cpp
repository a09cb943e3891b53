// The device resolver's kernel (`../resolve.cu`), compiled for the CPU in test builds: the same
// source, with CUDA's built-ins mapped to the host's. A launch runs `threads` CPU threads, each
// one lane-0-only warp striding over the cells, so cells race on real atomics as warps do.
// This is how CI runs the kernel's algorithm; what it cannot show is the GPU's weaker memory
// order between the fences the kernel states.

#include <atomic>
#include <thread>
#include <vector>

#define SPARSETIER_WARP 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict

namespace {

struct Dim {
    unsigned x;
};
thread_local Dim threadIdx{0}, blockIdx{0}, blockDim{1}, gridDim{1};

struct int2 {
    int x, y;
};
inline int2 make_int2(int x, int y) { return int2{x, y}; }
struct uint4 {
    unsigned x, y, z, w;
};

// Before each atomic and fence a thread may yield (one in four, from a per-thread stream), so
// that on a few cores the threads interleave between any two of the kernel's steps, not only
// where the scheduler happens to preempt them.
thread_local unsigned long long chaos_state = 0;
inline void chaos() {
    unsigned long long& x = chaos_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if ((x & 3u) == 0) std::this_thread::yield();
}

// CUDA's atomics return the old value; sequentially consistent here (stronger than the GPU's).
template <typename T> inline T atomicAdd(T* p, T v) {
    chaos();
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <typename T> inline T atomicExch(T* p, T v) {
    chaos();
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
template <typename T> inline T atomicCAS(T* p, T expected, T desired) {
    chaos();
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    return expected;
}
inline void __threadfence() {
    chaos();
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
template <typename T> inline T __shfl_sync(unsigned, T v, int) { return v; }
inline void __syncwarp() {}

}  // namespace

#include "../resolve.cu"

namespace {

// Runs `body` on `threads` CPU threads, each a block of one thread (`blockIdx.x` its index),
// started together behind a gate so that they overlap however slowly they spawn; returns when
// all are done.
template <typename F> void on_threads(int threads, unsigned long long seed, F body) {
    if (threads < 1) threads = 1;
    std::atomic<int> ready{0};
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([=, &ready] {
            blockIdx.x = (unsigned)t;
            gridDim.x = (unsigned)threads;
            chaos_state = 0x9e3779b97f4a7c15ull * (unsigned long long)(t + 1) + seed;
            ready.fetch_add(1);
            while (ready.load() < threads) std::this_thread::yield();
            body();
        });
    }
    for (auto& th : pool) th.join();
}

}  // namespace

// One layer over `threads` CPU threads: `sparsetier_mark`, then (its threads joined, as stream
// order has it) `sparsetier_resolve`.
extern "C" void sparsetier_layer_host(int threads, const int* sel, const int* rows,
                                      const int* tables, const long long* lens, int* table,
                                      StepArgs s, Geometry geo, int cells, int k,
                                      int pages_per_row, int layers, int layer, int page_size,
                                      int tokens) {
    on_threads(threads, (u64)layer + 3, [=] {
        sparsetier_mark(sel, rows, tables, lens, table, s, geo, cells, k, pages_per_row, layers,
                        layer, page_size, tokens);
    });
    on_threads(threads, (u64)layer, [=] {
        sparsetier_resolve(sel, rows, tables, lens, table, s, geo, cells, k, pages_per_row,
                           layers, layer, page_size, tokens);
    });
}

// One launch of `sparsetier_mirror_apply` over `threads` CPU threads.
extern "C" void sparsetier_mirror_apply_host(int threads, const int* changes, int n,
                                             int* mirror) {
    on_threads(threads, 1, [=] { sparsetier_mirror_apply(changes, n, mirror); });
}

// One launch of `sparsetier_marks_read` over `threads` CPU threads.
extern "C" void sparsetier_marks_read_host(int threads, const unsigned* marks,
                                           const unsigned* st, int entries, unsigned* bits) {
    on_threads(threads, 2, [=] { sparsetier_marks_read(marks, st, entries, bits); });
}
