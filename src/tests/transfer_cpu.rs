//! The cpu engine's round-trip matrix: every layout x pool kind x direction x (all layers,
//! one layer) x (page, token) granularity. Random data, destinations poisoned first, every
//! byte of the destination compared with a reference built from `BufferGeometry` offsets
//! (an independent path from the bindings' address arithmetic).

use super::*;
use crate::error::Error;
use crate::layout::{Component, Dtype, HostLayout};
use crate::pool::PoolSpec;
use crate::testing::XorShift;
use std::sync::Arc;
use std::time::Duration;

const POISON: u8 = 0xA5;

fn spec(component: Component, pages: u32) -> PoolSpec {
    let (layers, ppl, heads, dim) = match component {
        Component::Kv => (3, 2, 2, 8),
        Component::Indexer => (3, 1, 1, 16),
        Component::Swa => (2, 2, 1, 8),
        Component::Draft => (1, 2, 2, 4),
    };
    PoolSpec::new(component, layers, ppl, heads, dim, Dtype::Bf16, 4, pages).unwrap()
}

fn binding(buf: &[u8], spec: &PoolSpec, layout: HostLayout) -> PageTransferBinding {
    // SAFETY: the test keeps `buf` alive and untouched until the transfer has finished; it is
    // only read through this binding.
    unsafe {
        PageTransferBinding::new(
            buf.as_ptr() as u64,
            buf.len() as u64,
            spec,
            layout,
            MemoryKind::Host,
        )
    }
    .unwrap()
}

/// A destination binding: the pointer comes from a unique borrow, since the engine writes it.
pub(super) fn binding_mut(
    buf: &mut [u8],
    spec: &PoolSpec,
    layout: HostLayout,
) -> PageTransferBinding {
    // SAFETY: as for `binding`; the test reads `buf` again only after the transfer finished.
    unsafe {
        PageTransferBinding::new(
            buf.as_mut_ptr() as u64,
            buf.len() as u64,
            spec,
            layout,
            MemoryKind::Host,
        )
    }
    .unwrap()
}

/// What the destination must hold: `dst` with every mapped unit of the chosen layers copied.
#[allow(clippy::too_many_arguments)]
fn expected(
    src: &[u8],
    dst: &[u8],
    s: &PoolSpec,
    d: &PoolSpec,
    src_layout: HostLayout,
    dst_layout: HostLayout,
    gran: Granularity,
    pairs: &[(u64, u64)],
    layers: &[usize],
) -> Vec<u8> {
    let (gs, gd) = (s.geometry(src_layout), d.geometry(dst_layout));
    let mut out = dst.to_vec();
    let tb = s.token_bytes() as usize;
    let ps = u64::from(s.page_size);
    for &l in layers {
        for plane in 0..u64::from(s.planes_per_layer) {
            for &(a, b) in pairs {
                let rows: Vec<(u64, u64)> = match gran {
                    Granularity::Page => (0..ps).map(|t| (a * ps + t, b * ps + t)).collect(),
                    Granularity::Token => vec![(a, b)],
                };
                for (ra, rb) in rows {
                    let so = gs.token_offset(plane, l as u64, ra / ps, ra % ps).unwrap() as usize;
                    let d_o = gd.token_offset(plane, l as u64, rb / ps, rb % ps).unwrap() as usize;
                    out[d_o..d_o + tb].copy_from_slice(&src[so..so + tb]);
                }
            }
        }
    }
    out
}

