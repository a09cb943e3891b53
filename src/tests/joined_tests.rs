//! The joined mode over real buffers on the cpu engine: a request's pages go into the prefix
//! tree when it ends; the next request over the same prompt restores only Indexer-K and loads
//! the main-KV blocks its selection picks, from the tree's host pages, in either host layout.
//! Rows carry a stamp of (token page, layer, row, plane): equal prompts write equal stamps, as
//! a deterministic model writes equal K/V.

use super::*;
use crate::config::HitPolicy;
use crate::ids::{RequestId, SlotId};
use crate::layout::{Component, Dtype, HostLayout};
use crate::pool::PoolSpec;
use crate::radix::PoolPair;
use crate::transfer::{CpuEngine, Direction, PageTransferBinding};
use std::sync::Arc;

const PS: u32 = 4;
const LAYERS: u16 = 3;

struct Joined {
    s: JoinedScheduler,
    dev: PageTransferBinding,
    idx_dev: PageTransferBinding,
    swa_dev: Option<PageTransferBinding>,
    _bufs: Vec<Box<[u8]>>,
}

fn stamp(page: u32, layer: u16, row: u32, plane: usize, tag: u8) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&page.to_le_bytes());
    b[4] = layer as u8;
    b[5] = row as u8;
    b[6] = plane as u8;
    b[7] = tag;
    b
}

const KV: u8 = 0xEE;
const IDX: u8 = 0x1D;
const SWA: u8 = 0x5A;

impl Joined {
    fn new(device_slots: u32, idx_pages: u32, host_pages: u32, layout: HostLayout) -> Self {
        Self::with_swa(device_slots, idx_pages, host_pages, layout, None)
    }

    /// With `swa = Some(w)`, an SWA sidecar of window `w` tokens beside Indexer-K.
    fn with_swa(
        device_slots: u32,
        idx_pages: u32,
        host_pages: u32,
        layout: HostLayout,
        swa: Option<u32>,
    ) -> Self {
        let kv = PoolSpec::new(Component::Kv, 1, 2, 1, 4, Dtype::Bf16, PS, device_slots).unwrap();
        let kv_host = PoolSpec::new(
            Component::Kv,
            LAYERS as u32,
            2,
            1,
            4,
            Dtype::Bf16,
            PS,
            host_pages,
        )
        .unwrap();
        let ik = PoolSpec::new(
            Component::Indexer,
            LAYERS as u32,
            1,
            1,
            4,
            Dtype::Bf16,
            PS,
            idx_pages,
        )
        .unwrap();
        let ik_host = ik.with_pages(host_pages).unwrap();
        // SAFETY: the harness owns every buffer for as long as the scheduler lives and writes
        // them only through `write`, into rows no transfer in flight touches.
        let (b0, dev) = unsafe { crate::testing::host_pool(&kv) }.unwrap();
        // SAFETY: as above.
        let (b1, host_kv) = unsafe { crate::testing::host_pool_in(&kv_host, layout) }.unwrap();
        // SAFETY: as above.
        let (b2, idx_dev) = unsafe { crate::testing::host_pool(&ik) }.unwrap();
        // SAFETY: as above.
        let (b3, idx_host) = unsafe { crate::testing::host_pool_in(&ik_host, layout) }.unwrap();
        let cfg = SchedulerConfig {
            layers: LAYERS,
            page_size: PS,
            device_pages: device_slots,
            device_reserve: 0,
            host_pages,
            prefetch: false,
            prefetch_depth: 1,
        };
        let mut sidecars = vec![PoolPair {
            device: Some(idx_dev.clone()),
            host: idx_host,
            hit: HitPolicy::AllPages,
        }];
        let mut bufs = vec![b0, b1, b2, b3];
        let mut swa_dev = None;
        if let Some(w) = swa {
            let sw = PoolSpec::new(
                Component::Swa,
                LAYERS as u32,
                2,
                1,
                4,
                Dtype::Bf16,
                PS,
                idx_pages,
            )
            .unwrap();
            // SAFETY: as above.
            let (b4, d) = unsafe { crate::testing::host_pool(&sw) }.unwrap();
            let sw_host = sw.with_pages(host_pages).unwrap();
            // SAFETY: as above.
            let (b5, h) = unsafe { crate::testing::host_pool_in(&sw_host, layout) }.unwrap();
            sidecars.push(PoolPair {
                device: Some(d.clone()),
                host: h,
                hit: HitPolicy::Window(w),
            });
            swa_dev = Some(d);
            bufs.extend([b4, b5]);
        }
        let engine = Arc::new(CpuEngine::new(2).unwrap());
        let s =
            StepScheduler::joined(cfg, dev.clone(), host_kv, sidecars, idx_pages, engine).unwrap();
        Joined {
            s,
            dev,
            idx_dev,
            swa_dev,
            _bufs: bufs,
        }
    }

