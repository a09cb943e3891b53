//! The step end to end: bytes read through loads and evictions, the CPU split, block and
//! token modes, failed loads and backups, prefetch and its accuracy, shared prompts.

use super::*;

#[test]
fn a_step_reads_the_right_bytes_through_loads_and_evictions() {
    let mut h = three_requests(false);
    let mut loads = 0;
    for step in 0..12 {
        let (failed, rec) = three_requests_step(&mut h, step);
        assert!(failed.is_empty());
        assert!(rec.pages <= rec.selected);
        loads += rec.loaded;
        assert_eq!(rec.layers, u64::from(LAYERS));
    }
    assert!(loads > 0, "the budget must force loads");
    h.assert_quiet();
    for rid in 0..3 {
        h.s.finish_request(RequestId::new(rid)).unwrap();
    }
    assert_eq!(h.s.directory().stats().objects, 0);
}

#[test]
fn the_cpu_split_sums_to_the_step_cpu_and_counts_where_work_happened() {
    let mut h = three_requests(true);
    let mut loaded_steps = 0;
    for step in 0..8 {
        let (_, rec) = three_requests_step(&mut h, step);
        let calls = rec.cpu_plan_ns
            + rec.cpu_ready_ns
            + rec.cpu_finish_ns
            + rec.cpu_append_ns
            + rec.cpu_end_step_ns;
        assert_eq!(calls, rec.cpu_ns, "{rec:?}");
        assert!(rec.cpu_rows_ns + rec.cpu_resolve_ns + rec.cpu_submit_ns <= rec.cpu_plan_ns);
        assert!(rec.cpu_prefetch_ns <= rec.cpu_plan_ns + rec.cpu_end_step_ns);
        for (name, v) in [
            ("plan", rec.cpu_plan_ns),
            ("ready", rec.cpu_ready_ns),
            ("finish", rec.cpu_finish_ns),
            ("append", rec.cpu_append_ns),
            ("end_step", rec.cpu_end_step_ns),
            ("rows", rec.cpu_rows_ns),
            ("prefetch", rec.cpu_prefetch_ns),
        ] {
            assert!(v > 0, "cpu_{name}_ns is 0: {rec:?}");
        }
        if rec.loaded > 0 {
            loaded_steps += 1;
            assert!(rec.cpu_resolve_ns > 0 && rec.cpu_submit_ns > 0, "{rec:?}");
        }
    }
    assert!(loaded_steps > 0, "the budget must force loads");
    // The running totals fold the split like every other counter.
    let t = h.s.totals();
    assert!(t.cpu_rows_ns > 0 && t.cpu_plan_ns <= t.cpu_ns);
    h.assert_quiet();
}

#[test]
fn block_mode_reads_whole_pages_so_read_amplification_is_one() {
    let mut h = Harness::new(60, 400, false);
    h.add(0, 60, None);
    h.add(1, 44, None);
    let mut tot = StepRecord::default();
    for step in 0..6 {
        let (_, rec) = h.step(&[0, 1], PS, 3, &mut |r, l, len| {
            blocks(step * 5 + r + u64::from(l) * 7, len, PS, 3)
        });
        tot.fold(&rec);
    }
    assert!(tot.bytes_transferred > 0);
    assert_eq!(tot.bytes_transferred, tot.bytes_needed_of_transferred);
    assert!((tot.read_amplification().unwrap() - 1.0).abs() < 1e-12);
}

#[test]
fn token_mode_dedups_tokens_into_pages_and_counts_sparse_reads() {
    let mut h = Harness::new(56, 400, false);
    h.add(0, 64, None);
    h.add(1, 64, None);
    // Tokens 1, 2 (page 0), 17 (page 4), 33 (page 8), 62 (page 15): four pages, five tokens.
    let (failed, rec) = h.step(&[0], 1, 6, &mut |_, _, _| vec![1, 2, 17, 33, 62, -1]);
    assert!(failed.is_empty());
    assert_eq!(rec.selected, 5 * u64::from(LAYERS));
    assert_eq!(rec.pages, 4 * u64::from(LAYERS));
    let tb = h.s.object_bytes() / u64::from(PS);
    assert_eq!(rec.bytes_needed, 5 * u64::from(LAYERS) * tb);
    // Request 1's prefill (16 pages x 3 layers into 56 slots) evicted request 0's written-
    // through pages, so whole pages moved for one or two tokens each: amplification above 1.
    assert!(rec.bytes_transferred > 0, "{rec:?}");
    assert!(rec.read_amplification().unwrap() > 1.0, "{rec:?}");
    h.assert_quiet();
}

