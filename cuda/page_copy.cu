// sparsetier page copy kernel: moves a list of (src, dst, len) byte ranges, one layer of every
// pool of a PageTransferGroup per launch. Sources may be pinned host memory read over unified
// addressing, so the kernel works for loads (host -> device) and backups (device -> host).
//
// Compiled at first use with NVRTC (no nvcc at build time). Each op is copied by a group of
// `lanes` threads (a power of two from 4 to the block size, chosen per launch from the op
// length), and the groups take ops in a strided loop: a block-wide group per op left most of
// a block idle on token rows of 64-256 bytes, and the copies latency-bound on the link. The
// host side splits large ranges into chunks so the work spreads over the groups.
// Each op is copied with the widest word both ends are aligned to (16, 8 or 4 bytes), then
// its tail with 4-byte words where aligned, and only the last < 4 bytes (or a range aligned
// to nothing) byte by byte. Packed token rows that are not multiples of 16 bytes (DeepSeek-V3.2's
// 132-byte Indexer-K rows start 4-byte aligned; its 656-byte KV rows 16-byte aligned) thus move
// in words, not bytes.

typedef unsigned long long u64;

template <typename W>
__device__ __forceinline__ u64 copy_words(const unsigned char* s, unsigned char* d, u64 len,
                                          unsigned int lane, unsigned int lanes) {
    const u64 n = len / sizeof(W);
    const W* sw = reinterpret_cast<const W*>(s);
    W* dw = reinterpret_cast<W*>(d);
    for (u64 i = lane; i < n; i += lanes) {
        dw[i] = sw[i];
    }
    return n * sizeof(W);
}

extern "C" __global__ void sparsetier_copy_ops(const u64* __restrict__ srcs,
                                               const u64* __restrict__ dsts,
                                               const u64* __restrict__ lens,
                                               unsigned int n_ops,
                                               unsigned int lanes) {
    // No shared memory and no barrier: a group is just a run of `lanes` thread ids.
    const unsigned int lane = threadIdx.x & (lanes - 1);
    const unsigned int group = (blockIdx.x * blockDim.x + threadIdx.x) / lanes;
    const unsigned int groups = gridDim.x * (blockDim.x / lanes);
    for (unsigned int op = group; op < n_ops; op += groups) {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(srcs[op]);
        unsigned char* d = reinterpret_cast<unsigned char*>(dsts[op]);
        const u64 len = lens[op];
        const u64 align = reinterpret_cast<u64>(s) | reinterpret_cast<u64>(d);
        u64 done = 0;
        if ((align & 15ull) == 0) {
            done = copy_words<uint4>(s, d, len, lane, lanes);
        } else if ((align & 7ull) == 0) {
            done = copy_words<u64>(s, d, len, lane, lanes);
        }
        if ((align & 3ull) == 0) {
            // The tail of a wider copy starts aligned too (done is a multiple of 16 or 8).
            done += copy_words<unsigned int>(s + done, d + done, len - done, lane, lanes);
        }
        for (u64 i = done + lane; i < len; i += lanes) {
            d[i] = s[i];
        }
    }
}