#[test]
fn round_trip_matrix_is_exact() {
    let engine = CpuEngine::new(2).unwrap();
    let mut rng = XorShift::new(0x9E37_79B9_7F4A_7C15);
    let mut cases = 0;
    for layout in [HostLayout::LayerFirst, HostLayout::LayerPageFirst] {
        for component in [
            Component::Kv,
            Component::Indexer,
            Component::Swa,
            Component::Draft,
        ] {
            for direction in [Direction::Load, Direction::Backup] {
                for gran in [Granularity::Page, Granularity::Token] {
                    let (host_pages, dev_pages) = (12u32, 9u32);
                    let (hs, ds) = (spec(component, host_pages), spec(component, dev_pages));
                    let (src_spec, dst_spec, src_layout, dst_layout) = match direction {
                        Direction::Load => (hs, ds, layout, HostLayout::LayerFirst),
                        Direction::Backup => (ds, hs, HostLayout::LayerFirst, layout),
                    };
                    let units = |p: u32| match gran {
                        Granularity::Page => u64::from(p),
                        Granularity::Token => u64::from(p) * 4,
                    };
                    // Random distinct destinations; sources random (repeats allowed), some
                    // runs contiguous so merging is exercised.
                    let n = 6;
                    let mut dst_units: Vec<u64> = Vec::new();
                    while dst_units.len() < n {
                        let d = rng.next_u64() % units(dst_spec.pages);
                        if !dst_units.contains(&d) {
                            dst_units.push(d);
                        }
                    }
                    let base = rng.next_u64() % (units(src_spec.pages) - 3);
                    let src_units: Vec<u64> = (0..n as u64)
                        .map(|i| {
                            if i < 3 {
                                base + i
                            } else {
                                rng.next_u64() % units(src_spec.pages)
                            }
                        })
                        .collect();
                    for layer in [None, Some(src_spec.layers as usize - 1)] {
                        let src = rng.bytes(src_spec.total_bytes() as usize);
                        let mut dst = vec![POISON; dst_spec.total_bytes() as usize];
                        let before = dst.clone();
                        let map = PageTransferMap::new(gran, &src_units, &dst_units).unwrap();
                        let pairs = map.pairs().to_vec();
                        let prepared = PreparedPageTransfer::new(
                            binding(&src, &src_spec, src_layout),
                            binding_mut(&mut dst, &dst_spec, dst_layout),
                            map,
                            direction,
                        )
                        .unwrap();
                        let group = Arc::new(PageTransferGroup::new(vec![prepared]).unwrap());
                        let ev = engine.submit(group, layer).unwrap();
                        ev.wait_all(Some(Duration::from_secs(10))).unwrap();
                        let layers: Vec<usize> = match layer {
                            None => (0..src_spec.layers as usize).collect(),
                            Some(l) => vec![l],
                        };
                        let want = expected(
                            &src, &before, &src_spec, &dst_spec, src_layout, dst_layout, gran,
                            &pairs, &layers,
                        );
                        assert!(
                            dst == want,
                            "{layout:?} {component:?} {direction:?} {gran:?} layer {layer:?}: bytes differ"
                        );
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 4 * 2 * 2 * 2);
}

fn kv_and_indexer(layers_kv: u32) -> (Vec<Vec<u8>>, Vec<PoolSpec>) {
    let kv = PoolSpec::new(Component::Kv, layers_kv, 2, 2, 8, Dtype::Bf16, 4, 8).unwrap();
    let ik = PoolSpec::new(Component::Indexer, layers_kv, 1, 1, 16, Dtype::Bf16, 4, 8).unwrap();
    let mut rng = XorShift::new(7);
    let bufs = vec![
        rng.bytes(kv.total_bytes() as usize),
        vec![POISON; kv.total_bytes() as usize],
        rng.bytes(ik.total_bytes() as usize),
        vec![POISON; ik.total_bytes() as usize],
    ];
    (bufs, vec![kv, ik])
}

fn group_of(bufs: &mut [Vec<u8>], specs: &[PoolSpec]) -> Arc<PageTransferGroup> {
    let members = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let map = PageTransferMap::new(Granularity::Page, &[1, 2, 5], &[0, 3, 7]).unwrap();
            let src = binding(&bufs[2 * i], s, HostLayout::LayerPageFirst);
            PreparedPageTransfer::new(
                src,
                binding_mut(&mut bufs[2 * i + 1], s, HostLayout::LayerFirst),
                map,
                Direction::Load,
            )
            .unwrap()
        })
        .collect();
    Arc::new(PageTransferGroup::new(members).unwrap())
}

#[test]
fn group_moves_kv_and_indexer_with_events_in_layer_order() {
    let (mut bufs, specs) = kv_and_indexer(4);
    let engine = CpuEngine::new(1).unwrap();
    engine.inject(Fault {
        nth: 0,
        layer: Some(0),
        action: FaultAction::Delay(Duration::from_millis(30)),
    });
    let ev = engine.submit(group_of(&mut bufs, &specs), None).unwrap();
    assert_eq!(
        ev.status(3).unwrap(),
        LayerStatus::Pending,
        "recording is not waiting"
    );
    ev.wait_layer(1, None).unwrap();
    ev.wait_all(None).unwrap();
    let t = ev.layer_times();
    assert!(
        t.windows(2).all(|w| w[0].unwrap() <= w[1].unwrap()),
        "events fire per layer in order"
    );
    assert!(t[0].unwrap() >= Duration::from_millis(30));
    for (i, s) in specs.iter().enumerate() {
        let g_src = s.geometry(HostLayout::LayerPageFirst);
        let g_dst = s.geometry(HostLayout::LayerFirst);
        let pb = s.page_bytes() as usize;
        for l in 0..u64::from(s.layers) {
            for p in 0..u64::from(s.planes_per_layer) {
                for (a, b) in [(1u64, 0u64), (2, 3), (5, 7)] {
                    let so = g_src.page_offset(p, l, a).unwrap() as usize;
                    let d_o = g_dst.page_offset(p, l, b).unwrap() as usize;
                    assert_eq!(bufs[2 * i][so..so + pb], bufs[2 * i + 1][d_o..d_o + pb]);
                }
            }
        }
    }
}

#[test]
fn injected_failure_leaves_later_layers_unpublished() {
    let (mut bufs, specs) = kv_and_indexer(4);
    let engine = CpuEngine::new(2).unwrap();
    engine.inject(Fault {
        nth: 1,
        layer: Some(2),
        action: FaultAction::Fail("injected".into()),
    });
    engine
        .submit(group_of(&mut bufs, &specs), None)
        .unwrap()
        .wait_all(None)
        .unwrap();
    let mut fresh = poisoned_destinations(&bufs);
    let ev = engine.submit(group_of(&mut fresh, &specs), None).unwrap();
    assert!(matches!(
        ev.wait_all(None),
        Err(Error::CopyFailed { layer: 2, .. })
    ));
    ev.wait_layer(1, None).unwrap();
    assert!(matches!(
        ev.wait_layer(3, None),
        Err(Error::CopyFailed { .. })
    ));
    assert!(ev.is_finished());
    assert_written_before(&fresh, &specs, 2);
}

/// The sources of `bufs` (KV and Indexer-K pairs) with destinations filled with [`POISON`].
fn poisoned_destinations(bufs: &[Vec<u8>]) -> Vec<Vec<u8>> {
    vec![
        bufs[0].clone(),
        vec![POISON; bufs[1].len()],
        bufs[2].clone(),
        vec![POISON; bufs[3].len()],
    ]
}

/// The KV destination's page 0 was written at layer `first_unwritten - 1` and never from
/// layer `first_unwritten` on (still [`POISON`]).
fn assert_written_before(fresh: &[Vec<u8>], specs: &[PoolSpec], first_unwritten: u64) {
    let g = specs[0].geometry(HostLayout::LayerFirst);
    let pb = specs[0].page_bytes() as usize;
    for l in first_unwritten..u64::from(specs[0].layers) {
        let o = g.page_offset(0, l, 0).unwrap() as usize;
        assert!(fresh[1][o..o + pb].iter().all(|&b| b == POISON));
    }
    let o = g.page_offset(0, first_unwritten - 1, 0).unwrap() as usize;
    assert!(fresh[1][o..o + pb].iter().any(|&b| b != POISON));
}

#[test]
fn a_worker_that_panics_fails_what_it_had_not_written_and_serves_on() {
    let (mut bufs, specs) = kv_and_indexer(4);
    // One worker: were the panic to end it, the next submission would never run.
    let engine = CpuEngine::new(1).unwrap();
    engine.inject(Fault {
        nth: 0,
        layer: Some(2),
        action: FaultAction::Panic("copy bug".into()),
    });
    let mut fresh = poisoned_destinations(&bufs);
    let ev = engine.submit(group_of(&mut fresh, &specs), None).unwrap();
    let Err(Error::CopyFailed {
        layer: 2, reason, ..
    }) = ev.wait_all(Some(Duration::from_secs(10)))
    else {
        panic!("the panicking layer did not fail")
    };
    assert!(
        reason.contains("copy worker panicked: copy bug"),
        "{reason}"
    );
    ev.wait_layer(1, None).unwrap();
    assert!(ev.wait_layer(3, None).is_err());
    assert_written_before(&fresh, &specs, 2);
    // The worker lives on: the next submission is copied whole.
    engine
        .submit(group_of(&mut bufs, &specs), None)
        .unwrap()
        .wait_all(Some(Duration::from_secs(10)))
        .unwrap();
}

#[test]
fn planning_errors() {
    let (bufs, specs) = kv_and_indexer(2);
    // Planning only: nothing is submitted, so shared borrows are enough.
    let b = |i: usize, s: &PoolSpec| binding(&bufs[i], s, HostLayout::LayerFirst);
    let map = PageTransferMap::new(Granularity::Page, &[0], &[8]).unwrap();
    assert!(matches!(
        PreparedPageTransfer::new(b(0, &specs[0]), b(1, &specs[0]), map, Direction::Load),
        Err(Error::OutOfRange { .. })
    ));
    let map = PageTransferMap::new(Granularity::Page, &[0], &[1]).unwrap();
    assert!(PreparedPageTransfer::new(
        b(0, &specs[0]),
        b(3, &specs[1]),
        map.clone(),
        Direction::Load
    )
    .is_err());
    assert!(
        PreparedPageTransfer::new(b(0, &specs[0]), b(0, &specs[0]), map, Direction::Load).is_err()
    );
    assert!(PageTransferGroup::new(vec![]).is_err());
}
