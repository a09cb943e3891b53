//! Kept selections against concurrent plans, ended requests and pages still loading.

use super::*;

#[test]
fn a_second_plan_of_a_layer_resolves_everything_while_the_first_reads_kept_slots() {
    let mut h = Harness::new(100, 400, false);
    h.add(0, 40, None);
    h.step(&[0], PS, 2, &mut |_, _, _| vec![1, 7]);
    let ids = [RequestId::new(0)];
    let u = SelectionUnit::new(PS, PS).unwrap();
    let (a, ta) = h.s.plan(0, &ids, &[1, 7], 2, u).unwrap();
    let ta = ta.to_vec();
    // The second plan cannot use the kept lists the first one reads (and replaces at its
    // finish): it pins through the directory, and both see the same slots.
    let (b, tb) = h.s.plan(0, &ids, &[7, 1], 2, u).unwrap();
    assert_eq!(tb.to_vec(), vec![ta[1], ta[0]]);
    h.s.ready(a, None).unwrap();
    h.s.ready(b, None).unwrap();
    h.s.validate().unwrap();
    h.s.finish(a).unwrap();
    h.s.validate().unwrap();
    // A's finish kept 1 and 7 again; B's pins still hold them too.
    let key = h.s.request(ids[0]).unwrap().key(7, 0);
    assert_eq!(h.s.directory().state(&key).unwrap().pins, 2);
    h.s.finish(b).unwrap();
    assert_eq!(h.s.directory().state(&key).unwrap().pins, 1);
    h.s.validate().unwrap();
    h.s.end_step().unwrap();
    h.s.finish_request(ids[0]).unwrap();
    h.assert_quiet();
}

#[test]
fn a_request_ended_while_a_plan_reads_its_kept_slots() {
    let mut h = Harness::new(100, 400, false);
    h.add(0, 40, None);
    h.add(1, 40, None);
    h.step(&[0, 1], PS, 2, &mut |_, _, _| vec![1, 7]);
    let ids = [RequestId::new(0), RequestId::new(1)];
    let u = SelectionUnit::new(PS, PS).unwrap();
    // Rows keep page 1 (a kept hit) and drop 7 for 3 and 4.
    let (p, _) = h.s.plan(0, &ids, &[1, 3, 1, 4], 2, u).unwrap();
    h.s.ready(p, None).unwrap();
    // Request 0 ends (its kept pages go back now): the plan's finish leaves its row alone and
    // keeps request 1's (page 1 as it was, 4 new; 7 given back).
    h.s.finish_request(ids[0]).unwrap();
    // Its id starts again (a namespace of a new version) while the plan still pins the old
    // pages; the plan's finish keeps nothing for the new request (another state).
    h.add(0, 40, None);
    h.s.finish(p).unwrap();
    h.s.validate().unwrap();
    assert_eq!(h.s.kept_pins(), 2 + 2 * u64::from(LAYERS - 1));
    assert!(h.s.kept_pages(ids[0], 0).unwrap().is_empty());
    h.s.finish_request(ids[0]).unwrap();
    let kept: Vec<u32> =
        h.s.kept_pages(ids[1], 0)
            .unwrap()
            .iter()
            .map(|k| k.page)
            .collect();
    assert_eq!(kept, vec![1, 4]);
    h.s.end_step().unwrap();
    h.add(2, 40, None);
    h.step(&[2, 1], PS, 2, &mut |_, _, _| vec![2, 5]);
    assert_eq!(h.s.kept_pins(), 4 * u64::from(LAYERS));
    h.s.finish_request(RequestId::new(2)).unwrap();
    h.s.finish_request(ids[1]).unwrap();
    h.assert_quiet();
}

/// The cpu engine with CUDA's stream semantics for `ready(plan, Some(stream))`: the wait is
/// the stream's, so the call returns while the loads are still in flight.
struct StreamOrdered(CpuEngine);

impl crate::transfer::engine::CopyEngine for StreamOrdered {
    fn has_streams(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "cpu, stream-ordered"
    }

