// sparsetier page copy kernel: moves a list of (src, dst, len) byte ranges, one layer of every
// pool of a PageTransferGroup per launch. Sources may be pinned host memory read over unified
// addressing, so the kernel works for loads (host -> device) and backups (device -> host).
//
// Compiled at first use with NVRTC (no nvcc at build time). Each block takes ops in a strided
// loop; the host side splits large ranges into chunks so the work spreads over the blocks.
// Where source and destination are both 16-byte aligned the block copies with 16-byte vector
// loads and stores, then finishes the tail byte by byte; otherwise it copies byte by byte.

typedef unsigned long long u64;

extern "C" __global__ void sparsetier_copy_ops(const u64* __restrict__ srcs,
                                               const u64* __restrict__ dsts,
                                               const u64* __restrict__ lens,
                                               unsigned int n_ops) {
    for (unsigned int op = blockIdx.x; op < n_ops; op += gridDim.x) {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(srcs[op]);
        unsigned char* d = reinterpret_cast<unsigned char*>(dsts[op]);
        const u64 len = lens[op];
        u64 done = 0;
        if (((reinterpret_cast<u64>(s) | reinterpret_cast<u64>(d)) & 15ull) == 0) {
            const u64 nvec = len >> 4;
            const uint4* s4 = reinterpret_cast<const uint4*>(s);
            uint4* d4 = reinterpret_cast<uint4*>(d);
            for (u64 i = threadIdx.x; i < nvec; i += blockDim.x) {
                d4[i] = s4[i];
            }
            done = nvec << 4;
        }
        for (u64 i = done + threadIdx.x; i < len; i += blockDim.x) {
            d[i] = s[i];
        }
    }
}
