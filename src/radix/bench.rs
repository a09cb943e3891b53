//! The serve loop of the prefix-cache benchmark, in Rust alone (criterion, and
//! `sparsetier bench prefix` for the binding's overhead). It is the peers' phase 5: a device
//! pool holding a fraction of the cached tokens; each request matches, locks its match,
//! allocates (evicting on demand), inserts, re-locks its full path, and `inflight` requests
//! stay locked.

use super::{HiCache, HiCacheConfig};
use crate::error::Result;
use crate::ids::PageId;
use std::collections::VecDeque;
use std::time::Instant;

/// What a serve loop measured.
#[derive(Debug, Clone, Default)]
pub struct ServeStats {
    /// Nanoseconds per request.
    pub lat_ns: Vec<u64>,
    /// Tokens served from the device.
    pub hit_tokens: u64,
    /// Tokens requested.
    pub total_tokens: u64,
    /// Requests whose allocation failed (everything else locked).
    pub failed: u64,
}

fn device_only(page_size: usize, pages: u32) -> Result<HiCache> {
    HiCache::new(
        HiCacheConfig {
            page_size,
            device_pages: pages,
            device_reserve: 0,
            host_pages: 0,
            host_reserve: 0,
            drop_unbacked: true,
        },
        Vec::new(),
        None,
    )
}

/// Inserts every sequence into an unbounded device-only cache; returns the cached tokens.
pub fn fill(seqs: &[Vec<u32>], page_size: usize) -> Result<usize> {
    let total: usize = seqs.iter().map(|s| s.len() / page_size).sum();
    let mut c = device_only(page_size, (total + 1) as u32)?;
    for s in seqs {
        let m = c.match_prefix(0, s);
        let need = s.len() / page_size - m.device_len / page_size;
        let mut pages = m.device_pages;
        pages.extend(c.alloc_device(need)?);
        c.insert(0, s, &pages)?;
    }
    Ok(c.tree().device_pages() * page_size)
}

/// Runs the serve loop over `seqs` with a pool of `capacity_pages`.
pub fn serve(
    seqs: &[Vec<u32>],
    page_size: usize,
    capacity_pages: u32,
    inflight: usize,
) -> Result<ServeStats> {
    let mut c = device_only(page_size, capacity_pages)?;
    let mut held = VecDeque::new();
    let mut st = ServeStats {
        lat_ns: Vec::with_capacity(seqs.len()),
        ..Default::default()
    };
    let mut pages: Vec<PageId> = Vec::new();
    for s in seqs {
        let t = Instant::now();
        let m = c.match_prefix(0, s);
        c.lock(m.device_node)?;
        let need = s.len() / page_size - m.device_len / page_size;
        match c.alloc_device(need) {
            Ok(new) => {
                pages.clear();
                pages.extend_from_slice(&m.device_pages);
                pages.extend(new);
                let r = c.insert(0, s, &pages)?;
                c.lock(r.last_node)?;
                c.unlock(m.device_node)?;
                held.push_back(r.last_node);
                if held.len() > inflight {
                    c.unlock(held.pop_front().expect("non-empty"))?;
                }
                st.hit_tokens += m.device_len as u64;
                st.total_tokens += s.len() as u64;
            }
            Err(_) => {
                c.unlock(m.device_node)?;
                st.failed += 1;
            }
        }
        st.lat_ns.push(t.elapsed().as_nanos() as u64);
    }
    Ok(st)
}
