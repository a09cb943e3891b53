//! The source's worked examples and the directory's edge cases, in Rust.

use super::*;
use crate::ids::SlotId;
use std::sync::Arc;

const KIB: u64 = 1024;

fn dir(device: u32, host: u32) -> Directory {
    Directory::new(DirectoryConfig {
        device_pages: device,
        device_reserve: 0,
        host_pages: host,
        host_reserve: 0,
        object_bytes: 64 * KIB,
    })
    .unwrap()
}

fn key(page: u32) -> ObjectKey {
    ObjectKey::new(7, 0, page, LayerGroup::Layer(3))
}

/// Allocates `pages`, backs them up, completes the backup and evicts them: host-only objects.
/// One page at a time, so it works on a device with a single free slot.
fn host_only(d: &Directory, pages: &[u32]) {
    for &p in pages {
        d.allocate(&[key(p)]).unwrap();
        let plan = d.backup(&[key(p)]).unwrap();
        d.backup_complete(plan.transfer.unwrap()).unwrap();
        assert_eq!(d.evict(1), vec![key(p)]);
    }
}

#[test]
fn blocks_17_42_81_pin_load_and_join() {
    let d = dir(16, 16);
    d.allocate(&[key(17)]).unwrap();
    host_only(&d, &[42, 81]);
    // Someone else starts loading 81.
    let first = d.resolve(&[key(81)], None).unwrap();
    let load81 = first.loads[0].transfer;
    // The selection {17, 42, 81}.
    let r = d.resolve(&[key(17), key(42), key(81)], None).unwrap();
    assert_eq!(r.metrics.ready, 1, "17 is Ready: pin and read");
    assert_eq!(r.metrics.absent, 1, "42 is host-only: allocate and load");
    assert_eq!(
        r.metrics.loading, 1,
        "81 is Loading: join the transfer in flight"
    );
    assert_eq!(r.metrics.inflight_reuse, 1);
    assert_eq!(r.joined.as_slice(), &[load81]);
    assert_eq!(r.loads.len(), 1);
    assert_eq!(r.loads[0].device_slots, vec![r.slots[1]]);
    assert_eq!(
        r.slots[2], first.slots[0],
        "81 is read from the slot its load targets"
    );
    assert!(matches!(
        d.state(&key(42)).unwrap().device,
        DeviceState::Loading { .. }
    ));
    d.complete(load81).unwrap();
    d.complete(r.loads[0].transfer).unwrap();
    d.wait(load81, None).unwrap();
    let m = d.release(r.handle).unwrap();
    assert!(m.ready_ns.is_some() && m.consumed_ns.is_some());
    d.release(first.handle).unwrap();
    assert_eq!(
        d.release(first.handle),
        Err(Error::UnknownHandle {
            id: first.handle.raw()
        })
    );
    d.validate().unwrap();
}

#[test]
fn seven_of_ten_resident_restore_192_kib() {
    let d = dir(32, 32);
    host_only(&d, &[0, 1, 2]);
    d.allocate(&(3..10).map(key).collect::<Vec<_>>()).unwrap();
    let r = d
        .resolve(&(0..10).map(key).collect::<Vec<_>>(), None)
        .unwrap();
    assert_eq!(r.metrics.ready, 7);
    assert_eq!(r.metrics.bytes_transferred, 192 * KIB);
    assert!((r.metrics.device_byte_hit_rate() - 0.7).abs() < 1e-12);
    d.validate().unwrap();
}

#[test]
fn scattered_tokens_read_amplification_64() {
    let d = dir(32, 32);
    host_only(&d, &(0..10).collect::<Vec<_>>());
    // 10 tokens of 1 KiB in 10 different 64-token pages of 64 KiB.
    let positions: Vec<u64> = (0..10).map(|p| p * 64 + 9).collect();
    let tp = token_pages(&positions, 64, KIB).unwrap();
    let keys: Vec<_> = tp.pages.iter().map(|&p| key(p)).collect();
    let r = d.resolve(&keys, Some(tp.bytes_needed)).unwrap();
    assert_eq!(r.metrics.bytes_needed, 10 * KIB);
    assert_eq!(r.metrics.bytes_transferred, 640 * KIB);
    assert_eq!(r.metrics.moved_per_needed(), 64.0); // every selected page moved
}

