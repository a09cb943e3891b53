//! The device resolver's reference implementation against a plain model: every cell of a
//! layer reads a slot holding its object's bytes when the layer's call returns (so a slot an
//! earlier cell of the call read is never filled again under it), no two mirror entries name
//! one slot, victims the layer reads are passed over (a layer copies in only what was not on
//! the device when it began), and a grant of one layer's cells never runs out however many
//! layers a step resolves.

use super::resolver::{ResolverState, ABSENT, FAILED};
use crate::ids::RequestId;
use crate::layout::{Component, Dtype, HostLayout};
use crate::pool::PoolSpec;
use proptest::prelude::*;

const PS: u32 = 4;
const LAYERS: u16 = 3;
const HOMES: u32 = 24;

/// The bytes home `h` holds at `layer` (every byte of its page, every plane).
fn tag(h: u32, layer: u16) -> u8 {
    (h * LAYERS as u32 + layer as u32 + 1) as u8
}

struct Fixture {
    _buffers: (Box<[u8]>, Box<[u8]>),
    dev_base: Vec<u64>,
    dev_stride: u64,
    page_bytes: u64,
    st: ResolverState,
}

fn fixture(slots: u32, homes: u32) -> Fixture {
    let kv = PoolSpec::new(Component::Kv, 1, 1, 1, 4, Dtype::Bf16, PS, slots).unwrap();
    let host = PoolSpec::new(
        Component::Kv,
        LAYERS as u32,
        1,
        1,
        4,
        Dtype::Bf16,
        PS,
        homes,
    )
    .unwrap();
    // SAFETY: the fixture owns both buffers for as long as the resolver copies between them.
    let (dev_buf, dev) = unsafe { crate::testing::host_pool(&kv) }.unwrap();
    // SAFETY: as above.
    let (mut host_buf, host_b) =
        unsafe { crate::testing::host_pool_in(&host, HostLayout::LayerFirst) }.unwrap();
    let (flat, order) = host_b.flatten_layers().unwrap();
    let page_bytes = flat.page_bytes();
    let base = host_buf.as_ptr() as u64;
    for h in 0..homes {
        for l in 0..LAYERS {
            for plane in 0..flat.planes_per_layer() {
                let at = (flat.row_addr(plane, order.flat(h, l), 0) - base) as usize;
                host_buf[at..at + page_bytes as usize].fill(tag(h, l));
            }
        }
    }
    let dev_base = (0..dev.planes_per_layer())
        .map(|p| dev.row_addr(p, 0, 0))
        .collect();
    let dev_stride = dev.page_stride();
    let st = ResolverState::new(LAYERS, PS, homes, dev, flat, order).unwrap();
    Fixture {
        _buffers: (dev_buf, host_buf),
        dev_base,
        dev_stride,
        page_bytes,
        st,
    }
}

impl Fixture {
    /// Whether device `slot` holds home `h`'s bytes of `layer`, every plane.
    fn holds(&self, slot: i32, h: u32, layer: u16) -> bool {
        self.dev_base.iter().all(|&b| {
            let at = b + slot as u64 * self.dev_stride;
            // SAFETY: `slot` is a slot of the device pool the fixture owns; a page of a plane
            // is `page_bytes` long.
            let page =
                unsafe { std::slice::from_raw_parts(at as *const u8, self.page_bytes as usize) };
            page.iter().all(|&x| x == tag(h, layer))
        })
    }
}

#[derive(Debug, Clone)]
struct Case {
    /// Per request: its pages' homes (distinct across requests but for a shared prefix).
    homes: Vec<Vec<u32>>,
    /// Per step, per layer, per request: the pages selected (k each, -1 padding).
    steps: Vec<Vec<Vec<Vec<i32>>>>,
    /// Objects already on the device when the first step starts: (home, layer).
    resident: Vec<(u32, u16)>,
    /// Of the grant, how many entries are victims (the rest are free slots).
    victims: usize,
    /// A grant of half a layer's cells: cells may go without a slot (counted as overflow), but
    /// a slot a cell of the call read is never filled again under it.
    short: bool,
    /// Copy failures armed each step (layer or any, count): a failed copy is retried once,
    /// and a cell whose copy failed twice gets FAILED, never a slot.
    faults: Vec<(Option<u16>, u32)>,
}