    fn poke(b: &PageTransferBinding, plane: usize, page: u32, row: u32, v: [u8; 8]) {
        let addr = row_in(b, plane, page, row);
        // SAFETY: a row of a page the scheduler handed out, inside the buffer (checked); no
        // transfer touches it while its request writes it.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), addr as *mut u8, 8) };
    }

    fn peek(b: &PageTransferBinding, plane: usize, page: u32, row: u32) -> [u8; 8] {
        let mut v = [0u8; 8];
        let addr = row_in(b, plane, page, row);
        // SAFETY: as above; loads the caller waited for are complete.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), 8) };
        v
    }

    /// Prefills request `id` from its admitted length to `len` tokens, stamping every row.
    fn prefill(&mut self, id: u64, len: u64) {
        let rid = RequestId::new(id);
        let from = self.s.request(rid).unwrap().len;
        let (first, slots) = self.s.extend(rid, len - from).unwrap();
        let touched = slots.len() / LAYERS as usize;
        let idx = self.s.indexer_pages(rid).unwrap().to_vec();
        for t in from..len {
            let page = (t / u64::from(PS)) as u32;
            let row = (t % u64::from(PS)) as u32;
            for l in 0..LAYERS {
                let slot: SlotId = slots[l as usize * touched + (page - first) as usize];
                for plane in 0..2 {
                    Self::poke(
                        &self.dev,
                        plane,
                        slot.raw(),
                        row,
                        stamp(page, l, row, plane, KV),
                    );
                }
                Self::poke(
                    &self.idx_dev,
                    l as usize,
                    idx[page as usize],
                    row,
                    stamp(page, l, row, 0, IDX),
                );
                if let Some(sw) = &self.swa_dev {
                    for plane in 0..2 {
                        let v = stamp(page, l, row, plane, SWA);
                        Self::poke(sw, l as usize * 2 + plane, idx[page as usize], row, v);
                    }
                }
            }
        }
    }

    /// Plans every layer over `pages` for request `id` and checks every row read.
    fn read_back(&mut self, id: u64, pages: &[i64]) {
        let rid = RequestId::new(id);
        let unit = SelectionUnit::new(PS, PS).unwrap();
        let len = self.s.request(rid).unwrap().len;
        for l in 0..LAYERS {
            self.s.wait_prefix(rid, l, None).unwrap();
            let idx = self.s.indexer_pages(rid).unwrap().to_vec();
            let (plan, table) = self.s.plan(l, &[rid], pages, pages.len(), unit).unwrap();
            let table = table.to_vec();
            let out = self.s.ready(plan, None).unwrap();
            assert!(out.failed.is_empty(), "{:?}", out.failed);
            let table = if out.slots_changed {
                self.s.table(plan).unwrap().to_vec()
            } else {
                table
            };
            for (j, &p) in pages.iter().enumerate() {
                for row in (0..PS).filter(|&r| u64::from(p as u32 * PS + r) < len) {
                    for plane in 0..2 {
                        assert_eq!(
                            Self::peek(&self.dev, plane, table[j] as u32, row),
                            stamp(p as u32, l, row, plane, KV),
                            "KV page {p} layer {l} row {row}"
                        );
                    }
                    assert_eq!(
                        Self::peek(&self.idx_dev, l as usize, idx[p as usize], row),
                        stamp(p as u32, l, row, 0, IDX),
                        "Indexer-K page {p} layer {l} row {row}"
                    );
                }
            }
            self.s.finish(plan).unwrap();
            self.s.validate().unwrap();
        }
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + 1 + salt * (i / 40)).collect()
}