#[test]
fn blocks_larger_than_pages_fill_several_cells() {
    let mut h = Harness::new(60, 400, false);
    h.add(0, 37, None);
    // 8-token blocks over 4-token pages: block 4 covers tokens 32..40, of which 32..38 exist
    // after the append (38 tokens): pages 8 and 9.
    let (failed, rec) = h.step(&[0], 2 * PS, 2, &mut |_, _, _| vec![0, 4]);
    assert!(failed.is_empty());
    assert_eq!(rec.pages, 4 * u64::from(LAYERS));
    h.assert_quiet();
}

#[test]
fn one_failed_load_is_retried_and_nobody_fails() {
    for take in [false, true] {
        for csr in [false, true] {
            one_failed_load_retried(take, csr, false);
        }
    }
    // A copy worker that panics on a load (a bug in the copy path) fails it the same way.
    one_failed_load_retried(false, false, true);
}

/// Arms `count` load (or backup) faults: failures, or panics of the engine's worker.
fn arm(s: &mut StepScheduler, d: Direction, count: u32, layer: Option<u16>, panic: bool) {
    match panic {
        true => s.inject_panics(d, count, layer),
        false => s.inject_faults(d, count, layer, None),
    }
}

fn one_failed_load_retried(take_tables: bool, csr: bool, panic: bool) {
    let mut h = Harness::new(40, 400, false);
    h.take_tables = take_tables;
    h.csr = csr;
    for rid in 0..3 {
        h.add(rid, 40, None);
    }
    arm(&mut h.s, Direction::Load, 1, None, panic);
    let mut retried = 0;
    for step in 0..4 {
        let (failed, rec) = h.step(&[0, 1, 2], PS, 4, &mut |r, l, len| {
            blocks(step * 31 + r * 3 + u64::from(l), len, PS, 4)
        });
        assert!(failed.is_empty());
        retried += rec.retried_loads;
    }
    assert_eq!(retried, 1);
    assert_eq!(h.s.totals().failed_loads, 1);
    h.assert_quiet();
}

#[test]
fn a_layer_whose_loads_fail_twice_fails_only_the_requests_that_needed_them() {
    for take in [false, true] {
        for csr in [false, true] {
            loads_failing_twice(take, csr, false);
        }
    }
    loads_failing_twice(true, false, true);
}

fn loads_failing_twice(take_tables: bool, csr: bool, panic: bool) {
    let mut h = Harness::new(40, 400, false);
    h.take_tables = take_tables;
    h.csr = csr;
    for rid in 0..3 {
        h.add(rid, 40, None);
    }
    // Request 2 reads only its local window (always on the device); 0 and 1 read old blocks.
    let mut sel = |r: u64, _l: u16, len: u64| {
        let n = len.div_ceil(u64::from(PS)) as i64;
        if r == 2 {
            vec![n - 1]
        } else {
            vec![0, 1, 2, n - 1]
        }
    };
    arm(&mut h.s, Direction::Load, 2, Some(1), panic);
    let (failed, rec) = h.step(&[0, 1, 2], PS, 4, &mut sel);
    assert_eq!(failed, vec![0, 1]);
    assert_eq!(rec.failed_requests, 2);
    assert_eq!(rec.retried_loads, 1);
    h.s.validate().unwrap();
    // What stays pinned is what the rows keep for the next step: none at the failed layer.
    assert_eq!(h.s.directory().stats().pins, h.s.kept_pins());
    for rid in [0, 1] {
        assert!(h.s.kept_pages(RequestId::new(rid), 1).unwrap().is_empty());
        h.s.finish_request(RequestId::new(rid)).unwrap();
    }
    // The survivor keeps its one page at every layer.
    assert_eq!(h.s.directory().stats().pins, u64::from(LAYERS));
    // The survivor goes on.
    for _ in 0..3 {
        let (failed, _) = h.step(&[2], PS, 4, &mut sel);
        assert!(failed.is_empty());
    }
    h.assert_quiet();
}

#[test]
fn a_failed_backup_is_retried_and_the_pages_become_evictable() {
    for panic in [false, true] {
        let mut h = Harness::new(40, 400, false);
        arm(&mut h.s, Direction::Backup, 1, None, panic);
        h.add(0, 16, None);
        for _ in 0..3 {
            h.step(&[0], PS, 2, &mut |_, _, len| blocks(1, len, PS, 2));
        }
        h.assert_quiet();
        assert_eq!(h.s.totals().failed_backups, 1);
        let st = h.s.directory().stats();
        // 4 full pages x 3 layers backed up on the retry; the page being written has no copy.
        assert_eq!(st.host_ready, 4 * LAYERS as usize);
    }
}