const K: usize = 4;

fn case() -> impl Strategy<Value = Case> {
    (1usize..=3, 0usize..=2)
        .prop_flat_map(|(rows, shared)| {
            // Homes: `shared` prefix pages common to every request, then 3 of its own each.
            let homes: Vec<Vec<u32>> = (0..rows)
                .map(|r| {
                    (0..shared as u32)
                        .chain((0..3).map(|p| 2 + r as u32 * 3 + p))
                        .collect()
                })
                .collect();
            let pages: Vec<usize> = homes.iter().map(Vec::len).collect();
            let step = pages
                .iter()
                .map(|&n| prop::collection::vec(-1i32..n as i32, K))
                .collect::<Vec<_>>();
            let layer = step.clone();
            (
                Just(homes),
                prop::collection::vec(
                    prop::collection::vec(layer, LAYERS as usize..=LAYERS as usize),
                    1..4,
                ),
                prop::collection::vec((0u32..HOMES, 0u16..LAYERS), 0..8),
                0usize..=6,
                any::<bool>(),
                prop::collection::vec((prop::option::of(0u16..LAYERS), 1u32..=3), 0..=2),
            )
        })
        .prop_map(|(homes, steps, resident, victims, short, faults)| Case {
            homes,
            steps,
            resident,
            victims,
            short,
            faults,
        })
}