fn joined_round_trip(layout: HostLayout) {
    let mut j = Joined::new(64, 32, 48, layout);
    let shared = prompt(41, 0); // 10 whole pages + 1 token
                                // A: no match; prefilled, decoded a little, ended with its tokens: inserted.
    let a = j.s.admit(RequestId::new(1), &shared).unwrap();
    assert_eq!(a.matched_pages, 0);
    j.prefill(1, 41);
    j.read_back(1, &[0, 3, 10]);
    j.s.end_step().unwrap();
    j.s.end_request(RequestId::new(1), Some(&shared)).unwrap();
    j.s.drain().unwrap();
    j.s.validate().unwrap();
    assert_eq!(j.s.finishing(), 0);
    assert_eq!(j.s.prefix_totals().pages_inserted, 10);
    // Evict the tree's Indexer-K device pages and every KV slot: B restores from host.
    let (d, _) = j.s.evict_prefix(1000, 0).unwrap();
    assert_eq!(d, 10);
    j.s.directory().evict(1000);
    j.s.validate().unwrap();
    let mut b_tokens = shared[..40].to_vec();
    b_tokens.extend(prompt(9, 3)[..9].iter().map(|t| t + 5000));
    let b = j.s.admit(RequestId::new(2), &b_tokens).unwrap();
    assert_eq!((b.matched_pages, b.restored_pages), (10, 10));
    j.prefill(2, b_tokens.len() as u64);
    let before = j.s.prefix_totals();
    j.read_back(2, &[0, 2, 9, 11]);
    let after = j.s.prefix_totals();
    // Three prefix blocks per layer were loaded; the suffix page was on the device.
    let obj = j.s.object_bytes();
    assert_eq!(
        after.prefix_kv_bytes_loaded - before.prefix_kv_bytes_loaded,
        3 * 3 * obj
    );
    assert_eq!(
        after.sidecar_bytes_restored,
        10 * 3 * 2 * 8 * u64::from(PS) / 2
    );
    assert!(after.full_restore_bytes > after.sidecar_bytes_restored + after.prefix_kv_bytes_loaded);
    // B is aborted: its own pages go, the tree keeps A's.
    j.s.end_step().unwrap();
    j.s.end_request(RequestId::new(2), None).unwrap();
    j.s.drain().unwrap();
    j.s.validate().unwrap();
    // Host eviction takes the prefix and its objects; C over the same prompt misses.
    let (_, h) = j.s.evict_prefix(1000, 1000).unwrap();
    assert_eq!(h, 10);
    j.s.validate().unwrap();
    let c = j.s.admit(RequestId::new(3), &shared).unwrap();
    assert_eq!(c.matched_pages, 0);
    j.prefill(3, 41);
    j.read_back(3, &[1, 10]);
    j.s.end_request(RequestId::new(3), None).unwrap();
    j.s.drain().unwrap();
    j.s.validate().unwrap();
}

#[test]
fn joined_round_trip_layer_first() {
    joined_round_trip(HostLayout::LayerFirst);
}

#[test]
fn joined_round_trip_layer_page_first() {
    joined_round_trip(HostLayout::LayerPageFirst);
}

#[test]
fn the_directory_has_room_for_every_homed_object_from_the_start() {
    // An object a layer of every host page: the directory never grows (moving every object,
    // inside a decode step's `append`) while the host pool has pages to home new ones.
    let j = Joined::new(64, 32, 48, HostLayout::LayerFirst);
    assert!(j.s.directory().object_room() >= 48 * LAYERS as usize);
}

#[test]
fn a_host_step_leaves_the_device_mirror_naming_its_pages() {
    // A prefill's pages enter the device resolver's mirror when its step ends, not at the
    // next decode step's grant (a long prompt's would all land in that one step).
    let mut j = Joined::new(64, 32, 48, HostLayout::LayerFirst);
    let state = j.s.enable_device_resolver().unwrap();
    j.s.admit(RequestId::new(1), &prompt(30, 0)).unwrap();
    j.prefill(1, 30);
    let named = || state.lock().mirror().iter().filter(|&&m| m >= 0).count();
    assert_eq!(named(), 0, "nothing before the step ends");
    j.s.end_step().unwrap();
    assert_eq!(
        named(),
        8 * LAYERS as usize,
        "every page of every layer, on the device"
    );
    j.s.validate().unwrap();
}

#[test]
fn failed_indexer_restore_fails_the_request_only() {
    let mut j = Joined::new(64, 32, 48, HostLayout::LayerFirst);
    let shared = prompt(33, 0);
    j.s.admit(RequestId::new(1), &shared).unwrap();
    j.prefill(1, 33);
    j.s.end_request(RequestId::new(1), Some(&shared)).unwrap();
    j.s.drain().unwrap();
    j.s.evict_prefix(1000, 0).unwrap();
    // The restore is a load through the same engine: fail it there.
    j.s.inject_faults(Direction::Load, 0, None, None);
    j.s.engine()
        .inject(crate::transfer::Fault {
            nth: j.s.engine().submitted(),
            layer: None,
            action: crate::transfer::FaultAction::Fail("injected restore fault".into()),
        })
        .unwrap();
    let b = j.s.admit(RequestId::new(2), &shared).unwrap();
    assert_eq!(b.restored_pages, 8);
    let err = j.s.wait_prefix(RequestId::new(2), 0, None).unwrap_err();
    assert!(err.to_string().contains("injected restore fault"), "{err}");
    j.s.end_request(RequestId::new(2), None).unwrap();
    j.s.drain().unwrap();
    j.s.validate().unwrap();
    assert_eq!(j.s.prefix_totals().restores_failed, 1);
    // The prefix is host-only again and serves the next request.
    let c = j.s.admit(RequestId::new(3), &shared).unwrap();
    assert_eq!(c.restored_pages, 8);
    j.prefill(3, 33);
    j.read_back(3, &[0, 7, 8]);
    j.s.end_request(RequestId::new(3), Some(&shared)).unwrap();
    j.s.drain().unwrap();
    j.s.validate().unwrap();
}