/// Request `r`'s selection that stays from step to step: the sink, block `2 + r`, block 5
/// and the last (which moves only when a page starts).
fn steady_blocks(r: u64, len: u64) -> Vec<i64> {
    let n = len.div_ceil(u64::from(PS)) as i64;
    vec![0, 2 + r as i64, 5, n - 1]
}

#[test]
fn prefetch_predicts_a_steady_selection_and_records_its_accuracy() {
    let mut h = Harness::new(56, 400, true);
    // Kept selections would hold last step's pages on the device: nothing to load ahead.
    h.s.set_keep_selections(false).unwrap();
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    let (_, first) = h.step(&[0, 1], PS, 4, &mut sel);
    assert_eq!(first.prefetch_hits, 0);
    // Everything evictable leaves the device (a prefetch pins only what it loads), so the
    // later layers' prefetches, issued by the plans before them, have loads to make.
    h.s.directory().evict(1000);
    let (_, second) = h.step(&[0, 1], PS, 4, &mut sel);
    // Every layer's selection was predicted (the last block did not move within a page), and
    // what prefetch loaded was all read.
    assert_eq!(second.prefetch_hits, second.pages);
    assert!((second.prefetch_accuracy().unwrap() - 1.0).abs() < 1e-12);
    assert!(second.prefetch_loaded > 0 && second.prefetch_pinned_peak > 0);
    assert_eq!(second.prefetch_wasted, 0);
    h.assert_quiet();
}

#[test]
fn with_prefetch_on_kept_selections_are_the_prediction() {
    let mut h = Harness::new(56, 400, true);
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    let (_, first) = h.step(&[0, 1], PS, 4, &mut sel);
    assert_eq!((first.prefetch_predicted, first.prefetch_hits), (0, 0));
    assert!(
        h.s.kept_pins() > 0,
        "prefetch on no longer turns kept selections off"
    );
    let (_, second) = h.step(&[0, 1], PS, 4, &mut sel);
    // Last step's selection stayed on the device: predicted, all read, nothing loaded for it.
    assert_eq!(second.prefetch_predicted, second.pages);
    assert_eq!(second.prefetch_hits, second.pages);
    assert_eq!(
        (
            second.loaded,
            second.prefetch_loaded,
            second.prefetch_wasted
        ),
        (0, 0, 0)
    );
    assert_eq!(second.prefetch_pinned_peak, 0);
    // A selection that moves: the dropped pages were predicted but not read.
    let mut moved = |r: u64, _l: u16, len: u64| {
        let n = len.div_ceil(u64::from(PS)) as i64;
        vec![0, 3 + r as i64, 6, n - 1]
    };
    let (_, third) = h.step(&[0, 1], PS, 4, &mut moved);
    assert_eq!(third.prefetch_predicted, second.pages);
    // Two of each row's four pages moved.
    assert_eq!(third.prefetch_hits, third.pages / 2);
    assert!(third.prefetch_accuracy().unwrap() < 1.0);
    h.assert_quiet();
}

#[test]
fn with_prefetch_on_kept_token_selections_are_the_prediction() {
    let mut h = Harness::new(56, 400, true);
    h.add(0, 64, None);
    // Tokens 0-1, 9, 20-22 and the last: pages 0, 2, 5 and the last, as above.
    let mut sel = |_r: u64, _l: u16, len: u64| vec![0, 1, 9, 20, 21, 22, len as i64 - 1];
    h.step(&[0], 1, 7, &mut sel);
    let (_, second) = h.step(&[0], 1, 7, &mut sel);
    assert!(h.s.kept_pins() > 0);
    assert_eq!(second.prefetch_predicted, second.pages);
    assert_eq!(
        (second.prefetch_hits, second.prefetch_loaded),
        (second.pages, 0)
    );
    h.assert_quiet();
}

#[test]
fn kept_pages_given_back_stay_predicted() {
    let mut h = Harness::new(56, 400, true);
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    h.step(&[0, 1], PS, 4, &mut sel);
    h.step(&[0, 1], PS, 4, &mut sel);
    assert!(h.s.kept_pins() > 0);
    // Giving the kept pages back (what making room does) hands them to prefetch: once
    // evicted, the later layers' prefetches load them again.
    h.s.set_keep_selections(false).unwrap();
    h.s.directory().evict(1000);
    let (_, rec) = h.step(&[0, 1], PS, 4, &mut sel);
    assert!(rec.prefetch_loaded > 0, "{rec:?}");
    assert_eq!(rec.prefetch_wasted, 0);
    h.assert_quiet();
}

