//! Chunked prefill, write-through timing, and kept selections: pages read from their kept
//! slots, given back when dropped, and a plan that must resolve what another reads kept.

use super::*;

#[test]
fn chunked_prefill_extends_the_page_being_written() {
    let mut h = Harness::new(64, 400, false);
    h.add(0, 6, None); // pages 0 (full) and 1 (2 rows)
    let (first, slots) = h.s.extend(RequestId::new(0), 7).unwrap(); // tokens 6..13
    assert_eq!(first, 1);
    let touched = 3; // pages 1, 2, 3
    assert_eq!(slots.len(), touched * LAYERS as usize);
    for l in 0..LAYERS {
        for i in 0..touched {
            let page = first + i as u32;
            for row in 0..PS {
                let t = u64::from(page * PS + row);
                if (6..13).contains(&t) {
                    h.write_row(slots[l as usize * touched + i], 0, page, l, row);
                }
            }
        }
    }
    for step in 0..5 {
        let (failed, _) = h.step(&[0], PS, 4, &mut |_, l, len| {
            blocks(step + u64::from(l), len, PS, 4)
        });
        assert!(failed.is_empty());
    }
    h.assert_quiet();
}

#[test]
fn a_page_filling_mid_step_is_written_through_only_after_every_layer_wrote_it() {
    let mut h = Harness::new(36, 400, false);
    h.add(1, 40, None);
    h.step(&[1], PS, 2, &mut |_, _, len| blocks(0, len, PS, 2));
    h.s.drain().unwrap();
    h.add(2, 40, None); // evicts request 1's written-through pages; its own wait for a backup
    h.add(0, 3, None);
    // This step's token fills request 0's page 0, layer by layer. Request 1 reads two pages
    // that are on host only, so the plan of layer 0 must make room (write request 2's prefill
    // through) while page 0 has its new row at layer 0 only.
    let (failed, _) = h.step(&[0, 1], PS, 3, &mut |r, _, len| {
        let n = len.div_ceil(u64::from(PS)) as i64;
        if r == 0 {
            vec![0]
        } else {
            vec![0, 1, n - 1]
        }
    });
    assert!(failed.is_empty());
    h.s.drain().unwrap();
    // Kept selections would keep page 0 pinned on the device: give them back to evict it.
    h.s.set_keep_selections(false).unwrap();
    h.s.directory().evict(1000);
    // Page 0 of every layer comes back from its host copy: every row must be there.
    let (failed, rec) = h.step(&[0], PS, 2, &mut |_, _, _| vec![0, 1]);
    assert!(failed.is_empty());
    assert!(rec.loaded >= u64::from(LAYERS), "{rec:?}");
    h.assert_quiet();
}

#[test]
fn kept_pages_are_read_from_their_slots_and_given_back_when_dropped() {
    let mut h = Harness::new(100, 400, false);
    h.add(0, 40, None); // pages 0..10
    let pins_of = |h: &Harness, page: u32, l: u16| {
        let key = h.s.request(RequestId::new(0)).unwrap().key(page, l);
        h.s.directory().state(&key).unwrap().pins
    };
    let (failed, _) = h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 3, 9]);
    assert!(failed.is_empty());
    // Every selected page stays pinned for the next step, once.
    assert_eq!(h.s.kept_pins(), 3 * u64::from(LAYERS));
    assert_eq!(h.s.directory().stats().pins, h.s.kept_pins());
    assert_eq!(pins_of(&h, 3, 1), 1);
    // The same selection again: every page a kept hit, nothing resolved or loaded.
    let (failed, rec) = h.step(&[0], PS, 3, &mut |_, _, _| vec![9, 0, 3, 3]);
    assert!(failed.is_empty());
    assert_eq!((rec.ready, rec.loaded, rec.pages), (9, 0, 9), "{rec:?}");
    assert_eq!(pins_of(&h, 3, 1), 1, "a repeated entry pins nothing more");
    // Page 3 dropped for 5: given back, and 5 kept.
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    assert_eq!(pins_of(&h, 3, 1), 0);
    assert_eq!(pins_of(&h, 5, 1), 1);
    assert_eq!(h.s.kept_pins(), 3 * u64::from(LAYERS));
    // A new page named twice: both cells read its fresh slot (checked by `step`).
    h.step(&[0], PS, 4, &mut |_, _, _| vec![0, 7, 9, 7]);
    assert_eq!(pins_of(&h, 7, 1), 1);
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    // Off: every kept page back, and the steps still read the right rows (checked by `step`).
    h.s.set_keep_selections(false).unwrap();
    assert_eq!((h.s.kept_pins(), h.s.directory().stats().pins), (0, 0));
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    assert_eq!(h.s.directory().stats().pins, 0);
    h.s.set_keep_selections(true).unwrap();
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    assert_eq!(h.s.kept_pins(), 3 * u64::from(LAYERS));
    h.s.finish_request(RequestId::new(0)).unwrap();
    assert_eq!((h.s.kept_pins(), h.s.directory().stats().pins), (0, 0));
    h.assert_quiet();
}

