//! Seeded, bounded soak over the whole stack: the prefix cache (tree, both tiers, write-through,
//! load-back) on the cpu engine with random faults (failed and delayed transfers, failed
//! backups), and the residency directory with random resolves, completions, failures, evictions
//! and drops. Afterwards every page on every tier is accounted for, every page a match returns
//! holds the bytes written for that prefix (in KV and Indexer-K), and no pin or transfer is left.
//!
//! `SPARSETIER_SOAK_OPS` sets the operation count (CI: the default, 100k in all; longer runs:
//! `SPARSETIER_SOAK_OPS=5000000 cargo test --release soak`).

use crate::config::HitPolicy;
use crate::directory::{Directory, DirectoryConfig, LayerGroup, ObjectKey};
use crate::error::Error;
use crate::ids::{PageId, TransferId};
use crate::layout::{Component, Dtype, HostLayout};
use crate::pool::PoolSpec;
use crate::radix::{HiCache, HiCacheConfig, PoolPair};
use crate::testing::XorShift;
use crate::transfer::{CpuEngine, Fault, FaultAction, MemoryKind, PageTransferBinding};
use std::sync::Arc;
use std::time::Duration;

fn ops() -> usize {
    std::env::var("SPARSETIER_SOAK_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

pub(crate) const PS: usize = 2;
pub(crate) const DEV: u32 = 24;
pub(crate) const HOST: u32 = 40;

fn pattern(prefix: &[u32], salt: u8) -> u8 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ u64::from(salt);
    for &t in prefix {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    (h >> 24) as u8
}

pub(crate) struct Pools {
    specs: [PoolSpec; 2],
    dev: Vec<Vec<u8>>,
    host: Vec<Vec<u8>>,
}

/// The cache configuration over [`Pools`]: no reserve pages, unbacked pages kept.
pub(crate) fn config() -> HiCacheConfig {
    HiCacheConfig {
        page_size: PS,
        device_pages: DEV,
        device_reserve: 0,
        host_pages: HOST,
        host_reserve: 0,
        drop_unbacked: false,
    }
}

impl Pools {
    pub(crate) fn new() -> Self {
        let kv = PoolSpec::new(Component::Kv, 2, 2, 1, 4, Dtype::Fp8E4m3, PS as u32, DEV).unwrap();
        let ik = PoolSpec::new(
            Component::Indexer,
            2,
            1,
            1,
            4,
            Dtype::Fp8E4m3,
            PS as u32,
            DEV,
        )
        .unwrap();
        let host_kv = kv.with_pages(HOST).unwrap();
        let host_ik = ik.with_pages(HOST).unwrap();
        Pools {
            specs: [kv, ik],
            dev: vec![
                vec![0; kv.total_bytes() as usize],
                vec![0; ik.total_bytes() as usize],
            ],
            host: vec![
                vec![0; host_kv.total_bytes() as usize],
                vec![0; host_ik.total_bytes() as usize],
            ],
        }
    }

    pub(crate) fn pairs(&mut self) -> Vec<PoolPair> {
        (0..2)
            .map(|i| {
                let (d, h) = (&mut self.dev[i], &mut self.host[i]);
                let s = self.specs[i];
                // SAFETY: the buffers live in `self`, which outlives the cache (dropped after
                // it is drained), and only the engine writes them while transfers run.
                unsafe {
                    PoolPair {
                        device: Some(
                            PageTransferBinding::new(
                                d.as_mut_ptr() as u64,
                                d.len() as u64,
                                &s,
                                HostLayout::LayerFirst,
                                MemoryKind::Host,
                            )
                            .unwrap(),
                        ),
                        host: PageTransferBinding::new(
                            h.as_mut_ptr() as u64,
                            h.len() as u64,
                            &s.with_pages(HOST).unwrap(),
                            HostLayout::LayerPageFirst,
                            MemoryKind::Host,
                        )
                        .unwrap(),
                        hit: HitPolicy::AllPages,
                    }
                }
            })
            .collect()
    }

    /// Writes the pattern of each page's prefix into every plane and layer of the page.
    fn write(&mut self, seq: &[u32], first: usize, pages: &[PageId]) {
        for (i, p) in pages.iter().enumerate() {
            let end = (first + i + 1) * PS;
            for c in 0..2 {
                let g = self.specs[c].geometry(HostLayout::LayerFirst);
                let v = pattern(&seq[..end], c as u8);
                for plane in 0..g.planes {
                    for layer in 0..g.layers {
                        let o = g.page_offset(plane, layer, u64::from(p.raw())).unwrap() as usize;
                        self.dev[c][o..o + g.page_bytes() as usize].fill(v);
                    }
                }
            }
        }
    }

    fn check(&self, seq: &[u32], pages: &[PageId]) {
        for (i, p) in pages.iter().enumerate() {
            for c in 0..2 {
                let g = self.specs[c].geometry(HostLayout::LayerFirst);
                let want = pattern(&seq[..(i + 1) * PS], c as u8);
                for plane in 0..g.planes {
                    for layer in 0..g.layers {
                        let o = g.page_offset(plane, layer, u64::from(p.raw())).unwrap() as usize;
                        let page = &self.dev[c][o..o + g.page_bytes() as usize];
                        assert!(
                            page.iter().all(|&b| b == want),
                            "pool {c} page {p} of prefix {i} corrupt"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn soak_prefix_cache_with_faults() {
    let mut pools = Pools::new();
    let engine = Arc::new(CpuEngine::new(2).unwrap());
    let mut cache = HiCache::new(
        config(),
        pools.pairs(),
        Some(engine.clone() as Arc<dyn crate::transfer::CopyEngine>),
    )
    .unwrap();
    let mut rng = XorShift::new(0x50A6);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|p| (0..2 * PS as u32 + p).map(|t| 100 * p + t + 1).collect())
        .collect();
    let mut locks: Vec<crate::radix::NodeId> = Vec::new();
    let mut submitted = 0u64;
    let n = ops() / 2;
    for step in 0..n {
        match rng.below(10) {
            0..=2 => {
                let mut seq = prompts[rng.below(4) as usize].clone();
                seq.extend((0..rng.below(3 * PS as u64)).map(|_| 1 + rng.below(3) as u32));
                seq.truncate(seq.len() / PS * PS);
                let m = cache.match_prefix(0, &seq);
                pools.check(&seq, &m.device_pages);
                cache.lock(m.device_node).unwrap();
                let have = m.device_len / PS;
                match cache.alloc_device(seq.len() / PS - have) {
                    Ok(new) => {
                        pools.write(&seq, have, &new);
                        let mut pages = m.device_pages.clone();
                        pages.extend(new);
                        cache.insert(0, &seq, &pages).unwrap();
                    }
                    Err(Error::OutOfPages { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
                cache.unlock(m.device_node).unwrap();
            }
            3 => {
                let seq = &prompts[rng.below(4) as usize];
                let m = cache.match_prefix(0, seq);
                pools.check(seq, &m.device_pages);
                if m.host_len > 0 {
                    if rng.below(4) == 0 {
                        let action = if rng.below(2) == 0 {
                            FaultAction::Fail("soak".into())
                        } else {
                            FaultAction::Delay(Duration::from_micros(200))
                        };
                        engine.inject(Fault {
                            nth: submitted,
                            layer: Some(rng.below(2) as usize),
                            action,
                        });
                    }
                    cache.load_back(m.last_node).unwrap();
                }
            }
            4 => {
                if rng.below(5) == 0 {
                    engine.inject(Fault {
                        nth: submitted,
                        layer: None,
                        action: FaultAction::Fail("backup".into()),
                    });
                }
                submitted += cache.flush().unwrap().len() as u64;
            }
            5 => {
                cache.poll().unwrap();
            }
            6 => {
                cache.evict_device(rng.below(6) as usize);
            }
            7 => {
                cache.evict_host(rng.below(6) as usize).unwrap();
            }
            8 => {
                let seq = &prompts[rng.below(4) as usize];
                let m = cache.match_prefix(0, seq);
                cache.lock(m.last_node).unwrap();
                locks.push(m.last_node);
            }
            _ => {
                if !locks.is_empty() {
                    let i = rng.below(locks.len() as u64) as usize;
                    cache.unlock(locks.swap_remove(i)).unwrap();
                }
            }
        }
        if step % 97 == 0 {
            cache.validate().unwrap();
        }
    }
    submitted += cache.flush().unwrap().len() as u64;
    cache.drain().unwrap();
    for l in locks.drain(..) {
        cache.unlock(l).unwrap();
    }
    cache.validate().unwrap();
    assert_eq!((cache.in_flight(), cache.outstanding()), (0, 0));
    for p in &prompts {
        let m = cache.match_prefix(0, p);
        pools.check(p, &m.device_pages);
    }
    assert!(
        cache.totals().failed_transfers > 0 && submitted > 0,
        "faults were exercised"
    );
    drop(cache);
    drop(pools);
}

#[test]
fn soak_directory_with_faults() {
    let d = Directory::new(DirectoryConfig {
        device_pages: 16,
        device_reserve: 0,
        host_pages: 48,
        host_reserve: 0,
        object_bytes: 64,
    })
    .unwrap();
    let mut rng = XorShift::new(0xD1CE);
    let key = |ns: u64, p: u64| ObjectKey::new(ns, 0, p as u32, LayerGroup::Layer(0));
    let mut handles = Vec::new();
    let mut inflight: Vec<TransferId> = Vec::new();
    let mut quarantined: Vec<TransferId> = Vec::new();
    let mut ns_live: Vec<u64> = vec![0, 1, 2];
    let mut next_ns = 3;
    for step in 0..ops() / 2 {
        let ns = ns_live[rng.below(ns_live.len() as u64) as usize];
        match rng.below(9) {
            0 => {
                let _ = d.allocate(&[key(ns, rng.below(12))]);
            }
            1 => {
                let keys: Vec<_> = (0..1 + rng.below(4))
                    .map(|_| key(ns, rng.below(12)))
                    .collect();
                if let Ok(p) = d.backup(&keys) {
                    if let Some(t) = p.transfer {
                        if rng.below(6) == 0 {
                            d.fail(t, "soak", true).unwrap()
                        } else {
                            d.backup_complete(t).unwrap()
                        }
                    }
                }
            }
            2 | 3 => {
                let keys: Vec<_> = (0..1 + rng.below(4))
                    .map(|_| key(ns, rng.below(12)))
                    .collect();
                if let Ok(r) = d.resolve(&keys, None) {
                    inflight.extend(r.loads.iter().map(|l| l.transfer));
                    handles.push(r.handle);
                }
            }
            4 => {
                if let Some(t) = inflight.pop() {
                    if rng.below(5) == 0 {
                        let _ = d.fail(t, "soak", false).map(|_| quarantined.push(t));
                    } else {
                        let _ = d.complete(t);
                    }
                }
            }
            5 => {
                if let Some(t) = quarantined.pop() {
                    d.transfer_ended(t).unwrap();
                    assert!(
                        d.transfer_ended(t).is_err(),
                        "a quarantined slot returns exactly once"
                    );
                }
            }
            6 => {
                if !handles.is_empty() {
                    let h = handles.swap_remove(rng.below(handles.len() as u64) as usize);
                    d.release(h).unwrap();
                }
            }
            7 => {
                d.evict(rng.below(4) as usize);
            }
            _ => {
                if rng.below(20) == 0 {
                    let i = rng.below(ns_live.len() as u64) as usize;
                    let gone = ns_live.swap_remove(i);
                    d.drop_namespace(crate::directory::Namespace {
                        id: gone,
                        version: 0,
                    })
                    .unwrap();
                    ns_live.push(next_ns);
                    next_ns += 1;
                }
            }
        }
        if step % 101 == 0 {
            d.validate().unwrap();
        }
    }
    for t in inflight.drain(..) {
        let _ = d.complete(t);
    }
    for h in handles.drain(..) {
        d.release(h).unwrap();
    }
    for t in quarantined.drain(..) {
        d.transfer_ended(t).unwrap();
    }
    d.validate().unwrap();
    let s = d.stats();
    assert_eq!(
        (
            s.pins,
            s.handles,
            s.transfers_in_flight,
            s.device_quarantined
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(s.device_free + s.device_used, s.device_capacity);
    assert_eq!(
        s.host_free + s.host_used + s.host_quarantined,
        s.host_capacity
    );
}