#[test]
fn repeated_keys_count_once_and_get_the_same_slot() {
    let d = dir(8, 8);
    host_only(&d, &[1]);
    let r = d.resolve(&[key(1), key(1), key(1)], None).unwrap();
    assert_eq!(r.metrics.selected, 3);
    assert_eq!(r.metrics.distinct, 1);
    assert_eq!(r.loads[0].device_slots.len(), 1);
    assert!(r.slots.iter().all(|&s| s == r.slots[0]));
    assert_eq!(d.state(&key(1)).unwrap().pins, 1);
}

#[test]
fn not_resident_and_out_of_slots_change_nothing() {
    let d = dir(2, 8);
    d.allocate(&[key(0)]).unwrap(); // Ready, no host copy: not evictable
    host_only(&d, &[5, 6]);
    let before = d.stats();
    assert!(matches!(
        d.resolve(&[key(5), key(99)], None),
        Err(Error::NotResident { .. })
    ));
    // 5 and 6 need two slots; one is free, and object 0 is not evictable.
    assert_eq!(
        d.resolve(&[key(5), key(6)], None).unwrap_err(),
        Error::OutOfSlots {
            tier: "device",
            requested: 2,
            free: 1,
            evictable: 0
        }
    );
    let after = d.stats();
    assert_eq!(
        (before.device_free, before.pins),
        (after.device_free, after.pins)
    );
    assert_eq!(after.totals.resolves, 0);
    d.validate().unwrap();
}

#[test]
fn eviction_takes_lru_and_never_a_pinned_or_batch_object() {
    let d = dir(2, 8);
    host_only(&d, &[0, 1, 2]);
    let a = d.resolve(&[key(0)], None).unwrap();
    d.complete(a.loads[0].transfer).unwrap();
    let b = d.resolve(&[key(1)], None).unwrap();
    d.complete(b.loads[0].transfer).unwrap();
    d.release(b.handle).unwrap(); // 1 is evictable, 0 pinned
    let c = d.resolve(&[key(2)], None).unwrap();
    assert_eq!(c.slots[0], b.slots[0], "2 takes the slot of evicted 1");
    assert!(matches!(
        d.state(&key(0)).unwrap().device,
        DeviceState::Ready { .. }
    ));
    assert!(matches!(
        d.state(&key(1)).unwrap().device,
        DeviceState::Absent
    ));
    // A batch of a Ready evictable object and an absent one must not evict its own member.
    d.complete(c.loads[0].transfer).unwrap();
    d.release(c.handle).unwrap();
    d.release(a.handle).unwrap();
    let r = d.resolve(&[key(0), key(1)], None).unwrap();
    assert!(matches!(
        d.state(&key(0)).unwrap().device,
        DeviceState::Ready { .. }
    ));
    assert!(matches!(
        d.state(&key(2)).unwrap().device,
        DeviceState::Absent
    ));
    assert_ne!(r.slots[0], r.slots[1]);
    d.validate().unwrap();
}

#[test]
fn failed_load_quarantines_until_ended_then_retry_succeeds() {
    let d = dir(4, 4);
    host_only(&d, &[1, 2]);
    let r = d.resolve(&[key(1), key(2)], None).unwrap();
    let t = r.loads[0].transfer;
    d.fail(t, "injected", false).unwrap();
    assert_eq!(
        d.wait(t, None),
        Err(Error::TransferFailed {
            id: t.raw(),
            reason: "injected".into()
        })
    );
    let s = d.stats();
    assert_eq!((s.device_quarantined, s.device_free), (2, 2));
    assert!(matches!(
        d.state(&key(1)).unwrap().device,
        DeviceState::Absent
    ));
    d.validate().unwrap();
    assert!(matches!(d.complete(t), Err(Error::TransferState { .. })));
    d.transfer_ended(t).unwrap();
    assert!(
        d.transfer_ended(t).is_err(),
        "a quarantined slot returns exactly once"
    );
    assert_eq!(d.stats().device_free, 4);
    d.release(r.handle).unwrap();
    assert!(matches!(d.complete(t), Err(Error::UnknownTransfer { .. })));
    let retry = d.resolve(&[key(1), key(2)], None).unwrap();
    d.complete(retry.loads[0].transfer).unwrap();
    assert_eq!(d.stats().totals.retries, 2);
    d.validate().unwrap();
}