    fn submit(
        &self,
        group: Arc<crate::transfer::prepared::PageTransferGroup>,
        layer: Option<usize>,
    ) -> crate::Result<Arc<crate::transfer::events::TransferEvents>> {
        self.0.submit(group, layer)
    }

    fn stream_wait(
        &self,
        _events: &crate::transfer::events::TransferEvents,
        _layer_index: usize,
        _stream: u64,
    ) -> crate::Result<()> {
        Ok(())
    }

    fn inject(&self, fault: crate::transfer::Fault) -> crate::Result<()> {
        crate::transfer::engine::CopyEngine::inject(&self.0, fault)
    }

    fn submitted(&self) -> u64 {
        crate::transfer::engine::CopyEngine::submitted(&self.0)
    }
}

#[test]
fn pages_still_loading_when_a_plan_finishes_are_not_kept_and_resolve_again() {
    let spec = PoolSpec::new(Component::Kv, 1, 2, 1, 4, Dtype::Bf16, PS, 100).unwrap();
    let host_spec = spec.with_pages(400).unwrap();
    // SAFETY: the test owns both buffers for as long as the scheduler lives and never
    // touches them itself.
    let (_dev_buf, dev) = unsafe { crate::testing::host_pool(&spec) }.unwrap();
    // SAFETY: as above.
    let (_host_buf, host) = unsafe { crate::testing::host_pool(&host_spec) }.unwrap();
    let cfg = SchedulerConfig {
        layers: LAYERS,
        page_size: PS,
        device_pages: 100,
        device_reserve: 0,
        host_pages: 400,
        prefetch: false,
        prefetch_depth: 1,
    };
    let engine = Arc::new(StreamOrdered(CpuEngine::new(1).unwrap()));
    let mut s = StepScheduler::new(cfg, dev, host, engine).unwrap();
    let ids = [RequestId::new(0)];
    let u = SelectionUnit::new(PS, PS).unwrap();
    s.add_request(ids[0], 40, None).unwrap(); // pages 0..10
    s.drain().unwrap();
    let kept = |s: &StepScheduler| -> Vec<u32> {
        s.kept_pages(ids[0], 0)
            .unwrap()
            .iter()
            .map(|k| k.page)
            .collect()
    };
    // Pages 1 and 7 kept; every other page evicted, so that new ones must load.
    let (p, _) = s.plan(0, &ids, &[1, 7], 2, u).unwrap();
    s.ready(p, None).unwrap();
    s.finish(p).unwrap();
    assert_eq!(kept(&s), vec![1, 7]);
    s.directory().evict(1000);
    // 3 and 9 load slowly; the stream-ordered ready returns before they land, so the plan
    // finishes with them Loading: they are not kept (the kept hits around them stay).
    s.inject_faults(
        Direction::Load,
        1,
        None,
        Some(std::time::Duration::from_millis(200)),
    );
    let (p, _) = s.plan(0, &ids, &[1, 3, 7, 9], 4, u).unwrap();
    s.ready(p, Some(0)).unwrap();
    s.finish(p).unwrap();
    assert_eq!(kept(&s), vec![1, 7]);
    assert_eq!(s.kept_pins(), 2);
    s.validate().unwrap();
    // Once landed, the next plan resolves them again (Ready: nothing loads) and keeps them.
    s.drain().unwrap();
    let (p, _) = s.plan(0, &ids, &[1, 3, 7, 9], 4, u).unwrap();
    s.ready(p, None).unwrap();
    let counts = s.finish(p).unwrap();
    assert_eq!((counts.ready, counts.loaded), (4, 0));
    assert_eq!(kept(&s), vec![1, 3, 7, 9]);
    assert_eq!(s.kept_pins(), 4);
    s.validate().unwrap();
    s.end_step().unwrap();
    s.finish_request(ids[0]).unwrap();
    s.drain().unwrap();
    assert_eq!(s.directory().stats().pins, 0);
}