/// Runs case `c` on the reference, or with `kernel` on the CUDA kernel's source run on that
/// many CPU threads, and checks every cell and the step's outcome.
fn check(c: Case, kernel: Option<usize>) -> Result<(), TestCaseError> {
    let rows = c.homes.len();
    // Slots: one layer's cells of grant, plus room for the resident objects.
    let cells = rows * K;
    let slots = (cells * (c.steps.len() + 2) + c.resident.len() + 2) as u32;
    let mut f = fixture_on(slots, kernel);
    let rids: Vec<RequestId> = (0..rows as u64).map(RequestId::new).collect();
    // Resident objects: copied in by hand, named in the mirror; some become victims.
    let mut next = 0u32;
    let mut named = std::collections::BTreeMap::new();
    for &(h, l) in &c.resident {
        if named.contains_key(&(h, l)) {
            continue;
        }
        let e = f.st.entry(h, l);
        for &b in &f.dev_base {
            let at = b + next as u64 * f.dev_stride;
            // SAFETY: slot `next` is a slot of the fixture's device pool.
            unsafe { std::ptr::write_bytes(at as *mut u8, tag(h, l), f.page_bytes as usize) };
        }
        f.st.set(e, next as i32);
        named.insert((h, l), next);
        next += 1;
    }
    for (r, homes) in c.homes.iter().enumerate() {
        let len = homes.len() as u64 * u64::from(PS);
        let pairs: Vec<(u32, u32)> = homes.iter().map(|&h| (h, 0)).collect();
        f.st.update_table(rids[r], 0, &pairs, len);
    }
    for step in &c.steps {
        // The grant: victims first (resident objects, in order), then free slots, as many
        // entries as one layer's cells.
        let mut grant: Vec<(i32, i64)> = named
            .iter()
            .take(c.victims)
            .map(|(&(h, l), &s)| (s as i32, f.st.entry(h, l) as i64))
            .collect();
        let mut free = next;
        let size = if c.short { cells.div_ceil(2) } else { cells };
        grant.truncate(size);
        while grant.len() < size {
            grant.push((free as i32, -1));
            free += 1;
        }
        prop_assume!(free <= slots);
        f.st.open((&rids, K), grant, c.faults.clone(), cells)
            .unwrap();
        // Per layer: the distinct objects its cells name, and whether a cell failed.
        let mut objects = vec![(std::collections::BTreeSet::new(), false); LAYERS as usize];
        // Per layer (the reference: its mirror is the host's): the objects it reads that were
        // not on the device when its call began.
        let mut absent_at_start = vec![0u64; LAYERS as usize];
        for (layer, sel_rows) in step.iter().enumerate() {
            let layer = layer as u16;
            let sel: Vec<i32> = sel_rows.concat();
            if kernel.is_none() {
                let read: std::collections::BTreeSet<u32> = sel
                    .iter()
                    .enumerate()
                    .filter(|&(_, &e)| e >= 0)
                    .map(|(i, &e)| c.homes[i / K][e as usize])
                    .collect();
                absent_at_start[layer as usize] =
                    read.iter().filter(|&&h| f.st.slot(h, layer) < 0).count() as u64;
            }
            let mut table = vec![0i32; sel.len()];
            f.st.resolve_layer(layer, &rids, &sel, K, false, &mut table)
                .unwrap();
            let o = &mut objects[layer as usize];
            for (i, &entry) in sel.iter().enumerate().filter(|&(_, &e)| e >= 0) {
                o.0.insert(c.homes[i / K][entry as usize]);
            }
            o.1 |= table.contains(&FAILED);
            // Every cell: -1 where it names nothing, else a slot with its object's bytes.
            for (i, (&entry, &slot)) in sel.iter().zip(&table).enumerate() {
                if entry < 0 {
                    prop_assert_eq!(slot, ABSENT);
                    continue;
                }
                let h = c.homes[i / K][entry as usize];
                if slot == FAILED {
                    // A copy that failed twice (the reference: the kernel takes no
                    // faults), or (short grant) no slot left: counted below.
                    prop_assert!(
                        (kernel.is_none() && !c.faults.is_empty()) || c.short,
                        "cell {} failed with no fault armed and a full grant",
                        i
                    );
                    continue;
                }
                prop_assert!(slot >= 0, "cell {} got no slot", i);
                prop_assert!(
                    f.holds(slot, h, layer),
                    "cell {} reads slot {} without {:?}",
                    i,
                    slot,
                    (h, layer)
                );
                if kernel.is_none() {
                    // (The kernel's mirror comes back when the step closes, as from a GPU.)
                    prop_assert_eq!(f.st.slot(h, layer), slot);
                }
            }
        }
        let done = f.st.close().unwrap();
        // Each object a layer read counts once, as a hit or a miss (where no cell failed); and
        // a layer copies in only what was not on the device when it began: a miss never
        // evicts an object a cell of the same layer reads, before or after it.
        for (l, (o, failed)) in objects.iter().enumerate() {
            if !failed {
                prop_assert_eq!(
                    done.counts.hits[l] + done.counts.misses[l],
                    o.len() as u64,
                    "layer {}",
                    l
                );
                if kernel.is_none() {
                    prop_assert_eq!(done.counts.misses[l], absent_at_start[l], "layer {}", l);
                }
            }
        }
        // A grant of one layer's cells is enough, failed copies included (their slots are
        // taken again).
        if !c.short {
            prop_assert_eq!(done.counts.overflow, 0);
        }
        // Every failure is an armed fault taken; what was not taken is handed back.
        let armed: u64 = c.faults.iter().map(|&(_, n)| u64::from(n)).sum();
        let left: u64 = done.faults.iter().map(|&(_, n)| u64::from(n)).sum();
        prop_assert_eq!(done.counts.failed + left, armed);
        prop_assert!(done.counts.retried <= done.counts.failed);
        let failed_entries = done.log.iter().filter(|en| en.failed).count() as u64;
        // A copy that failed once was retried; an entry failed when its retry failed too.
        prop_assert_eq!(done.counts.failed, done.counts.retried + failed_entries);
        // The host's mirror followed the kernel's from the log alone.
        #[cfg(feature = "host-kernel")]
        if let Some(m) = f.st.device_mirror_mismatch() {
            return Err(TestCaseError::fail(m));
        }
        // No slot named twice by the mirror.
        let mut seen = std::collections::HashSet::new();
        for &s in f.st.mirror().iter().filter(|&&s| s >= 0) {
            prop_assert!(seen.insert(s), "slot {} named twice", s);
        }
        // What the mirror names is there.
        for h in 0..HOMES {
            for l in 0..LAYERS {
                let s = f.st.slot(h, l);
                if s >= 0 {
                    prop_assert!(f.holds(s, h, l));
                }
            }
        }
        // The next step's grant reuses what this one did not fill; the named map follows
        // the mirror.
        named.clear();
        for h in 0..HOMES {
            for l in 0..LAYERS {
                let s = f.st.slot(h, l);
                if s >= 0 {
                    named.insert((h, l), s as u32);
                }
            }
        }
        next = named.values().copied().max().map_or(0, |m| m + 1);
    }
    Ok(())
}