#[test]
fn dropped_namespace_waits_for_pins_and_transfers() {
    let d = dir(4, 4);
    host_only(&d, &[1]);
    d.allocate(&[key(2)]).unwrap();
    let r = d.resolve(&[key(1), key(2)], None).unwrap();
    assert_eq!(d.drop_namespace(key(1).namespace).unwrap(), (0, 2));
    assert!(matches!(
        d.resolve(&[key(1)], None),
        Err(Error::NamespaceDropped { .. })
    ));
    assert!(matches!(
        d.allocate(&[key(9)]),
        Err(Error::NamespaceDropped { .. })
    ));
    assert!(d.drop_namespace(key(1).namespace).is_err());
    d.validate().unwrap();
    d.complete(r.loads[0].transfer).unwrap();
    d.release(r.handle).unwrap();
    let s = d.stats();
    assert_eq!((s.objects, s.device_free, s.host_free), (0, 4, 4));
    d.validate().unwrap();
}

#[test]
fn backup_rules() {
    let d = dir(4, 1);
    d.allocate(&[key(0), key(1)]).unwrap();
    let p = d.backup(&[key(0), key(0)]).unwrap();
    assert_eq!(p.host_slots.len(), 1);
    assert!(
        d.backup(&[key(0)]).unwrap().transfer.is_none(),
        "already writing: skipped"
    );
    assert!(matches!(
        d.backup(&[key(1)]),
        Err(Error::OutOfSlots { tier: "host", .. })
    ));
    assert!(
        d.evict(1).is_empty(),
        "host copy not Ready yet: not evictable"
    );
    assert!(matches!(
        d.complete(p.transfer.unwrap()),
        Err(Error::TransferState { .. })
    ));
    d.fail(p.transfer.unwrap(), "disk on fire", true).unwrap();
    assert_eq!(d.stats().host_free, 1);
    let p = d.backup(&[key(0)]).unwrap();
    d.backup_complete(p.transfer.unwrap()).unwrap();
    assert_eq!(d.evict(5), vec![key(0)]);
    assert!(matches!(
        d.backup(&[key(0)]),
        Err(Error::InvalidTransition { .. })
    ));
    d.validate().unwrap();
}

#[test]
fn guard_releases_on_drop() {
    let d = dir(4, 4);
    d.allocate(&[key(0)]).unwrap();
    {
        let (_r, _g) = d.resolve_guarded(&[key(0)]).unwrap();
        assert_eq!(d.state(&key(0)).unwrap().pins, 1);
    }
    assert_eq!(d.state(&key(0)).unwrap().pins, 0);
}

#[test]
fn wait_times_out_and_wakes_on_complete() {
    let d = Arc::new(dir(4, 4));
    host_only(&d, &[0]);
    let r = d.resolve(&[key(0)], None).unwrap();
    let t = r.loads[0].transfer;
    assert!(matches!(
        d.wait(t, Some(std::time::Duration::from_millis(5))),
        Err(Error::WaitTimeout { .. })
    ));
    let d2 = Arc::clone(&d);
    let waiter = std::thread::spawn(move || d2.wait(t, None));
    std::thread::sleep(std::time::Duration::from_millis(20));
    d.complete(t).unwrap();
    waiter.join().unwrap().unwrap();
}

