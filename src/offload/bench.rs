//! The request stream of `sparsetier bench vllm`, in Rust: what the criterion bench
//! (`benches/offload.rs`) times, the directory alone, without Python.
//!
//! Each request is `blocks` keys (32-byte hashes and group 0) that begin with one of
//! `prefixes` shared prefixes of `prefix_blocks` keys, drawn with Zipf popularity, and go on
//! with keys of their own; the pool holds `pool_requests` requests' worth of chunks, so stores
//! evict. A request makes the calls vLLM's connector makes: lookups head first to the first
//! miss, a load of the hits, stores of the rest in steps of `step` keys (each completed a step
//! later), and its end.

use super::{ChunkDirectory, DirectoryConfig, Lookup, PolicyKind, RequestRef};
use std::time::{Duration, Instant};

/// The stream's shape.
#[derive(Debug, Clone, Copy)]
pub struct StreamShape {
    /// Keys per request.
    pub blocks: usize,
    /// Keys of the shared prefix.
    pub prefix_blocks: usize,
    /// Distinct prefixes.
    pub prefixes: usize,
    /// Zipf exponent of the prefixes' popularity.
    pub zipf: f64,
    /// Pool size, in requests.
    pub pool_requests: f64,
    /// Keys offered per store.
    pub step: usize,
}

impl Default for StreamShape {
    fn default() -> Self {
        StreamShape {
            blocks: 4096,
            prefix_blocks: 3000,
            prefixes: 16,
            zipf: 1.1,
            pool_requests: 6.0,
            step: 128,
        }
    }
}

/// Time spent by phase over the timed requests.
#[derive(Debug, Clone, Copy, Default)]
pub struct PhaseTimes {
    /// Lookups.
    pub lookup: Duration,
    /// Load and its completion.
    pub load: Duration,
    /// Stores, their completions and the request's end.
    pub store: Duration,
}

/// A directory and a request stream over it.
pub struct RequestStream {
    dir: ChunkDirectory,
    requests: Vec<Vec<Vec<u8>>>,
    next: usize,
    shape: StreamShape,
}

fn key(text: &str) -> Vec<u8> {
    let mut k = blake3::hash(text.as_bytes()).as_bytes().to_vec();
    k.extend_from_slice(&0u32.to_be_bytes());
    k
}

impl RequestStream {
    /// `n` requests of `shape` (seeded), over an empty directory.
    pub fn new(shape: StreamShape, n: usize, policy: PolicyKind) -> Self {
        let weights: Vec<f64> = (1..=shape.prefixes)
            .map(|r| (r as f64).powf(-shape.zipf))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut requests = Vec::with_capacity(n);
        for i in 0..n {
            // splitmix64: a fixed stream without a rand dependency.
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let u = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 * total;
            let mut acc = 0.0;
            let p = weights
                .iter()
                .position(|w| {
                    acc += w;
                    u < acc
                })
                .unwrap_or(shape.prefixes - 1);
            let mut keys: Vec<Vec<u8>> = (0..shape.prefix_blocks)
                .map(|b| key(&format!("p{p}:{b}")))
                .collect();
            keys.extend((shape.prefix_blocks..shape.blocks).map(|b| key(&format!("r{i}:{b}"))));
            requests.push(keys);
        }
        let dir = ChunkDirectory::new(DirectoryConfig {
            num_chunks: (shape.pool_requests * shape.blocks as f64) as u32,
            policy,
            store_threshold: 0,
            max_tracker_size: 64_000,
            events: false,
        });
        RequestStream {
            dir,
            requests,
            next: 0,
            shape,
        }
    }

    /// Serves the same requests again from the start, over an empty directory.
    pub fn restart(&mut self) {
        self.dir.reset();
        self.next = 0;
    }

    /// Requests left.
    pub fn left(&self) -> usize {
        self.requests.len() - self.next
    }

    /// Runs the next request; its time by phase.
    pub fn serve(&mut self) -> PhaseTimes {
        let keys = &self.requests[self.next];
        self.next += 1;
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let positions: Vec<Option<i64>> = (1..=refs.len() as i64).map(|i| Some(i * 16)).collect();
        let d = &mut self.dir;
        let t0 = Instant::now();
        let r: RequestRef = d.request(None);
        let hits = refs
            .iter()
            .take_while(|k| d.lookup(k) == Lookup::Hit)
            .count();
        let t1 = Instant::now();
        if hits > 0 {
            d.prepare_load(Some(r), &refs[..hits], &positions[..hits])
                .expect("hits are ready");
            d.complete_load(&refs[..hits]).expect("pinned");
        }
        let t2 = Instant::now();
        let mut pending: Vec<&[u8]> = Vec::new();
        for lo in (hits..refs.len()).step_by(self.shape.step) {
            let hi = (lo + self.shape.step).min(refs.len());
            let (_, out) = d
                .prepare_store(Some(r), &refs[lo..hi], &positions[lo..hi])
                .expect("distinct keys");
            d.complete_store(&pending, true);
            pending = out.map_or_else(Vec::new, |o| {
                o.stored.iter().map(|&i| refs[lo + i]).collect()
            });
        }
        d.complete_store(&pending, true);
        d.finish_request(r, &[]);
        d.release_request(r);
        let t3 = Instant::now();
        PhaseTimes {
            lookup: t1 - t0,
            load: t2 - t1,
            store: t3 - t2,
        }
    }

    /// The directory.
    pub fn directory(&self) -> &ChunkDirectory {
        &self.dir
    }
}
