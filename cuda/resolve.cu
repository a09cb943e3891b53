// sparsetier device resolver: one decode layer's top-k mapped to device slots, the misses copied
// from pinned host memory (read over unified addressing) into slots the core granted, with no
// host round trip. The algorithm of `src/scheduler/resolver.rs` (the reference, run on the CPU),
// in parallel, two launches a layer: `sparsetier_mark` marks every object the layer reads (a
// thread a cell), then `sparsetier_resolve` serves the cells (a warp a cell; lane 0 decides, the
// warp copies).
//
// Compiled with NVRTC in CI (`compile_cuda_kernels`); launched by the runtime on CUDA pools
// (`src/scheduler/resolver/gpu.rs`). Test builds also compile this
// source for the CPU (`cuda/host/resolve_host.cpp`: a thread per cell in flight, lane 0 alone)
// and run the runtime's checks with it in place of the reference, through the same protocol
// (`src/scheduler/resolver/kernel.rs`).
//
// Where the reference walks cells in order, here cells race, and these make the race safe:
// - a missing mirror entry is claimed with a CAS from -1 to CLAIMING; the winner takes a slot,
//   copies, fences and publishes the slot; a loser waits for the slot (the winner is running);
// - every object the layer reads is marked by the layer's first launch, before any cell is
//   served (stream order): a victim the layer reads is always found marked and left in place,
//   and one it does not read no cell of the layer looks at;
// - slots are taken by atomic cursors: the grant in order (a victim this layer has read is
//   deferred: a cell may still read it), then victims deferred by earlier calls, then slots
//   earlier calls filled (their layers' cells were read: stream order); the last two cursors
//   advance by CAS and only over entries they take, so an entry deferred (or filled) later in
//   the step is still found by a later call;
// - the log and the counts are appended with atomics; the host reads them back once, at the
//   step's end.
// Slot assignment may differ from the reference's order; what each cell reads does not.

typedef unsigned long long u64;
typedef unsigned int u32;

// Lanes a cell gets: a warp on the GPU. The host build (`cuda/host/resolve_host.cpp`, test
// builds) runs each cell on one CPU thread, lane 0 alone.
#ifndef SPARSETIER_WARP
#define SPARSETIER_WARP 32
#endif

#define ABSENT (-1)
#define FAILED (-2)    // a cell's slot when it got none (the reference's `FAILED`)
#define CLAIMING (-3)
// A cell's table entry between a layer's two launches: its object's mark set by this cell (it
// counts the hit) or by another. Never slots: a table a failed launch left so names none.
#define MARKED_FIRST (-4)
#define MARKED (-5)

// Cursors and counters in `st`.
#define ST_USED 0      // grant entries gone through
#define ST_LOG 1       // log entries written
#define ST_OVERFLOW 2  // cells left without a slot
#define ST_DEF_LEN 3   // deferred grant entries
#define ST_DEF_AT 4    // deferred entries taken again
#define ST_REFILL_AT 5 // log entries of earlier calls considered for a refill
#define ST_BAD 6       // cells naming a page past their request (the reference refuses them)
// Written by the host before a step (with the grant), read by every launch of the step, so
// that a layer's launches take the same arguments every step and a CUDA graph can replay them.
#define ST_GRANT_LEN 7 // entries in the grant
#define ST_SERIAL 8    // the step's serial (read marks)
#define ST_LOG_CAP 9   // log entries the step's log has room for
#define ST_ROWS 10     // the step's requests: a launch's rows past them are padding

// Token counts in `tok` (64-bit): read amplification's terms, as the reference counts them.
#define TOK_SELECTED 0     // selected entries (cells naming a page)
#define TOK_NEEDED 1       // selected tokens, every cell
#define TOK_NEEDED_MOVED 2 // selected tokens in the objects this step copied

// A deferred or log entry not written yet (the host fills `deferred` and the log's calls with
// it at each step's start).
#define NOT_YET 0x7fffffff

struct Geometry {
    const u64* host_planes;  // plane base addresses of the host KV pool (flattened view)
    const u64* dev_planes;   // plane base addresses of the one-layer device pool
    u64 host_stride;         // bytes between pages
    u64 dev_stride;
    u64 page_bytes;          // bytes of one page in one plane
    int planes;
    int order_first;         // 1: layer-first (l * n + h); 0: layer-page-first (h * n + l)
    u32 order_n;             // pages per layer, or layers
};