#[test]
fn kept_pages_hold_at_most_half_the_device() {
    // Three requests x three layers x four pages = 36 pages a step to keep, on 40 slots.
    let mut h = Harness::new(40, 400, false);
    for r in 0..3 {
        h.add(r, 40, None);
    }
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    let mut kept_any = false;
    for _ in 0..4 {
        h.step(&[0, 1, 2], PS, 4, &mut sel);
        assert!(h.s.kept_pins() <= 20, "{} kept pins", h.s.kept_pins());
        kept_any |= h.s.kept_pins() > 0;
        h.s.validate().unwrap();
    }
    // The layers that fit keep theirs; the others resolve every page, as without keeping.
    assert!(kept_any);
    h.assert_quiet();
}

#[test]
fn a_kept_plan_scores_the_prefetch_of_a_plan_that_did_not_keep() {
    let mut h = Harness::new(56, 400, true);
    h.s.set_keep_selections(false).unwrap();
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    h.step(&[0, 1], PS, 4, &mut sel);
    h.s.directory().evict(1000);
    // The layers' prefetches come from the unkept step's selections; kept plans consume them.
    h.s.set_keep_selections(true).unwrap();
    let (_, rec) = h.step(&[0, 1], PS, 4, &mut sel);
    assert!(rec.prefetch_loaded > 0);
    assert_eq!(rec.prefetch_hits, rec.pages);
    assert_eq!(rec.prefetch_wasted, 0);
    assert!(h.s.kept_pins() > 0);
    // From here the kept pages are the prediction: no more prefetch loads.
    let (_, next) = h.step(&[0, 1], PS, 4, &mut sel);
    assert_eq!((next.prefetch_loaded, next.prefetch_hits), (0, next.pages));
    assert_eq!(next.prefetch_predicted, next.pages);
    h.assert_quiet();
}

#[test]
fn shared_prompts_are_read_by_every_request_and_outlive_them() {
    let mut h = Harness::new(60, 400, true);
    let prefix = h.add_prompt(1000, 3);
    h.add(0, 20, prefix);
    h.add(1, 14, prefix);
    for step in 0..4 {
        let (failed, _) = h.step(&[0, 1], PS, 4, &mut |r, l, len| {
            blocks(step + r + u64::from(l), len, PS, 4)
        });
        assert!(failed.is_empty());
    }
    assert!(h.s.drop_prompt(1000).is_err(), "read by running requests");
    for rid in [0, 1] {
        h.s.finish_request(RequestId::new(rid)).unwrap();
    }
    h.assert_quiet();
    assert_eq!(h.s.directory().stats().objects, 3 * LAYERS as usize);
    h.s.drop_prompt(1000).unwrap();
    assert_eq!(h.s.directory().stats().objects, 0);
}

#[test]
fn a_plans_wait_is_not_a_request_started_again_under_its_id() {
    // A plan of request 0 waits on a slow load of its prompt's pages (which outlive it) after
    // request 0 ended and started again: the wait is the plan's, not the new request's.
    let mut h = Harness::new(64, 400, false);
    let prefix = h.add_prompt(1000, 3);
    h.add(0, 20, prefix);
    h.s.end_step().unwrap();
    h.s.drain().unwrap();
    h.s.directory().evict(1000);
    let delay = std::time::Duration::from_millis(50);
    h.s.inject_faults(Direction::Load, 1, None, Some(delay));
    let rid = RequestId::new(0);
    let u = SelectionUnit::new(PS, PS).unwrap();
    let plan = h.s.plan(0, &[rid], &[0, 1, 2], 3, u).unwrap().0; // the prompt's pages
    h.s.finish_request(rid).unwrap();
    h.add(0, 20, prefix);
    assert!(h.s.ready(plan, None).unwrap().failed.is_empty());
    let counts = h.s.finish(plan).unwrap();
    assert!(
        counts.exposed_wait_ns >= delay.as_nanos() as u64,
        "the plan waited"
    );
    assert_eq!(h.s.request(rid).unwrap().exposed_wait_ns, 0);
    h.s.end_step().unwrap();
    h.s.finish_request(rid).unwrap();
    h.s.drop_prompt(1000).unwrap();
    h.assert_quiet();
}
