//! Edge cases of page transfer that the CUDA engines meet first, checked where they can run
//! without a GPU: rows that are not a multiple of 16 bytes, addresses past 4 GiB, bindings on
//! another CUDA device, and a failed layer's outcome for a stream wait.

use super::*;
use crate::error::Error;
use crate::layout::{Component, Dtype, HostLayout};
use crate::pool::PoolSpec;
use crate::testing::XorShift;
use std::sync::Arc;
use std::time::Duration;

use super::cpu_tests::binding_mut as bind;

#[test]
fn rows_of_132_bytes_round_trip_exactly() {
    // DeepSeek-V3.2's Indexer-K row: 128 FP8 values and a 4-byte scale, 132 bytes, which no
    // 16-byte vector copy divides.
    let engine = CpuEngine::new(2).unwrap();
    let mut rng = XorShift::new(132);
    for layout in [HostLayout::LayerFirst, HostLayout::LayerPageFirst] {
        for gran in [Granularity::Page, Granularity::Token] {
            let host_spec =
                PoolSpec::new(Component::Indexer, 3, 1, 1, 132, Dtype::Fp8E4m3, 4, 10).unwrap();
            let dev_spec = host_spec.with_pages(6).unwrap();
            assert_eq!(host_spec.token_bytes(), 132);
            let mut host = rng.bytes(host_spec.total_bytes() as usize);
            let original = host.clone();
            let mut dev = vec![0u8; dev_spec.total_bytes() as usize];
            let (src, dst): (Vec<u64>, Vec<u64>) = match gran {
                Granularity::Page => (vec![7, 2, 9], vec![0, 1, 5]),
                Granularity::Token => (vec![29, 8, 9, 10, 37], vec![0, 5, 6, 7, 23]),
            };
            let h = bind(&mut host, &host_spec, layout);
            let d = bind(&mut dev, &dev_spec, HostLayout::LayerFirst);
            for (a, b, s, t, dir) in [
                (&h, &d, &src, &dst, Direction::Load),
                (&d, &h, &dst, &src, Direction::Backup),
            ] {
                if dir == Direction::Backup {
                    // Nothing in flight: clear the host so the backup must bring every byte back.
                    host.fill(0);
                }
                let map = PageTransferMap::new(gran, s, t).unwrap();
                let p = PreparedPageTransfer::new(a.clone(), b.clone(), map, dir).unwrap();
                let g = Arc::new(PageTransferGroup::new(vec![p]).unwrap());
                let ev = engine.submit(g, None).unwrap();
                ev.wait_all(Some(Duration::from_secs(10))).unwrap();
            }
            // Every byte of every mapped unit on the device equals the host's, every layer.
            let g = host_spec.geometry(layout);
            let gd = dev_spec.geometry(HostLayout::LayerFirst);
            let unit_tokens = if gran == Granularity::Page { 4 } else { 1 };
            for (&s, &t) in src.iter().zip(&dst) {
                for layer in 0..3 {
                    for k in 0..unit_tokens {
                        let (sp, st) = ((s * unit_tokens + k) / 4, (s * unit_tokens + k) % 4);
                        let (dp, dt) = ((t * unit_tokens + k) / 4, (t * unit_tokens + k) % 4);
                        let so = g.token_offset(0, layer, sp, st).unwrap() as usize;
                        let dof = gd.token_offset(0, layer, dp, dt).unwrap() as usize;
                        assert_eq!(dev[dof..dof + 132], original[so..so + 132], "{layout:?}");
                        assert_eq!(host[so..so + 132], original[so..so + 132], "backup");
                    }
                }
            }
        }
    }
}

#[test]
fn offsets_beyond_4_gib_are_exact() {
    // A 21 GB host pool (never touched: the plan only computes addresses). The last page's
    // rows lie past 2^32 bytes from the base, for every layout.
    let spec = PoolSpec::new(Component::Kv, 2, 2, 8, 128, Dtype::Bf16, 64, 40_000).unwrap();
    let dev_spec = spec.with_pages(4).unwrap();
    let base = 1u64 << 40;
    for layout in [HostLayout::LayerFirst, HostLayout::LayerPageFirst] {
        // SAFETY: made-up addresses; nothing is copied, only planned.
        let host = unsafe {
            PageTransferBinding::new(base, spec.total_bytes(), &spec, layout, MemoryKind::Host)
        }
        .unwrap();
        let dev_base = 1u64 << 44;
        // SAFETY: as above.
        let dev = unsafe {
            PageTransferBinding::new(
                dev_base,
                dev_spec.total_bytes(),
                &dev_spec,
                HostLayout::LayerFirst,
                MemoryKind::Host,
            )
        }
        .unwrap();
        let last = u64::from(spec.pages) - 1;
        let map = PageTransferMap::new(Granularity::Token, &[last * 64 + 63], &[1]).unwrap();
        let p = PreparedPageTransfer::new(host, dev, map, Direction::Load).unwrap();
        let g = PageTransferGroup::new(vec![p]).unwrap();
        let geo = spec.geometry(layout);
        for layer in 0..2 {
            let ops = g.layer_ops(layer).unwrap();
            assert_eq!(ops.len(), 2, "one row per plane");
            for (plane, op) in ops.iter().enumerate() {
                let off = geo
                    .token_offset(plane as u64, layer as u64, last, 63)
                    .unwrap();
                assert!(off > 1 << 32, "{layout:?}: offset {off} must pass 4 GiB");
                assert_eq!(op.src, base + off, "{layout:?} layer {layer} plane {plane}");
                assert_eq!(op.len, 8 * 128 * 2);
            }
        }
    }
}