struct StepArgs {
    int* mirror;             // [H * L] slot, ABSENT or CLAIMING
    u32* marks;              // [H * L] serial of the step that last read the entry
    u32* filled;             // [H * L] serial of the step that last copied the entry in
    const int* grant;        // [G * 2] (slot, victim entry or -1); st[ST_GRANT_LEN] of them
    int* deferred;           // [G * 2] (grant index, call); call NOT_YET until written
    int* log;                // [st[ST_LOG_CAP] * 5] (grant index, entry, row, page, call);
                             // the host fills each call with NOT_YET at the step's start
    u32* st;                 // cursors and counters (ST_*)
    u32* counts;             // [L * 2] hits, misses
    u64* tok;                // TOK_*
    int call;                // the launch's place in the step, from 1
};

// The step as the kernel uses it: its arguments, and what the host wrote in `st`.
struct Step : StepArgs {
    u32 serial;
    int grant_len;
    int log_capacity;
};

__device__ __forceinline__ bool read_here(const Step& s, int v, int layers, int layer) {
    return ((volatile u32*)s.marks)[v] == s.serial && v % layers == layer;
}

// A slot for a claimed miss: (grant index, slot), or slot -1 when none is left.
__device__ int2 take(Step& s, int layers, int layer) {
    // The grant, in order.
    for (;;) {
        int g = (int)atomicAdd(&s.st[ST_USED], 1u);
        if (g >= s.grant_len) break;
        int slot = s.grant[2 * g], victim = s.grant[2 * g + 1];
        // A victim the mirror no longer names here (it moved or left) is as good as free.
        if (victim >= 0 && ((volatile int*)s.mirror)[victim] == slot) {
            if (read_here(s, victim, layers, layer)) {
                // A cell of this layer reads it (the layer's marks were all set before this
                // launch): passed over, for a later layer. The length first, then the entry,
                // its call last: a reader that finds the call NOT_YET stops there (the entry
                // is this call's anyway).
                const int d = (int)atomicAdd(&s.st[ST_DEF_LEN], 1u);
                s.deferred[2 * d] = g;
                __threadfence();
                atomicExch(&s.deferred[2 * d + 1], s.call);
                continue;
            }
            // No cell of this layer reads it, and no other launch runs meanwhile.
            atomicCAS(&s.mirror[victim], slot, ABSENT);
        }
        return make_int2(g, slot);
    }
    // Victims earlier calls deferred (their layers' cells are done): the cursor moves past an
    // entry only by taking it.
    for (;;) {
        const int d = (int)atomicAdd(&s.st[ST_DEF_AT], 0u);
        if (d >= (int)atomicAdd(&s.st[ST_DEF_LEN], 0u)) break;
        const int call = ((volatile int*)s.deferred)[2 * d + 1];
        if (call == NOT_YET || call >= s.call) break;  // this call's: its cells may read it
        if (atomicCAS(&s.st[ST_DEF_AT], (u32)d, (u32)d + 1u) != (u32)d) continue;
        const int g = s.deferred[2 * d];
        const int slot = s.grant[2 * g], victim = s.grant[2 * g + 1];
        atomicCAS(&s.mirror[victim], slot, ABSENT);
        return make_int2(g, slot);
    }
    // Slots earlier calls filled, oldest first; the same cursor rule. Earlier calls' entries
    // come first in the log (stream order), each with its call written last.
    for (;;) {
        const int i = (int)atomicAdd(&s.st[ST_REFILL_AT], 0u);
        if (i >= s.log_capacity) break;
        const int call = ((volatile int*)s.log)[5 * i + 4];
        if (call == NOT_YET || call >= s.call) break;  // this call's, or not written yet
        if (atomicCAS(&s.st[ST_REFILL_AT], (u32)i, (u32)i + 1u) != (u32)i) continue;
        const int g = s.log[5 * i], e = s.log[5 * i + 1];
        const int slot = s.grant[2 * g];
        if (atomicCAS(&s.mirror[e], slot, ABSENT) == slot) return make_int2(g, slot);
    }
    return make_int2(-1, -1);
}

// Copies `bytes` with the warp, in 16-byte words where both ends allow.
__device__ __forceinline__ void warp_copy(const unsigned char* src, unsigned char* dst, u64 bytes,
                                          u32 lane) {
    if (((reinterpret_cast<u64>(src) | reinterpret_cast<u64>(dst) | bytes) & 15ull) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (u64 i = lane; i < bytes / 16; i += SPARSETIER_WARP) d[i] = s[i];
    } else {
        for (u64 i = lane; i < bytes; i += SPARSETIER_WARP) dst[i] = src[i];
    }
}