#[test]
fn hammered_from_threads_keeps_every_invariant() {
    const THREADS: u32 = 6;
    let d = Arc::new(dir(24, 256));
    host_only(&d, &(0..64).collect::<Vec<_>>());
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || {
                let mut rng = t.wrapping_mul(2_654_435_761).wrapping_add(1);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 17;
                    rng ^= rng << 5;
                    rng
                };
                for _ in 0..2000 {
                    let keys: Vec<_> = (0..1 + next() % 6).map(|_| key(next() % 64)).collect();
                    match d.resolve(&keys, None) {
                        Ok(r) => {
                            for lp in &r.loads {
                                if next() % 7 == 0 {
                                    let _ = d.fail(lp.transfer, "stress", next() % 2 == 0);
                                } else {
                                    let _ = d.complete(lp.transfer);
                                }
                            }
                            for t in &r.joined {
                                let _ = d.wait(*t, Some(std::time::Duration::from_millis(50)));
                            }
                            if next() % 5 == 0 {
                                d.evict(2);
                            }
                            d.release(r.handle).unwrap();
                        }
                        Err(Error::OutOfSlots { .. }) => {}
                        Err(e) => panic!("unexpected {e}"),
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    d.validate().unwrap();
    let s = d.stats();
    assert_eq!((s.pins, s.handles), (0, 0));
    // Failed transfers whose engine never reported an end keep their slots quarantined.
    assert_eq!(
        s.device_free + s.device_used + s.device_quarantined,
        s.device_capacity
    );
    let _ = SlotId::new(0);
}

#[test]
fn dropped_namespaces_are_remembered_boundedly() {
    // A long-running server drops one namespace per request: the directory remembers the
    // most recent ones (late keys are NamespaceDropped) and forgets the oldest.
    use crate::directory::core::{Core, DROPPED_REMEMBERED};
    let mut c = Core::new(DirectoryConfig {
        device_pages: 4,
        device_reserve: 0,
        host_pages: 4,
        host_reserve: 0,
        object_bytes: 64,
    })
    .unwrap();
    let n = DROPPED_REMEMBERED as u64 + 5000;
    // One namespace still pinned while the others come and go: it must not be forgotten.
    let pinned = ObjectKey::new(0, 0, 0, LayerGroup::Layer(0));
    c.allocate(&[pinned]).unwrap();
    let h = c.resolve(&[pinned], None).unwrap().handle;
    c.drop_namespace(pinned.namespace).unwrap();
    for id in 1..n {
        let k = ObjectKey::new(id, 0, 0, LayerGroup::Layer(0));
        c.allocate(&[k]).unwrap();
        c.drop_namespace(k.namespace).unwrap();
    }
    assert!(c.dropped_remembered() <= DROPPED_REMEMBERED + 1);
    c.validate().unwrap();
    let recent = ObjectKey::new(n - 1, 0, 0, LayerGroup::Layer(0));
    assert!(matches!(
        c.resolve(&[recent], None),
        Err(Error::NamespaceDropped { .. })
    ));
    // The oldest unpinned one is forgotten: a new namespace of that id may start again.
    let old = ObjectKey::new(1, 0, 0, LayerGroup::Layer(0));
    assert!(matches!(
        c.resolve(&[old], None),
        Err(Error::NotResident { .. })
    ));
    c.allocate(&[old]).unwrap();
    // The pinned one lingers, so it is still remembered and still refuses recreation.
    assert!(matches!(
        c.allocate(&[pinned]),
        Err(Error::NamespaceDropped { .. })
    ));
    c.release(h).unwrap();
    c.validate().unwrap();
}

#[test]
fn a_hint_whose_slot_another_object_took_is_refused() {
    let d = dir(8, 8);
    let gone = ObjectKey::new(1, 0, 0, LayerGroup::Layer(0));
    let other = ObjectKey::new(2, 0, 0, LayerGroup::Layer(0));
    d.allocate(&[gone]).unwrap();
    let stale = d.index_of(&[gone]);
    assert_ne!(stale[0], ObjectHint::NONE);
    d.drop_namespace(gone.namespace).unwrap();
    d.allocate(&[other]).unwrap();
    let now = d.index_of(&[other]);
    assert_eq!(
        now[0].index(),
        stale[0].index(),
        "the freed slot was reused"
    );
    assert_ne!(now[0].generation(), stale[0].generation());
    // Through the stale hint the dropped key is still dropped, not the object that took
    // its slot (whose hint, taken now, resolves it).
    assert!(matches!(
        d.resolve_hinted(&[gone], &stale, None),
        Err(Error::NamespaceDropped { .. })
    ));
    let r = d.resolve_hinted(&[other], &now, None).unwrap();
    assert_eq!(r.indices, vec![now[0].index()]);
    d.release(r.handle).unwrap();
    // A hint of no object, or of one out of range, falls back to the key.
    let far = [ObjectHint::new(1 << 20, 0)];
    for hints in [[ObjectHint::NONE], far] {
        let r = d.resolve_hinted(&[other], &hints, None).unwrap();
        assert_eq!(r.indices, vec![now[0].index()]);
        d.release(r.handle).unwrap();
    }
}

#[test]
fn batch_numbers_wrap_without_taking_an_object_for_a_repeat() {
    // A batch's objects carry its number to dedup repeated keys; once the 32-bit numbers run
    // out, an object last seen long ago must not look seen by a batch that reuses its number.
    let d = dir(8, 8);
    let (a, b) = (key(1), key(2));
    d.allocate(&[a, b]).unwrap();
    let r = d.resolve(&[a], None).unwrap(); // batch 1
    d.release(r.handle).unwrap();
    d.set_epoch(u32::MAX);
    let r = d.resolve(&[b], None).unwrap(); // numbering starts again
    d.release(r.handle).unwrap();
    let r = d.resolve(&[a, a], None).unwrap();
    assert_eq!(
        (r.metrics.distinct, r.metrics.ready),
        (1, 1),
        "a is new to this batch"
    );
    assert_eq!(d.stats().pins, 1, "and pinned by it");
    d.release(r.handle).unwrap();
    d.validate().unwrap();
}

/// Objects `0..n`, one a namespace (ids from 100), layer 0 of a one-layer bitmap; each
/// allocated, written through and evictable, in that LRU order.
fn evictable_run(d: &Directory, n: u32) -> Vec<ObjectKey> {
    let keys: Vec<ObjectKey> = (0..n)
        .map(|i| ObjectKey::new(100 + u64::from(i), 0, 0, LayerGroup::Layer(0)))
        .collect();
    for k in &keys {
        d.allocate(&[*k]).unwrap();
        let plan = d.backup(&[*k]).unwrap();
        d.backup_complete(plan.transfer.unwrap()).unwrap();
    }
    keys
}

#[test]
fn an_eviction_passes_over_what_the_device_read_once_a_bitmap() {
    let d = dir(4, 8);
    let keys = evictable_run(&d, 4);
    // The device read 0 and 2: evictions take 1, then 3, then 0 (back at the end since).
    d.publish_reads(Arc::new(vec![0b0101]), 100, 1);
    assert_eq!(d.evict(1), vec![keys[1]]);
    assert_eq!(d.evict(1), vec![keys[3]]);
    assert_eq!(
        d.evict(1),
        vec![keys[0]],
        "a second chance is given once a bitmap"
    );
    assert_eq!(d.stats().totals.second_chances, 2);
    // A new bitmap gives new chances: 2 read again goes back once more, and is then the
    // only member left.
    d.publish_reads(Arc::new(vec![0b0100]), 100, 1);
    assert_eq!(d.evict(1), vec![keys[2]]);
    assert_eq!(d.stats().totals.second_chances, 3);
    d.validate().unwrap();
}

#[test]
fn an_eviction_passes_over_at_most_max_chances_objects() {
    let n = crate::directory::core::MAX_CHANCES + 3;
    let d = dir(n, 2 * n);
    let keys = evictable_run(&d, n);
    // Every object was read: one eviction passes over MAX_CHANCES of them, then takes the
    // next as it is.
    d.publish_reads(Arc::new(vec![u32::MAX]), 100, 1);
    let m = crate::directory::core::MAX_CHANCES as usize;
    assert_eq!(d.evict(1), vec![keys[m]]);
    assert_eq!(d.stats().totals.second_chances, m as u64);
    // The next pass over the two left that had no chance yet, then take those that had one,
    // in their order.
    assert_eq!(d.evict(2), vec![keys[0], keys[1]]);
    assert_eq!(d.stats().totals.second_chances, m as u64 + 2);
    assert_eq!(d.evict(1), vec![keys[2]]);
    d.validate().unwrap();
}

#[test]
fn a_grant_passes_over_what_the_device_read_once_a_bitmap() {
    // The device's victims follow the host's rule (once a bitmap) without its bound: a grant
    // passes over every object the last step read, each counted apart from the host's.
    let n = crate::directory::core::MAX_CHANCES + 4;
    let d = dir(n, 2 * n);
    let keys = evictable_run(&d, n);
    let read = n as usize - 2; // all but the last two
    d.publish_reads(Arc::new(vec![(1 << read) - 1]), 100, 1);
    let victims = |g: &[(u32, ObjectKey, crate::ids::SlotId)]| {
        g.iter().map(|&(_, k, _)| k).collect::<Vec<_>>()
    };
    let g = d.grant_victims(2);
    assert_eq!(victims(&g), keys[read..].to_vec());
    let t = d.stats().totals;
    assert_eq!((t.grant_second_chances, t.second_chances), (read as u64, 0));
    // Those passed over are at the LRU's end, in their order, with no chance left from this
    // bitmap.
    let g2 = d.grant_victims(3);
    assert_eq!(victims(&g2), keys[..3].to_vec());
    assert_eq!(d.stats().totals.grant_second_chances, read as u64);
    let held: Vec<u32> = g.iter().chain(&g2).map(|&(i, _, _)| i).collect();
    d.unhold(&held).unwrap();
    d.validate().unwrap();
}