#[test]
fn device_memory_on_another_gpu_is_refused() {
    let spec = PoolSpec::new(Component::Kv, 1, 2, 1, 8, Dtype::Bf16, 4, 4).unwrap();
    let make = |device: Option<u32>, kind: MemoryKind| {
        // SAFETY: made-up addresses; nothing is copied.
        let b = unsafe {
            PageTransferBinding::new(
                1 << 30,
                spec.total_bytes(),
                &spec,
                HostLayout::LayerFirst,
                kind,
            )
        }
        .unwrap();
        match device {
            Some(d) => b.on_device(d),
            None => b,
        }
    };
    // SAFETY: as above (a second, disjoint made-up buffer).
    let host = unsafe {
        PageTransferBinding::new(
            1 << 34,
            spec.total_bytes(),
            &spec,
            HostLayout::LayerFirst,
            MemoryKind::Host,
        )
    }
    .unwrap();
    let group = |dev: PageTransferBinding| {
        let map = PageTransferMap::new(Granularity::Page, &[0], &[1]).unwrap();
        let p = PreparedPageTransfer::new(host.clone(), dev, map, Direction::Load).unwrap();
        PageTransferGroup::new(vec![p]).unwrap()
    };
    let ok = group(make(Some(1), MemoryKind::Device));
    cuda::check_devices(&ok, 1).unwrap();
    let e = cuda::check_devices(&ok, 0).unwrap_err();
    match e {
        Error::Config { field, value, .. } => {
            assert_eq!(
                (field.as_str(), value.as_str()),
                ("tensor.device", "cuda:1")
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(cuda::check_devices(&group(make(None, MemoryKind::Device)), 0).is_err());
}

#[test]
fn a_failed_layer_is_an_error_for_its_consumer() {
    let ev = TransferEvents::new(7, "kernel", vec![0, 1, 2]);
    assert!(!cuda::layer_outcome(&ev, 0).unwrap());
    ev.record_done(0);
    ev.record_failed_from(1, "launch failed");
    assert!(cuda::layer_outcome(&ev, 0).unwrap());
    for layer in [1, 2] {
        match cuda::layer_outcome(&ev, layer) {
            Err(Error::TransferFailed { id: 7, reason }) => assert_eq!(reason, "launch failed"),
            other => panic!("layer {layer}: {other:?}"),
        }
    }
}

#[test]
fn kernel_lanes_follow_the_op_length() {
    // About one 16-byte word a thread, a power of two from 4 to the block of 512.
    for (len, lanes) in [
        (0, 4),
        (64, 4),
        (132, 8),
        (256, 16),
        (656, 32),
        (4096, 256),
        (16 << 10, 512),
        (64 << 10, 512),
    ] {
        assert_eq!(cuda::lanes_for(len), lanes, "{len} bytes");
    }
    // Groups fill blocks: 128 groups of 4 per block; capped at 4 blocks per allowed SM.
    assert_eq!(cuda::blocks_for(128, 4, 8), 1);
    assert_eq!(cuda::blocks_for(129, 4, 8), 2);
    assert_eq!(cuda::blocks_for(1_000_000, 4, 8), 32);
    assert_eq!(cuda::blocks_for(3, 512, 8), 3);
    assert_eq!(cuda::blocks_for(0, 512, 8), 1);
}

#[test]
fn split_pages_move_each_tokens_parts_exactly() {
    // DeepSeek-V3.2's Indexer-K page: every token's 128 FP8 values, then every token's fp32
    // scale. A token's row is two ranges of its page; a token copy must move both, and touch
    // nothing else.
    use crate::row::{PageLayout, DEEPSEEK_V32_INDEXER as parts};
    let engine = CpuEngine::new(2).unwrap();
    let mut rng = XorShift::new(8448);
    for layout in [HostLayout::LayerFirst, HostLayout::LayerPageFirst] {
        let host_spec = PoolSpec::new(Component::Indexer, 3, 1, 1, 132, Dtype::Fp8E4m3, 4, 10)
            .unwrap()
            .with_row(&parts, PageLayout::ValuesThenScales)
            .unwrap();
        let dev_spec = host_spec.with_pages(6).unwrap();
        assert_eq!(dev_spec.row, host_spec.row, "with_pages keeps the format");
        let original = rng.bytes(host_spec.total_bytes() as usize);
        let mut host = original.clone();
        let mut dev = vec![0u8; dev_spec.total_bytes() as usize];
        // Runs of consecutive tokens (8, 9, 10 -> 5, 6, 7) and lone ones.
        let (src, dst) = (vec![29u64, 8, 9, 10, 37], vec![0u64, 5, 6, 7, 23]);
        let h = bind(&mut host, &host_spec, layout);
        let d = bind(&mut dev, &dev_spec, HostLayout::LayerFirst);
        let map = PageTransferMap::new(Granularity::Token, &src, &dst).unwrap();
        let p = PreparedPageTransfer::new(h, d, map, Direction::Load).unwrap();
        // Per layer: values of the run and of each lone token, then scales the same way.
        assert_eq!(p.map().units(), 5);
        let g = Arc::new(PageTransferGroup::new(vec![p]).unwrap());
        let ops = g.layer_ops(0).unwrap();
        assert_eq!(ops.len(), 2 * 3, "{ops:?}");
        engine
            .submit(g, None)
            .unwrap()
            .wait_all(Some(Duration::from_secs(10)))
            .unwrap();
        let gs = host_spec.geometry(layout);
        let gd = dev_spec.geometry(HostLayout::LayerFirst);
        let mut expected = vec![0u8; dev.len()];
        for (&s, &t) in src.iter().zip(&dst) {
            for layer in 0..3 {
                for (part, len) in [(0u64, 128usize), (1, 4)] {
                    let so = gs.part_offset(0, layer, s / 4, s % 4, part).unwrap() as usize;
                    let dof = gd.part_offset(0, layer, t / 4, t % 4, part).unwrap() as usize;
                    expected[dof..dof + len].copy_from_slice(&original[so..so + len]);
                }
            }
        }
        assert!(
            dev == expected,
            "{layout:?}: a part landed elsewhere or was missed"
        );
    }
}

#[test]
fn a_split_page_does_not_mix_with_an_interleaved_one() {
    use crate::row::{PageLayout, DEEPSEEK_V32_INDEXER};
    let plain = PoolSpec::new(Component::Indexer, 1, 1, 1, 132, Dtype::Fp8E4m3, 4, 4).unwrap();
    let split = plain
        .with_row(&DEEPSEEK_V32_INDEXER, PageLayout::ValuesThenScales)
        .unwrap();
    let mut a = vec![0u8; plain.total_bytes() as usize];
    let mut b = vec![0u8; split.total_bytes() as usize];
    let map = PageTransferMap::new(Granularity::Page, &[0], &[1]).unwrap();
    let e = PreparedPageTransfer::new(
        bind(&mut a, &plain, HostLayout::LayerFirst),
        bind(&mut b, &split, HostLayout::LayerFirst),
        map,
        Direction::Load,
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::Plan { ref field, .. } if field == "dst.row_format"),
        "{e:?}"
    );
}

/// The CPU cost of building a token-granular copy list, for profiling (the CUDA engines build
/// it on the submitting thread): `cargo test --release --lib token_ops_cost -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn token_ops_cost() {
    let spec = PoolSpec::new(Component::Indexer, 1, 1, 1, 256, Dtype::Fp8E4m3, 16, 65_536).unwrap();
    let n = spec.token_slots() as usize;
    let mut a = vec![0u8; spec.total_bytes() as usize];
    let mut b = vec![0u8; spec.total_bytes() as usize];
    let mut rng = XorShift::new(7);
    let mut src: Vec<u64> = (0..n as u64).collect();
    let mut dst = src.clone();
    for v in [&mut src, &mut dst] {
        for i in (1..n).rev() {
            v.swap(i, rng.below(i as u64 + 1) as usize);
        }
    }
    let map = PageTransferMap::new(Granularity::Token, &src, &dst).unwrap();
    let p = PreparedPageTransfer::new(
        bind(&mut a, &spec, HostLayout::LayerFirst),
        bind(&mut b, &spec, HostLayout::LayerFirst),
        map,
        Direction::Load,
    )
    .unwrap();
    let g = PageTransferGroup::new(vec![p]).unwrap();
    let mut best = f64::MAX;
    for _ in 0..10 {
        let t = std::time::Instant::now();
        let ops = g.layer_ops(0).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
        assert!(ops.len() > n / 2, "random rows rarely merge");
    }
    eprintln!("{:.1} ns per token row ({n} rows)", best * 1e9 / n as f64);
}