#[test]
fn swa_comes_back_for_its_window_only() {
    // Window of 6 tokens over a 10-page prefix of 4-token pages: pages 8 and 9 hold it.
    let mut j = Joined::with_swa(64, 32, 48, HostLayout::LayerPageFirst, Some(6));
    let shared = prompt(41, 0);
    j.s.admit(RequestId::new(1), &shared).unwrap();
    j.prefill(1, 41);
    j.s.end_request(RequestId::new(1), Some(&shared)).unwrap();
    j.s.drain().unwrap();
    j.s.evict_prefix(1000, 0).unwrap();
    // Nothing stale on the device: every sidecar row read below was written by the restore.
    for b in [&j.idx_dev, j.swa_dev.as_ref().unwrap()] {
        let (base, len) = b.extent();
        // SAFETY: the harness's own buffer; no transfer is in flight after drain.
        unsafe { std::ptr::write_bytes(base as *mut u8, 0, len as usize) };
    }
    let before = j.s.prefix_totals();
    let b = j.s.admit(RequestId::new(2), &shared).unwrap();
    assert_eq!(b.restored_pages, 10);
    for l in 0..LAYERS {
        j.s.wait_prefix(RequestId::new(2), l, None).unwrap();
    }
    let idx = j.s.indexer_pages(RequestId::new(2)).unwrap().to_vec();
    let sw = j.swa_dev.clone().unwrap();
    for (p, &page) in idx.iter().enumerate() {
        for l in 0..LAYERS {
            let got = Joined::peek(&sw, l as usize * 2, page, 0);
            let want = if p >= 8 {
                stamp(p as u32, l, 0, 0, SWA)
            } else {
                [0; 8]
            };
            assert_eq!(got, want, "SWA page {p} layer {l}");
            let ik = Joined::peek(&j.idx_dev, l as usize, page, 0);
            assert_eq!(
                ik,
                stamp(p as u32, l, 0, 0, IDX),
                "Indexer-K page {p} layer {l}"
            );
        }
    }
    let t = j.s.prefix_totals();
    let page = 32 * u64::from(LAYERS); // 4 tokens x 4 dims x bf16, every layer
    let restored = t.sidecar_bytes_restored - before.sidecar_bytes_restored;
    assert_eq!(restored, 10 * page + 2 * 2 * page); // Indexer-K all, SWA (K and V) 2 pages
    let kv = 10 * j.s.object_bytes() * u64::from(LAYERS);
    assert_eq!(
        t.full_restore_bytes - before.full_restore_bytes,
        kv + restored
    );
    j.s.end_request(RequestId::new(2), None).unwrap();
    j.s.drain().unwrap();
    j.s.validate().unwrap();
}

/// Where row `row` of `page` lies in plane `plane`; a page the scheduler got wrong fails the
/// test here instead of reading outside the buffer.
fn row_in(b: &PageTransferBinding, plane: usize, page: u32, row: u32) -> u64 {
    b.row_addr_checked(plane, page, row)
        .unwrap_or_else(|| panic!("page {page} row {row} plane {plane}: outside the pool"))
}