// Cell `c`'s (home, page), or home -1 when it names none (no entry, a padding row), -2 when it
// names a page past its request.
__device__ __forceinline__ int2 cell_entry(const int* sel, const int* rows, const int* tables,
                                           const long long* lens, int rows_n, int c, int k,
                                           int pages_per_row, int page_size, int tokens) {
    const int entry = sel[c];
    if (entry < 0 || c / k >= rows_n) return make_int2(-1, -1);
    const int row = rows[c / k];
    const long long first = tokens ? (long long)entry : (long long)entry * page_size;
    if (first >= lens[row]) return make_int2(-2, -1);
    const int page = (int)(first / page_size);
    return make_int2(tables[row * pages_per_row + page], page);
}

// A layer's first launch: marks every object its cells read with the step's serial, and
// writes in each cell of `table` whether it set its object's mark (MARKED_FIRST: that cell
// counts the hit) or not (MARKED), for `sparsetier_resolve`, which overwrites it with the
// cell's slot. The same arguments as `sparsetier_resolve`, so that both are launched (and
// captured) together.
extern "C" __global__ void sparsetier_mark(const int* __restrict__ sel,
                                           const int* __restrict__ rows,
                                           const int* __restrict__ tables,
                                           const long long* __restrict__ lens,
                                           int* __restrict__ table, StepArgs args, Geometry geo,
                                           int cells, int k, int pages_per_row, int layers,
                                           int layer, int page_size, int tokens) {
    (void)geo;
    const u32 serial = ((volatile u32*)args.st)[ST_SERIAL];
    const int rows_n = (int)((volatile u32*)args.st)[ST_ROWS];
    for (int c = (int)(blockIdx.x * blockDim.x + threadIdx.x); c < cells;
         c += (int)(gridDim.x * blockDim.x)) {
        const int2 hp =
            cell_entry(sel, rows, tables, lens, rows_n, c, k, pages_per_row, page_size, tokens);
        int flag = MARKED;
        if (hp.x >= 0) {
            u32* mark = &args.marks[hp.x * layers + layer];
            // (Only this launch writes the serial into the layer's marks: a plain read spares
            // the atomic to the cells of an object already marked, up to a page of tokens.)
            if (*(volatile u32*)mark != serial && atomicExch(mark, serial) != serial) {
                flag = MARKED_FIRST;
            }
        }
        table[c] = flag;
    }
}