proptest! {
    #![proptest_config(crate::testing::proptest_config(256, "resolver_reference"))]
    #[test]
    fn every_cell_reads_its_objects_bytes_and_a_layers_grant_is_enough(c in case()) {
        check(c, None)?;
    }
}

#[cfg(feature = "host-kernel")]
proptest! {
    #![proptest_config(crate::testing::proptest_config(256, "resolver_kernel"))]
    /// The same, with the CUDA kernel's source run on 4 CPU threads: cells race for claims,
    /// victims and the grant's cursors.
    #[test]
    fn the_kernel_reads_every_cells_object_and_a_layers_grant_is_enough(c in case()) {
        check(c, Some(4))?;
    }
}

/// The kernel's races at a size where they meet: 16 requests sharing 64 pages, 32 entries a
/// row (cells of one object claim it together), the device holding a third of the objects,
/// each step's grant their victims first (many of them read by the layer taking them), on 8
/// threads, 40 steps of 3 layers. Every cell must read its object's bytes.
#[cfg(feature = "host-kernel")]
#[test]
fn the_kernels_racing_cells_read_their_objects_bytes() {
    race(None);
}

/// The same, on a device whose uploads fail when told (as a `cuMemcpyHtoDAsync` or an
/// allocation may): every third step, the first among them, cannot open, and opens at the
/// second try. Nothing is left half-sent: the mirror's changes and the page tables go again,
/// and every cell still reads its object's bytes (without the tables sent again, the first
/// step's cells read pages the device never got).
#[cfg(feature = "host-kernel")]
#[test]
fn a_step_that_cannot_open_leaves_the_device_whole() {
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    race(Some(fail));
}

/// The CPU as the kernel's device, its uploads failing while `fail` is set, and with
/// `bad_log` the log it reads back naming a mirror entry past the mirror (as a corrupt
/// read-back could).
#[cfg(feature = "host-kernel")]
#[derive(Debug)]
struct Flaky {
    inner: crate::scheduler::resolver::device::HostDevice,
    fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
    bad_log: bool,
}

#[cfg(feature = "host-kernel")]
impl crate::scheduler::resolver::device::KernelDevice for Flaky {
    fn alloc(&mut self, bytes: usize) -> crate::error::Result<u64> {
        self.inner.alloc(bytes)
    }
    fn free(&mut self, addr: u64) {
        self.inner.free(addr)
    }
    fn set_stream(&mut self, stream: u64) {
        self.inner.set_stream(stream)
    }
    fn host_memory(&self) -> bool {
        true
    }
    unsafe fn upload(&mut self, parts: &[(u64, &[u8])]) -> crate::error::Result<()> {
        if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            // Half of the batch went before the failure.
            // SAFETY: the caller's contract.
            unsafe { self.inner.upload(&parts[..parts.len() / 2])? };
            return Err(crate::error::Error::Cuda {
                call: "cuMemcpyHtoDAsync",
                message: "injected".into(),
            });
        }
        // SAFETY: the caller's contract.
        unsafe { self.inner.upload(parts) }
    }
    unsafe fn fill32(&mut self, dst: u64, value: u32, n: usize) -> crate::error::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.inner.fill32(dst, value, n) }
    }
    unsafe fn read(&mut self, parts: &mut [(u64, &mut [u8])]) -> crate::error::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.inner.read(parts)? };
        // The log comes back alone: its first entry's mirror entry (its second int) is lost.
        if let (true, [(_, log)]) = (self.bad_log, parts) {
            if log.len() >= 8 {
                log[4..8].copy_from_slice(&i32::MAX.to_ne_bytes());
            }
        }
        Ok(())
    }
    unsafe fn resolve(
        &mut self,
        args: &crate::scheduler::resolver::launch::LaunchArgs,
    ) -> crate::error::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.inner.resolve(args) }
    }
    unsafe fn mirror_apply(&mut self, c: u64, n: u32, m: u64) -> crate::error::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.inner.mirror_apply(c, n, m) }
    }
    unsafe fn marks_read(&mut self, m: u64, st: u64, e: u32, b: u64) -> crate::error::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.inner.marks_read(m, st, e, b) }
    }
}

