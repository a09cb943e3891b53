//! Row forms planned alike: CSR against padded, int32 against int64, sorted against unsorted,
//! counted page rows in any order, token rows mapped to counted pages.

use super::*;

/// Request `r`'s row at layer `l` (`len` tokens) in `step`: 0 to 5 blocks of a page (of at
/// most `k`), or twice as many tokens, varying with all four.
fn ragged_row(tokens: bool, step: u64, (r, l, len): (u64, u16, u64), k: usize) -> Vec<i64> {
    let n = ((r + step + u64::from(l)) % 6) as usize; // 0 to 5 entries
    if tokens {
        (0..n as u64 * 2)
            .map(|i| ((i * 7 + r * 5 + step) % len) as i64)
            .collect()
    } else {
        let mut b = blocks(step * 13 + r * 3 + u64::from(l), len, PS, k);
        b.truncate(n);
        b
    }
}

#[test]
fn ragged_rows_as_csr_plan_as_their_padded_rows_do() {
    // Requests select different numbers of blocks (and some none at a layer); token rows,
    // as they are or mapped to counted pages, are ragged too. Through `plan_csr` each step
    // must read the same bytes (`step` checks every one through the table) and count the
    // same as the padded rows, with kept selections across steps. Each builder reads CSR rows
    // where they lie: blocks (`kept_rows`), token rows (`kept_entry_rows`), mapped ones
    // (`kept_rows` with counts).
    for (tokens, map_tokens) in [(false, false), (true, false), (true, true)] {
        let mut padded = three_requests(false);
        let mut csr = three_requests(false);
        csr.csr = true;
        for h in [&mut padded, &mut csr] {
            h.map_tokens = map_tokens;
            h.take_tables = tokens; // both ways of reading the table
        }
        let (unit, k) = if tokens { (1, 12) } else { (PS, 5) };
        for step in 0..8u64 {
            let mut sel = |r: u64, l: u16, len: u64| {
                let mut row = ragged_row(tokens, step, (r, l, len), k);
                row.dedup();
                row
            };
            if step == 5 {
                // A layer's load fails once: its retry moves cells, reported in each form.
                for h in [&mut padded, &mut csr] {
                    h.s.inject_faults(Direction::Load, 1, Some(2), None);
                }
            }
            let (f1, a) = padded.step(&[0, 1, 2], unit, k, &mut sel);
            let (f2, b) = csr.step(&[0, 1, 2], unit, k, &mut sel);
            if step == 5 {
                assert_eq!(
                    (a.retried_loads, b.retried_loads),
                    (1, 1),
                    "tokens {tokens}, mapped {map_tokens}"
                );
            }
            for h in [&mut padded, &mut csr] {
                h.s.drain().unwrap();
            }
            assert!(f1.is_empty() && f2.is_empty());
            let key = |r: &StepRecord| (r.selected, r.pages, r.bytes_needed, r.loaded, r.ready);
            assert_eq!(
                key(&a),
                key(&b),
                "step {step}, tokens {tokens}, mapped {map_tokens}"
            );
        }
        assert_eq!(padded.s.kept_pins(), csr.s.kept_pins());
        for h in [&mut padded, &mut csr] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

#[test]
fn int32_rows_plan_as_their_int64_rows_do() {
    // The same rows handed over as int32 must read the same bytes (`step` checks every one
    // through the table) and count the same as int64 rows, in every builder: block rows
    // (`kept_rows`), token rows sorted (the run scan) and not (`kept_entry_rows`), mapped to
    // counted pages, through the directory (kept selections off: `selection_rows`), padded and
    // as CSR, with padding (-1) in the rows.
    for (tokens, map_tokens, keep, csr, sorted) in [
        (false, false, true, false, true),
        (false, false, true, true, false),
        (true, false, true, false, true),
        (true, false, true, true, true),
        (true, false, true, true, false),
        (true, true, true, false, true),
        (true, false, false, false, false),
        (false, false, false, true, true),
    ] {
        let mut wide = three_requests(false);
        let mut narrow = three_requests(false);
        narrow.int32 = true;
        for h in [&mut wide, &mut narrow] {
            h.map_tokens = map_tokens;
            h.csr = csr;
            h.s.set_keep_selections(keep).unwrap();
        }
        let (unit, k) = if tokens { (1, 12) } else { (PS, 5) };
        let case = format!("tokens {tokens}, mapped {map_tokens}, keep {keep}, csr {csr}");
        for step in 0..8u64 {
            let mut sel = |r: u64, l: u16, len: u64| {
                let mut row = ragged_row(tokens, step, (r, l, len), k);
                if sorted {
                    row.sort_unstable();
                } else {
                    row.reverse();
                }
                row
            };
            let (f1, a) = wide.step(&[0, 1, 2], unit, k, &mut sel);
            let (f2, b) = narrow.step(&[0, 1, 2], unit, k, &mut sel);
            // Write-throughs landed before the next step on both (what is evictable, and so
            // what loads, follows them).
            for h in [&mut wide, &mut narrow] {
                h.s.drain().unwrap();
            }
            assert!(f1.is_empty() && f2.is_empty());
            assert_eq!(plan_counts(&a), plan_counts(&b), "step {step}, {case}");
        }
        assert_eq!(wide.s.kept_pins(), narrow.s.kept_pins(), "{case}");
        for h in [&mut wide, &mut narrow] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

/// What a step's plans selected, found, loaded and counted as needed: equal for two ways of
/// handing over the same rows.
fn plan_counts(r: &StepRecord) -> [u64; 7] {
    [
        r.selected,
        r.pages,
        r.ready,
        r.loaded,
        r.bytes_needed,
        r.bytes_transferred,
        r.bytes_needed_of_transferred,
    ]
}

/// Two harnesses that planned the same rows handed over differently: after the step (its
/// write-throughs landed on both), nothing failed, both counted alike, kept hits were read,
/// and every request keeps the same pages at the same slots.
fn assert_planned_alike(
    (x, y): (&mut Harness, &mut Harness),
    (f1, a): (&[u64], &StepRecord),
    (f2, b): (&[u64], &StepRecord),
    case: &str,
) {
    for h in [&mut *x, &mut *y] {
        h.s.drain().unwrap();
    }
    assert!(f1.is_empty() && f2.is_empty(), "{case}");
    assert_eq!(plan_counts(a), plan_counts(b), "{case}");
    assert!(a.ready > 0 && a.selected > a.pages, "{case}: {a:?}");
    for r in 0..3 {
        for l in 0..LAYERS {
            let id = RequestId::new(r);
            assert_eq!(
                x.s.kept_pages(id, l),
                y.s.kept_pages(id, l),
                "{case}, request {r}, layer {l}"
            );
        }
    }
}

/// Request `r`'s block row at layer `l` (`len` tokens) in `step`: `k` pages drawn with
/// repeats from a pool that changes a page a step (so rows keep most pages, drop some and
/// pick new ones), the request's last page (partial at most lengths) in about half the rows.
fn churning_row(step: u64, (r, l, len): (u64, u16, u64), k: usize) -> Vec<i64> {
    let pages = len.div_ceil(u64::from(PS));
    let seed = r * 31 + u64::from(l) * 7;
    let pool: Vec<u64> = (0..4)
        .map(|i| (seed + i * 5 + (step + i) / 4) % pages)
        .collect();
    let mut row: Vec<i64> = (0..k as u64)
        .map(|j| pool[((j * 3 + step + seed) % 4) as usize] as i64)
        .collect();
    if (step + seed) % 2 == 0 {
        row[0] = pages as i64 - 1;
    }
    row
}

#[test]
fn sorted_block_rows_plan_as_their_unsorted_rows_do() {
    // Block rows in page order take the merge by runs (`merge_sorted_block_row`); the same
    // rows out of order take the general merge. Both must read the same bytes (`step` checks
    // every cell through the table) and keep, load, count and give back the same pages:
    // rows with repeated pages, the request's partial last page, pages dropped before and
    // after the row's last, as int64 and int32 rows, padded and as CSR.
    for (int32, csr) in [(false, false), (true, false), (false, true)] {
        let mut sorted = three_requests(false);
        let mut shuffled = three_requests(false);
        for h in [&mut sorted, &mut shuffled] {
            (h.int32, h.csr) = (int32, csr);
        }
        let k = 6;
        for step in 0..12u64 {
            let (f1, a) = sorted.step(&[0, 1, 2], PS, k, &mut |r, l, len| {
                let mut row = churning_row(step, (r, l, len), k);
                row.sort_unstable();
                row
            });
            let (f2, b) = shuffled.step(&[0, 1, 2], PS, k, &mut |r, l, len| {
                let mut row = churning_row(step, (r, l, len), k);
                row.sort_unstable();
                row.rotate_left(1); // out of order unless every page is the same
                row
            });
            let case = format!("step {step}, int32 {int32}, csr {csr}");
            assert_planned_alike((&mut sorted, &mut shuffled), (&f1, &a), (&f2, &b), &case);
        }
        let loaded = sorted.s.totals().loaded;
        assert!(loaded > 3 * u64::from(LAYERS) * 4, "{loaded} pages loaded");
        for h in [&mut sorted, &mut shuffled] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

/// Splits every cell counting two tokens or more into two cells of the same page (a page named
/// twice, its tokens split between them).
fn split_counts(row: &mut Vec<(i64, u32)>) {
    *row = row
        .iter()
        .flat_map(|&(p, c)| {
            let first = c.div_ceil(2);
            std::iter::once((p, first)).chain((c > first).then_some((p, c - first)))
        })
        .collect();
}

/// [`split_counts`], then out of page order.
fn split_counts_rotated(row: &mut Vec<(i64, u32)>) {
    split_counts(row);
    if !row.is_empty() {
        row.rotate_left(1);
    }
}

#[test]
fn counted_rows_plan_alike_in_any_order_and_with_pages_named_twice() {
    // Token rows mapped to counted pages as they come (each page once), the same pages with
    // their counts split over two cells (a page named twice), and those cells out of order:
    // the same bytes, counts (a split page's tokens add up) and kept lists, as int64 and
    // int32, padded and as CSR. (Counted rows merge cell by cell in any order: merging them by
    // runs, as block rows do, measured slower at token mode's shape: benches/RESULTS.md,
    // "Decode step, token mode".)
    for (int32, csr) in [(false, false), (true, false), (false, true)] {
        let mut plain = three_requests(false);
        let mut split = three_requests(false);
        let mut shuffled = three_requests(false);
        split.edit_counted = Some(split_counts);
        shuffled.edit_counted = Some(split_counts_rotated);
        for h in [&mut plain, &mut split, &mut shuffled] {
            (h.int32, h.csr, h.map_tokens) = (int32, csr, true);
        }
        for step in 0..12u64 {
            // Up to three tokens of each of a row's churning pages.
            let mut sel = |r: u64, l: u16, len: u64| -> Vec<i64> {
                churning_row(step, (r, l, len), 6)
                    .into_iter()
                    .flat_map(|p| {
                        let n = 1 + (p as u64 + step) % 3;
                        (0..n).map(move |t| p * i64::from(PS) + t as i64)
                    })
                    .filter(|&t| (t as u64) < len)
                    .collect()
            };
            let (f0, p) = plain.step(&[0, 1, 2], 1, 24, &mut sel);
            let (f1, a) = split.step(&[0, 1, 2], 1, 24, &mut sel);
            let (f2, b) = shuffled.step(&[0, 1, 2], 1, 24, &mut sel);
            let case = format!("step {step}, int32 {int32}, csr {csr}");
            assert_planned_alike((&mut plain, &mut split), (&f0, &p), (&f1, &a), &case);
            assert_planned_alike((&mut split, &mut shuffled), (&f1, &a), (&f2, &b), &case);
        }
        for h in [&mut plain, &mut split, &mut shuffled] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

#[test]
fn token_rows_mapped_to_counted_pages_plan_as_the_token_rows_do() {
    // Token mode with its tokens mapped to pages where they were selected (the runtime does
    // it on the device): page rows with per-page token counts must read the same bytes and
    // count the same entries, pages, needed bytes and loads as the token rows, with kept
    // selections on and off. `step` checks every byte read through each table.
    let mut rng = XorShift::new(11);
    let mut steps: Vec<Vec<Vec<i64>>> = Vec::new(); // [step][request] distinct tokens
    for step in 0..8u64 {
        let mut per = Vec::new();
        for r in 0..3u64 {
            let len = 30 + 9 * r + step + 1; // tokens once this step's append ran
            let prev: Vec<i64> = steps
                .last()
                .map(|s: &Vec<Vec<i64>>| s[r as usize].clone())
                .unwrap_or_default();
            let mut row: Vec<i64> = prev.into_iter().filter(|_| rng.below(4) != 0).collect();
            while row.len() < 10 {
                let t = rng.below(len) as i64;
                if !row.contains(&t) {
                    row.push(t);
                }
            }
            // Out of order on purpose: the mapping sorts.
            row.reverse();
            per.push(row);
        }
        steps.push(per);
    }
    let mut plain = three_requests(false);
    let mut mapped = three_requests(false);
    mapped.map_tokens = true;
    let mut unkept = three_requests(false);
    unkept.map_tokens = true;
    unkept.s.set_keep_selections(false).unwrap();
    for (i, per) in steps.iter().enumerate() {
        let mut sel = |r: u64, _: u16, _: u64| per[r as usize].clone();
        let (f1, a) = plain.step(&[0, 1, 2], 1, 10, &mut sel);
        let (f2, b) = mapped.step(&[0, 1, 2], 1, 10, &mut sel);
        let (f3, c) = unkept.step(&[0, 1, 2], 1, 10, &mut sel);
        // Write-throughs land when they land: which pages are evictable at the next step (and
        // so which get loaded) depends on it. Settled between steps, both sides evict alike.
        for h in [&mut plain, &mut mapped, &mut unkept] {
            h.s.drain().unwrap();
        }
        assert!(f1.is_empty() && f2.is_empty() && f3.is_empty());
        let key = |r: &StepRecord| {
            (
                r.selected,
                r.pages,
                r.bytes_needed,
                r.bytes_needed_of_transferred,
            )
        };
        assert_eq!(key(&a), key(&b), "step {i}: {a:?} {b:?}");
        // Without kept pages other pages get evicted and loaded: only the selection counts.
        let counted = |r: &StepRecord| (r.selected, r.pages, r.bytes_needed);
        assert_eq!(counted(&a), counted(&c), "step {i}");
        assert_eq!((a.loaded, a.ready), (b.loaded, b.ready), "step {i}");
        assert_eq!(a.selected, 3 * 10 * u64::from(LAYERS));
    }
    assert!(mapped.s.kept_pins() > 0);
    assert_eq!(plain.s.kept_pins(), mapped.s.kept_pins());
    for h in [&mut plain, &mut mapped, &mut unkept] {
        for r in 0..3 {
            h.s.finish_request(RequestId::new(r)).unwrap();
        }
        h.assert_quiet();
    }
}

#[test]
fn counts_are_checked_against_the_pages_they_count() {
    let mut h = three_requests(false);
    let ids: Vec<RequestId> = (0..3).map(RequestId::new).collect();
    h.s.append(&ids).unwrap();
    let u = SelectionUnit::new(PS, PS).unwrap();
    let pages = [0, 1, 0, 2, 0, -1];
    // A count of 0, more than the page holds, a short counts list, token units: refused.
    for (counts, field) in [
        (vec![1, 5, 1, 1, 1, 0], "counts[0][1]"),
        (vec![1, 1, 0, 1, 1, 0], "counts[1][0]"),
        (vec![1, 1, 1, 1, 1], "counts"),
    ] {
        let e =
            h.s.plan_counted(0, &ids, &pages, 2, u, Some(&counts))
                .unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }
    let t = SelectionUnit::new(1, PS).unwrap();
    let e =
        h.s.plan_counted(0, &ids, &pages, 2, t, Some(&[1; 6]))
            .unwrap_err();
    assert!(e.to_string().contains("unit"), "{e}");
    h.s.validate().unwrap();
    let (p, _) =
        h.s.plan_counted(0, &ids, &pages, 2, u, Some(&[4, 1, 2, 3, 1, 0]))
            .unwrap();
    h.s.ready(p, None).unwrap();
    h.s.finish(p).unwrap();
    let rec = h.s.end_step().unwrap();
    assert_eq!(rec.selected, 4 + 1 + 2 + 3 + 1);
    // A token row: K and V planes of 4 bf16 values, 16 bytes.
    assert_eq!(rec.bytes_needed, (4 + 1 + 2 + 3 + 1) * 16);
    h.s.validate().unwrap();
    // The pages are kept now: a bad count of a kept page, or of a page named twice, is
    // refused just the same.
    assert!(h.s.kept_pins() > 0);
    h.s.append(&ids).unwrap();
    for (pages, counts, field) in [
        ([0, 1, 0, 2, 0, 1], [1, 5, 1, 1, 1, 1], "counts[0][1]"),
        ([0, 1, 0, 2, 0, 1], [0, 1, 1, 1, 1, 1], "counts[0][0]"),
        ([0, 1, 0, 0, 0, 1], [1, 1, 1, 0, 1, 1], "counts[1][1]"),
    ] {
        let e =
            h.s.plan_counted(0, &ids, &pages, 2, u, Some(&counts))
                .unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
        h.s.validate().unwrap();
    }
}