extern "C" __global__ void sparsetier_resolve(const int* __restrict__ sel,
                                              const int* __restrict__ rows,
                                              const int* __restrict__ tables,
                                              const long long* __restrict__ lens,
                                              int* __restrict__ table,
                                              StepArgs args, Geometry geo,
                                              int cells, int k, int pages_per_row,
                                              int layers, int layer, int page_size, int tokens) {
    Step s;
    static_cast<StepArgs&>(s) = args;
    s.serial = ((volatile u32*)args.st)[ST_SERIAL];
    s.grant_len = (int)((volatile u32*)args.st)[ST_GRANT_LEN];
    s.log_capacity = (int)((volatile u32*)args.st)[ST_LOG_CAP];
    // Rows past the step's requests (a graph's batch bucket) are padding: no slot, no count.
    const int rows_n = (int)((volatile u32*)args.st)[ST_ROWS];
    const u32 lane = threadIdx.x % SPARSETIER_WARP;
    const int warps = (int)(gridDim.x * blockDim.x / SPARSETIER_WARP);
    for (int c = (int)((blockIdx.x * blockDim.x + threadIdx.x) / SPARSETIER_WARP); c < cells;
         c += warps) {
        // Lane 0 decides: (slot, home to copy from or -1).
        int slot = ABSENT, copy_from = -1, g = -1, e = -1, page = -1, row = -1;
        if (lane == 0) {
            const int2 hp = cell_entry(sel, rows, tables, lens, rows_n, c, k, pages_per_row,
                                       page_size, tokens);
            // Whether this cell set its object's mark (`sparsetier_mark`).
            const bool marked_first = table[c] == MARKED_FIRST;
            if (hp.x == -2) {
                atomicAdd(&s.st[ST_BAD], 1u);
            } else if (hp.x >= 0) {
                const int h = hp.x;
                row = rows[c / k];
                page = hp.y;
                e = h * layers + layer;
                const long long first = tokens ? (long long)sel[c] : (long long)sel[c] * page_size;
                // Selected tokens this entry puts in its page.
                const long long left = lens[row] - first;
                const u64 needed = tokens ? 1ull
                                          : (u64)(left < page_size ? left : page_size);
                atomicAdd(&s.tok[TOK_SELECTED], 1ull);
                atomicAdd(&s.tok[TOK_NEEDED], needed);
                for (;;) {
                    const int m = atomicCAS(&s.mirror[e], ABSENT, CLAIMING);
                    if (m >= 0) {
                        slot = m;
                        __threadfence();  // the slot before `filled` (its copier's order)
                        if (((volatile u32*)s.filled)[e] == s.serial) {
                            // Brought in by this step (its copier counted the miss): its
                            // tokens count as moved. The cell that marked the entry first
                            // may find it so: cells race from the mark to the claim.
                            atomicAdd(&s.tok[TOK_NEEDED_MOVED], needed);
                        } else if (marked_first) {
                            atomicAdd(&s.counts[2 * layer], 1u);
                        }
                        break;
                    }
                    // Another cell of the layer copies it in: wait.
                    if (m == CLAIMING) continue;
                    const int2 t = take(s, layers, layer);
                    if (t.y < 0) {
                        // No slot: the row has no data here (the reference's FAILED).
                        atomicAdd(&s.st[ST_OVERFLOW], 1u);
                        atomicExch(&s.mirror[e], ABSENT);
                        slot = FAILED;
                        break;
                    }
                    g = t.x;
                    slot = t.y;
                    copy_from = h;
                    atomicAdd(&s.tok[TOK_NEEDED_MOVED], needed);
                    break;
                }
            }
        }
        slot = __shfl_sync(0xffffffffu, slot, 0);
        copy_from = __shfl_sync(0xffffffffu, copy_from, 0);
        if (copy_from >= 0) {
            const u32 flat = geo.order_first ? (u32)layer * geo.order_n + (u32)copy_from
                                             : (u32)copy_from * geo.order_n + (u32)layer;
            for (int p = 0; p < geo.planes; ++p) {
                const unsigned char* src = reinterpret_cast<const unsigned char*>(
                    geo.host_planes[p] + (u64)flat * geo.host_stride);
                unsigned char* dst = reinterpret_cast<unsigned char*>(
                    geo.dev_planes[p] + (u64)slot * geo.dev_stride);
                warp_copy(src, dst, geo.page_bytes, lane);
            }
            __syncwarp();
            if (lane == 0) {
                __threadfence();
                const int i = (int)atomicAdd(&s.st[ST_LOG], 1u);
                if (i < s.log_capacity) {
                    int* l = s.log + 5 * i;
                    l[0] = g;
                    l[1] = e;
                    l[2] = row;
                    l[3] = page;
                    __threadfence();
                    atomicExch(&l[4], s.call);  // last: a reader that finds NOT_YET stops
                }
                atomicAdd(&s.counts[2 * layer + 1], 1u);
                atomicExch(&s.filled[e], s.serial);
                __threadfence();
                atomicExch(&s.mirror[e], slot);  // published: waiting cells read it now
            }
        }
        if (lane == 0) table[c] = slot;
    }
}

// Before a step: the core's changes to the mirror since the last step (objects that gave up
// their slot, pages that started, victims granted, duplicates found at reconcile), as
// (entry, slot) pairs, one per entry. A copy of the whole mirror would move 4 bytes an object
// (32 MB at DeepSeek-V3.2's shape) every step.
extern "C" __global__ void sparsetier_mirror_apply(const int* __restrict__ changes, int n,
                                                   int* __restrict__ mirror) {
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n;
         i += (int)(gridDim.x * blockDim.x)) {
        mirror[changes[2 * i]] = changes[2 * i + 1];
    }
}

// After a step: the entries it read (hit or copied in), a bit each (bit e % 32 of word e / 32),
// for the core's second chance, which reads them back instead of the marks (32 times fewer
// bytes). The serial is read from `st`, so this can be captured with the step's launches.
extern "C" __global__ void sparsetier_marks_read(const u32* __restrict__ marks,
                                                 const u32* __restrict__ st, int entries,
                                                 u32* __restrict__ bits) {
    const u32 serial = st[ST_SERIAL];
    const int words = (entries + 31) / 32;
    for (int w = (int)(blockIdx.x * blockDim.x + threadIdx.x); w < words;
         w += (int)(gridDim.x * blockDim.x)) {
        u32 b = 0;
        for (int j = 0; j < 32; ++j) {
            const int e = w * 32 + j;
            if (e < entries && marks[e] == serial) b |= 1u << j;
        }
        bits[w] = b;
    }
}