#[cfg(feature = "host-kernel")]
fn race(flaky: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {
    // xorshift64: a fixed stream, so a failure repeats.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    const H: u32 = 64;
    const ROWS: usize = 16;
    const KK: usize = 32;
    let cells = ROWS * KK;
    let slots = (cells + H as usize * LAYERS as usize) as u32;
    let mut f = fixture(slots, H);
    match &flaky {
        None => f.st.use_host_kernel(8).unwrap(),
        Some(fail) => {
            f.st.use_kernel(Box::new(Flaky {
                inner: crate::scheduler::resolver::device::HostDevice::new(8),
                fail: fail.clone(),
                bad_log: false,
            }))
            .unwrap()
        }
    }
    let rids: Vec<RequestId> = (0..ROWS as u64).map(RequestId::new).collect();
    let pairs: Vec<(u32, u32)> = (0..H).map(|h| (h, 0)).collect();
    for &id in &rids {
        f.st.update_table(id, 0, &pairs, u64::from(H * PS));
    }
    let mut free: Vec<i32> = (0..slots as i32).collect();
    for step in 0..40 {
        // Evict by hand what the last step left beyond a third of the objects: it goes back
        // to free slots; the rest are this step's victims, in random order.
        let mut named: Vec<(usize, i32)> = (0..H)
            .flat_map(|h| (0..LAYERS).map(move |l| (h, l)))
            .map(|(h, l)| (f.st.entry(h, l), f.st.slot(h, l)))
            .filter(|&(_, s)| s >= 0)
            .collect();
        for i in (1..named.len()).rev() {
            named.swap(i, next(i as u64 + 1) as usize);
        }
        while named.len() > (H as usize * LAYERS as usize) / 3 {
            let (e, s) = named.pop().unwrap();
            f.st.set(e, ABSENT);
            free.push(s);
        }
        let mut grant: Vec<(i32, i64)> = named.iter().map(|&(e, s)| (s, e as i64)).collect();
        while grant.len() < cells {
            grant.push((free.pop().expect("a free slot"), -1));
        }
        if let Some(fail) = flaky.as_ref().filter(|_| step % 3 == 0) {
            fail.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(f
                .st
                .open((&rids, KK), grant.clone(), Vec::new(), cells)
                .is_err());
            fail.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        f.st.open((&rids, KK), grant, Vec::new(), cells).unwrap();
        let mut distinct = [0usize; LAYERS as usize];
        for layer in 0..LAYERS {
            // Skewed: most entries among a few pages, so that cells of an object race.
            let sel: Vec<i32> = (0..cells)
                .map(|_| {
                    if next(10) < 7 {
                        next(8) as i32
                    } else {
                        next(u64::from(H)) as i32
                    }
                })
                .collect();
            let mut table = vec![0i32; cells];
            f.st.resolve_layer(layer, &rids, &sel, KK, false, &mut table)
                .unwrap();
            distinct[layer as usize] = sel.iter().collect::<std::collections::BTreeSet<_>>().len();
            for (i, (&p, &slot)) in sel.iter().zip(&table).enumerate() {
                assert!(slot >= 0, "step {step} layer {layer} cell {i}: no slot");
                assert!(
                    f.holds(slot, p as u32, layer),
                    "step {step} layer {layer} cell {i}: slot {slot} without page {p}"
                );
            }
        }
        let done = f.st.close().unwrap();
        assert_eq!(done.counts.overflow, 0);
        assert_eq!(f.st.device_mirror_mismatch(), None, "step {step}");
        for (l, &n) in distinct.iter().enumerate() {
            let counted = done.counts.hits[l] + done.counts.misses[l];
            assert_eq!(counted, n as u64, "step {step} layer {l}: objects counted");
        }
        // Slots the step did not use are free again; those it did belong to the mirror.
        let mut owned = std::collections::HashSet::new();
        for &s in f.st.mirror().iter().filter(|&&s| s >= 0) {
            assert!(owned.insert(s), "slot {s} named twice");
        }
        free = (0..slots as i32).filter(|s| !owned.contains(s)).collect();
    }
}

/// A fixture of `slots` slots over `HOMES` homes, resolving with the reference or (`kernel`:
/// its threads) the kernel's source on the CPU.
fn fixture_on(slots: u32, kernel: Option<usize>) -> Fixture {
    #[cfg_attr(not(feature = "host-kernel"), allow(unused_mut))]
    let mut f = fixture(slots, HOMES);
    #[cfg(feature = "host-kernel")]
    if let Some(t) = kernel {
        f.st.use_host_kernel(t).unwrap();
    }
    #[cfg(not(feature = "host-kernel"))]
    assert!(
        kernel.is_none(),
        "the kernel runs on the CPU with feature host-kernel"
    );
    f
}

/// A grant entry whose victim the mirror names at another slot (the pool's occupant moved on)
/// is a free slot: taking it evicts nothing, and a cell that read the victim elsewhere does not
/// pass it over (the layer would run out of slots).
fn a_stale_victim_is_a_free_slot(kernel: Option<usize>) {
    let mut f = fixture_on(8, kernel);
    let rid = RequestId::new(0);
    // (home 0, layer 0) resident at slot 0.
    for &b in &f.dev_base {
        // SAFETY: slot 0 is a slot of the fixture's device pool.
        unsafe { std::ptr::write_bytes(b as *mut u8, tag(0, 0), f.page_bytes as usize) };
    }
    let e = f.st.entry(0, 0);
    f.st.set(e, 0);
    f.st.update_table(rid, 0, &[(0, 0), (1, 0)], 2 * u64::from(PS));
    // One entry: slot 5, its victim (home 0, layer 0), which the mirror names at slot 0.
    f.st.open((&[rid], 2), vec![(5, e as i64)], vec![], 2)
        .unwrap();
    let mut table = vec![0i32; 2];
    f.st.resolve_layer(0, &[rid], &[0, 1], 2, false, &mut table)
        .unwrap();
    let done = f.st.close().unwrap();
    assert_eq!(
        done.counts.overflow, 0,
        "the stale victim's slot was passed over"
    );
    assert_eq!(table, vec![0, 5]);
    assert!(f.holds(0, 0, 0) && f.holds(5, 1, 0));
    assert_eq!((f.st.slot(0, 0), f.st.slot(1, 0)), (0, 5));
}

#[test]
fn the_reference_takes_a_stale_victims_slot_as_free() {
    a_stale_victim_is_a_free_slot(None);
}

#[cfg(feature = "host-kernel")]
#[test]
fn the_kernel_takes_a_stale_victims_slot_as_free() {
    a_stale_victim_is_a_free_slot(Some(1));
}

/// A log read back naming a mirror entry the mirror does not have closes the step with an
/// internal error (the host's mirror untouched), never an index out of bounds.
#[cfg(feature = "host-kernel")]
#[test]
fn a_log_naming_an_entry_past_the_mirror_is_an_error() {
    let mut f = fixture(8, HOMES);
    f.st.use_kernel(Box::new(Flaky {
        inner: crate::scheduler::resolver::device::HostDevice::new(1),
        fail: Default::default(),
        bad_log: true,
    }))
    .unwrap();
    let rid = RequestId::new(0);
    f.st.update_table(rid, 0, &[(0, 0), (1, 0)], 2 * u64::from(PS));
    f.st.open((&[rid], 2), vec![(5, -1), (6, -1)], vec![], 2)
        .unwrap();
    let mut table = vec![0i32; 2];
    f.st.resolve_layer(0, &[rid], &[0, 1], 2, false, &mut table)
        .unwrap();
    let err = f.st.close().unwrap_err();
    assert!(matches!(err, crate::error::Error::Internal { .. }), "{err}");
    assert_eq!(
        (f.st.slot(0, 0), f.st.slot(1, 0)),
        (ABSENT, ABSENT),
        "the host's mirror followed a log it refused"
    );
}

/// `was_read` (the core's second chance) answers for the last closed step only: what it
/// read, hit or copied in, and nothing once a step resolved nothing; the kernel's answer is
/// the reference's. The bitmap a close hands out (the directory holds it until the next)
/// never changes under its holder, while later steps fill others.
fn was_read_is_the_last_steps(kernel: Option<usize>) {
    let mut f = fixture_on(8, kernel);
    let rid = RequestId::new(0);
    f.st.update_table(rid, 0, &[(0, 0), (1, 0), (2, 0)], 3 * u64::from(PS));
    let (e0, e1, e2) = (f.st.entry(0, 1), f.st.entry(1, 1), f.st.entry(2, 1));
    f.st.set(e0, 0); // (home 0, layer 1) resident: a hit
    let step = |f: &mut Fixture, sel: Option<&[i32]>| {
        f.st.open((&[rid], 2), vec![(5, -1), (6, -1)], vec![], 2)
            .unwrap();
        if let Some(sel) = sel {
            let mut table = vec![0i32; 2];
            f.st.resolve_layer(1, &[rid], sel, 2, false, &mut table)
                .unwrap();
        }
        f.st.close().unwrap().reads
    };
    let bit = |bits: &[u32], e: usize| bits[e / 32] >> (e % 32) & 1 == 1;
    let held = step(&mut f, Some(&[0, 1]));
    assert!(bit(&held, e0) && bit(&held, e1) && !bit(&held, e2));
    assert_eq!(
        (f.st.was_read(e0), f.st.was_read(e1), f.st.was_read(e2)),
        (true, true, false)
    );
    step(&mut f, Some(&[2, -1]));
    assert_eq!(
        (f.st.was_read(e0), f.st.was_read(e1), f.st.was_read(e2)),
        (false, false, true)
    );
    step(&mut f, None);
    assert_eq!(
        (f.st.was_read(e0), f.st.was_read(e1), f.st.was_read(e2)),
        (false, false, false),
        "a step that resolved nothing read nothing"
    );
    step(&mut f, Some(&[2, -1]));
    assert!(
        bit(&held, e0) && bit(&held, e1) && !bit(&held, e2),
        "a bitmap still held was filled again"
    );
}

#[test]
fn the_reference_answers_was_read_for_the_last_step() {
    was_read_is_the_last_steps(None);
}

#[cfg(feature = "host-kernel")]
#[test]
fn the_kernel_answers_was_read_for_the_last_step() {
    was_read_is_the_last_steps(Some(1));
}

/// A miss passes over a victim that a later cell of the same layer reads (the layer's objects
/// are all marked before any cell is served): the victim stays and is a hit, the miss takes
/// the next entry, and nothing is copied twice. One pass marking as it went evicted the victim
/// for the first cell and copied it in again for the second.
fn a_victim_a_later_cell_reads_stays(kernel: Option<usize>) {
    let mut f = fixture_on(8, kernel);
    let rid = RequestId::new(0);
    // (home 1, layer 0) resident at slot 0, granted as a victim before a free slot.
    for &b in &f.dev_base {
        // SAFETY: slot 0 is a slot of the fixture's device pool.
        unsafe { std::ptr::write_bytes(b as *mut u8, tag(1, 0), f.page_bytes as usize) };
    }
    let (e0, e1) = (f.st.entry(0, 0), f.st.entry(1, 0));
    f.st.set(e1, 0);
    f.st.update_table(rid, 0, &[(0, 0), (1, 0)], 2 * u64::from(PS));
    f.st.open((&[rid], 2), vec![(0, e1 as i64), (5, -1)], vec![], 2)
        .unwrap();
    let mut table = vec![0i32; 2];
    // Cell 0 misses (home 0); cell 1, after it, reads the victim (home 1).
    f.st.resolve_layer(0, &[rid], &[0, 1], 2, false, &mut table)
        .unwrap();
    assert_eq!(
        table,
        vec![5, 0],
        "the victim cell 1 reads was taken by cell 0"
    );
    assert!(f.holds(5, 0, 0) && f.holds(0, 1, 0));
    // (The kernel's mirror reaches the host's from the log, when the step closes.)
    let done = f.st.close().unwrap();
    assert_eq!((f.st.slot(0, 0), f.st.slot(1, 0)), (5, 0));
    assert_eq!((done.counts.hits[0], done.counts.misses[0]), (1, 1));
    assert_eq!(done.log.len(), 1);
    assert_eq!((done.log[0].e as usize, done.log[0].g), (e0, 1));
}

#[test]
fn the_reference_passes_over_a_victim_a_later_cell_reads() {
    a_victim_a_later_cell_reads_stays(None);
}

#[cfg(feature = "host-kernel")]
#[test]
fn the_kernel_passes_over_a_victim_a_later_cell_reads() {
    for threads in [1, 4] {
        a_victim_a_later_cell_reads_stays(Some(threads));
    }
}
