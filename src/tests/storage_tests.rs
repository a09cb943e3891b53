//! The L3 tier's plans and states in the core (no store: plans are ended by hand, as a backend
//! would report them). The stores themselves are tested from Python on the real backends.

use crate::radix::{HiCache, WritePolicy};
use crate::soak::{config, Pools, PS};
use crate::transfer::CpuEngine;
use std::sync::Arc;

fn cache(pools: &mut Pools, policy: WritePolicy) -> HiCache {
    let engine = Arc::new(CpuEngine::new(1).unwrap());
    let mut c = HiCache::new(config(), pools.pairs(), Some(engine as _)).unwrap();
    c.enable_storage(policy, "test".into(), 1024, 0.1).unwrap();
    c
}

/// Inserts `tokens` on the device and lands its host backup.
fn insert(c: &mut HiCache, tokens: &[u32]) {
    let pages = c.alloc_device(tokens.len() / PS).unwrap();
    c.insert(0, tokens, &pages).unwrap();
    c.flush().unwrap();
    c.drain().unwrap();
}

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|t| base + t).collect()
}

#[test]
fn write_back_keeps_pages_until_stored_and_gives_up_after_a_failure() {
    let mut pools = Pools::new();
    let mut c = cache(&mut pools, WritePolicy::WriteBack);
    let a = toks(3 * PS, 1);
    insert(&mut c, &a);
    assert!(
        c.take_storage_writes().unwrap().is_empty(),
        "write-back: nothing yet"
    );
    c.evict_device(100);
    assert_eq!(c.evict_host(100).unwrap(), 0, "written first");
    let plans = c.take_storage_writes().unwrap();
    assert_eq!(plans.len(), 1);
    assert_eq!(plans[0].keys, c.storage_keys(0, &a).unwrap());
    assert_eq!(c.evict_host(100).unwrap(), 0, "pinned while written");
    assert!(
        c.take_storage_writes().unwrap().is_empty(),
        "one write per page"
    );
    c.validate().unwrap();
    c.storage_write_done(plans[0].id, &[true, true, true])
        .unwrap();
    assert_eq!(c.evict_host(100).unwrap(), 3);
    c.validate().unwrap();

    // A failed write-back is not tried again: the page leaves on the next eviction.
    let b = toks(2 * PS, 100);
    insert(&mut c, &b);
    c.evict_device(100);
    assert_eq!(c.evict_host(100).unwrap(), 0);
    let p = c.take_storage_writes().unwrap().remove(0);
    assert!(
        c.storage_write_done(p.id, &[true]).is_err(),
        "one flag per page"
    );
    c.storage_write_done(p.id, &[false, false]).unwrap();
    assert_eq!(c.evict_host(100).unwrap(), 2);
    assert!(c.take_storage_writes().unwrap().is_empty());
    let t = c.storage().unwrap().totals();
    assert_eq!((t.pages_written, t.write_failures), (3, 2));
    c.validate().unwrap();
}

#[test]
fn write_through_plans_when_the_host_copy_lands() {
    let mut pools = Pools::new();
    let mut c = cache(&mut pools, WritePolicy::WriteThrough);
    let a = toks(2 * PS, 1);
    insert(&mut c, &a);
    let plans = c.take_storage_writes().unwrap();
    assert_eq!(plans.len(), 1);
    c.storage_write_done(plans[0].id, &[true, true]).unwrap();
    // Inserting the same prefix again plans nothing: the store has it.
    c.evict_device(100);
    let m = c.match_prefix(0, &a);
    c.lock(m.last_node).unwrap();
    assert!(c.take_storage_writes().unwrap().is_empty());
    c.unlock(m.last_node).unwrap();
    assert_eq!(c.evict_host(100).unwrap(), 2, "stored: leaves at once");
    c.validate().unwrap();
}

#[test]
fn a_prefetch_inserts_its_leading_pages_and_frees_the_rest() {
    let mut pools = Pools::new();
    let mut c = cache(&mut pools, WritePolicy::WriteBack);
    let a = toks(5 * PS, 1);
    let p = c.plan_prefetch(0, &a, 0, 5).unwrap().unwrap();
    assert_eq!(p.keys, c.storage_keys(0, &a).unwrap());
    c.validate().unwrap(); // the held pages are accounted
    assert!(c.prefetch_commit(p.id, 2).is_ok());
    assert!(c.prefetch_commit(p.id, 2).is_err(), "once");
    let m = c.match_prefix(0, &a);
    assert_eq!((m.device_len, m.host_len), (0, 2 * PS));
    c.validate().unwrap();
    c.prefetch_end(p.id).unwrap();
    c.validate().unwrap();
    let t = c.storage().unwrap().totals();
    assert_eq!((t.pages_prefetched, t.prefetch_missed), (2, 3));
    // A prefetch after a prefix that left meanwhile places nothing (no gap in the tree).
    let b = toks(4 * PS, 500);
    let q = c.plan_prefetch(0, &b, 2, 2).unwrap().unwrap();
    assert_eq!(c.prefetch_commit(q.id, 2).unwrap(), 0);
    c.prefetch_end(q.id).unwrap();
    assert_eq!(c.storage().unwrap().totals().prefetch_spare, 2);
    assert_eq!(c.match_prefix(0, &b).host_len, 0);
    // Off: no plans.
    c.set_storage_online(false).unwrap();
    assert!(c.plan_prefetch(0, &b, 0, 2).unwrap().is_none());
    assert_eq!(c.storage().unwrap().totals().offline_events, 1);
    c.validate().unwrap();
}