#[test]
fn token_selections_keep_their_pages_and_count_as_without_kept_selections() {
    // Tokens (and 2-token blocks) inside 4-token pages: sorted rows, rows out of order with
    // repeats and padding, a sorted row ending in a request's last, partial block. Kept
    // selections on and off must count the same entries, pages and needed bytes; `step`
    // checks every byte read through either table.
    let rows: [(u32, Vec<i64>); 7] = [
        (1, vec![0, 1, 5, 6, 7, 13, 30, 31]),
        (1, vec![31, 6, 0, 6, -1, 13, 1, 22]),
        (2, vec![0, 3, 6, 7, 15, -1, -1, -1]),
        // 998, 999: the request's last two blocks (request 0 has 35 tokens by then: its
        // last block holds one).
        (2, vec![0, 1, 4, 9, 9, 15, 998, 999]),
        (1, vec![2, 2, 2, 2, 2, 3, 9, -1]), // page 0 named six times: four tokens needed
        (1, vec![0, 1, 5, 6, 7, 13, 30, 31]),
        (1, vec![0, 1, 5, 6, 7, 13, 30, 31]),
    ];
    let mut kept = Harness::new(100, 400, false);
    let mut unkept = Harness::new(100, 400, false);
    unkept.s.set_keep_selections(false).unwrap();
    for h in [&mut kept, &mut unkept] {
        h.add(0, 31, None); // 32 tokens after the first append: pages 0..8
        h.add(1, 40, None);
    }
    for (i, (unit, row)) in rows.iter().enumerate() {
        let mut sel = |r: u64, _: u16, len: u64| -> Vec<i64> {
            let unit = i64::from(*unit);
            // Request 1 reads two pages further on, to be told apart.
            let shift = if r == 1 { 8 / unit } else { 0 };
            let entries = len.div_ceil(unit as u64) as i64;
            row.iter()
                .map(|&e| match e {
                    ..0 => e,
                    900.. => entries - (1000 - e),
                    _ => e + shift,
                })
                .collect()
        };
        let (f1, a) = kept.step(&[0, 1], *unit, 8, &mut sel);
        let (f2, b) = unkept.step(&[0, 1], *unit, 8, &mut sel);
        assert!(f1.is_empty() && f2.is_empty());
        assert_eq!(
            (a.selected, a.pages, a.bytes_needed),
            (b.selected, b.pages, b.bytes_needed),
            "step {i}"
        );
        kept.s.validate().unwrap();
        if i == 6 {
            // The same row two steps running: every page a kept hit, nothing resolved.
            assert_eq!((a.ready, a.loaded), (a.pages, 0), "{a:?}");
            // Pages 0, 1, 3, 7 of each request at every layer stay kept, once each.
            assert_eq!(kept.s.kept_pins(), 2 * 4 * u64::from(LAYERS));
        }
    }
    assert_eq!(unkept.s.kept_pins(), 0);
    kept.s.finish_request(RequestId::new(0)).unwrap();
    kept.s.finish_request(RequestId::new(1)).unwrap();
    assert_eq!(kept.s.kept_pins(), 0);
    kept.assert_quiet();
}