/// Request 1's pages fill 24 of 40 device slots; request 2's prefill then needs 21 more, so
/// the host evicts request 1's least recently used objects. With `read`, a device step read
/// request 1's page 0 first (a device's hits leave no trace in the LRU). Returns, per page of
/// request 1, how many of its layers stay on the device, and the directory's second chances.
fn host_evictions_after_a_device_step(read: bool) -> (Vec<usize>, u64) {
    let mut j = Joined::new(40, 32, 48, HostLayout::LayerFirst);
    let state = j.s.enable_device_resolver().unwrap();
    let r1 = RequestId::new(1);
    j.s.admit(r1, &prompt(32, 0)).unwrap();
    j.prefill(1, 32);
    j.s.end_step().unwrap();
    j.s.drain().unwrap(); // written through: evictable
    if read {
        assert!(j.s.begin_device_step(&[r1], 1).unwrap());
        for l in 0..LAYERS {
            let mut table = [0i32];
            state
                .lock()
                .resolve_layer(l, &[r1], &[0], 1, false, &mut table)
                .unwrap();
            assert!(table[0] >= 0);
        }
        j.s.end_step().unwrap();
    }
    j.s.admit(RequestId::new(2), &prompt(28, 9)).unwrap();
    j.prefill(2, 28);
    j.s.end_step().unwrap();
    j.s.validate().unwrap();
    let layers = LAYERS as usize;
    let homes: Vec<u32> =
        j.s.request(r1)
            .unwrap()
            .homes
            .iter()
            .map(|&(h, _)| h)
            .collect();
    let on_device = homes
        .iter()
        .map(|&h| {
            (0..layers)
                .filter(|&l| {
                    let key = j.s.key_of(h as usize * layers + l, layers);
                    matches!(
                        j.s.directory().state(&key).map(|s| s.device),
                        Some(crate::directory::DeviceState::Ready { .. })
                    )
                })
                .count()
        })
        .collect();
    (on_device, j.s.directory().stats().totals.second_chances)
}

#[test]
fn host_evictions_pass_over_what_the_last_device_step_read() {
    // Without the device's reads the host evicts from request 1's oldest objects, page 0's
    // among them...
    let (unread, chances) = host_evictions_after_a_device_step(false);
    assert!(unread[0] < LAYERS as usize && chances == 0, "{unread:?}");
    // ...with them it keeps every layer of the page the device read, and evicts others.
    let (read, chances) = host_evictions_after_a_device_step(true);
    assert_eq!(read[0], LAYERS as usize, "{read:?}");
    assert!(chances > 0);
    assert!(
        read[1..].iter().sum::<usize>() < 7 * LAYERS as usize,
        "{read:?}"
    );
}

#[test]
fn a_device_step_short_only_of_written_through_pages_waits_for_them() {
    // Right after a prefill its pages are still being written through, so not yet
    // evictable: a grant that needs them waits for those copies rather than planning the
    // step on the host (a round trip a layer, and the resolver's pool handed back).
    let mut j = Joined::new(26, 32, 48, HostLayout::LayerFirst);
    let state = j.s.enable_device_resolver().unwrap();
    let r1 = RequestId::new(1);
    j.s.admit(r1, &prompt(32, 0)).unwrap();
    j.prefill(1, 32); // 24 of the 26 slots
    j.s.end_step().unwrap();
    assert!(j.s.begin_device_step(&[r1], 4).unwrap());
    for l in 0..LAYERS {
        let mut table = [0i32; 4];
        state
            .lock()
            .resolve_layer(l, &[r1], &[0, 1, 2, 3], 4, false, &mut table)
            .unwrap();
        assert!(table.iter().all(|&s| s >= 0), "{table:?}");
    }
    j.s.end_step().unwrap();
    assert_eq!(j.s.device_totals().fallbacks, 0);
    j.s.validate().unwrap();
}

#[test]
fn a_resolver_enabled_late_mirrors_the_prefix_cache_on_the_device() {
    // Enabled after a request ended, its pages kept by the prefix cache on the device: a later
    // request that matches them reads them where they are (the mirror names them), rather
    // than the device copying them in again.
    let mut j = Joined::new(64, 32, 48, HostLayout::LayerFirst);
    let shared = prompt(41, 0);
    j.s.admit(RequestId::new(1), &shared).unwrap();
    j.prefill(1, 41);
    j.s.end_step().unwrap();
    j.s.end_request(RequestId::new(1), Some(&shared)).unwrap();
    j.s.drain().unwrap();
    let state = j.s.enable_device_resolver().unwrap();
    let r2 = RequestId::new(2);
    let mut tokens = shared[..40].to_vec();
    tokens.extend(prompt(5, 3).iter().map(|t| t + 5000));
    let m = j.s.admit(r2, &tokens).unwrap();
    assert_eq!(m.matched_pages, 10);
    j.prefill(2, tokens.len() as u64);
    j.s.end_step().unwrap();
    j.s.validate().unwrap();
    assert!(j.s.begin_device_step(&[r2], 4).unwrap());
    for l in 0..LAYERS {
        let mut table = [0i32; 4];
        state
            .lock()
            .resolve_layer(l, &[r2], &[0, 3, 9, 10], 4, false, &mut table)
            .unwrap();
    }
    let rec = j.s.end_step().unwrap();
    assert_eq!(
        (rec.ready, rec.loaded),
        (4 * LAYERS as u64, 0),
        "prefix pages on the device copied in again"
    );
    j.s.validate().unwrap();
}
