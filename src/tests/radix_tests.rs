//! The radix tree alone: splits, page alignment, duplicates, locks and both evictions.

use super::*;
use crate::ids::PageId;

fn pages(r: std::ops::Range<u32>) -> Vec<PageId> {
    r.map(PageId::new).collect()
}

#[test]
fn insert_match_split_and_align() {
    let mut t = RadixTree::new(2).unwrap();
    let a: Vec<u32> = (1..=8).collect();
    let r = t.insert(0, &a, &pages(0..4)).unwrap();
    assert_eq!((r.prefix_len, r.duplicates.len()), (0, 0));
    // A query sharing 5 tokens matches 4: whole pages only, and splits the node.
    let q: [u32; 7] = [1, 2, 3, 4, 5, 99, 7];
    let m = t.match_prefix(0, &q);
    assert_eq!(m.device_len, 4);
    assert_eq!(m.device_pages, pages(0..2));
    t.validate().unwrap();
    // Another namespace (model version) shares nothing.
    assert_eq!(t.match_prefix(1, &a).device_len, 0);
    // Re-insert with the path's own pages plus two fresh ones: no duplicates.
    let mut given = pages(0..4);
    given.push(PageId::new(10));
    let b: Vec<u32> = (1..=10).collect();
    let r = t.insert(0, &b, &given).unwrap();
    assert_eq!((r.prefix_len, r.own, r.duplicates.len()), (8, 4, 0));
    // Fresh pages for cached positions are duplicates.
    let r = t.insert(0, &a, &pages(20..24)).unwrap();
    assert_eq!(r.duplicates, pages(20..24));
    assert_eq!(t.device_pages(), 5);
    t.validate().unwrap();
}

#[test]
fn locks_protect_and_evictions_keep_or_drop() {
    let mut t = RadixTree::new(1).unwrap();
    let ra = t.insert(0, &[1, 2, 3], &pages(0..3)).unwrap();
    let rb = t.insert(0, &[1, 2, 9], &pages(3..6)).unwrap(); // shares [1, 2]
    assert_eq!(rb.duplicates, pages(3..5));
    t.lock(ra.last_node).unwrap();
    // b's leaf has no host copy: kept unless unbacked nodes may be dropped.
    assert!(t.evict_device(10, false).is_empty());
    assert_eq!(t.evict_device(10, true), pages(5..6));
    assert_eq!(
        t.match_prefix(0, &[1, 2, 3]).device_len,
        3,
        "locked path kept"
    );
    t.unlock(ra.last_node).unwrap();
    assert!(matches!(
        t.unlock(ra.last_node),
        Err(crate::error::Error::NotLocked { .. })
    ));
    // Backed up: eviction keeps the host copy, and the match returns device then host.
    t.begin_backup(ra.last_node, pages(100..101), 7).unwrap();
    t.finish_backup(ra.last_node, 7, true).unwrap();
    assert_eq!(t.evict_device(1, false), pages(2..3));
    let m = t.match_prefix(0, &[1, 2, 3]);
    assert_eq!((m.device_len, m.host_len), (2, 1));
    assert_eq!(t.evict_host(1), pages(100..101));
    assert_eq!(t.match_prefix(0, &[1, 2, 3]).host_len, 0);
    t.validate().unwrap();
}

#[test]
fn stale_node_ids_miss() {
    let mut t = RadixTree::new(1).unwrap();
    let r = t.insert(0, &[1, 2], &pages(0..2)).unwrap();
    t.evict_device(2, true);
    assert!(matches!(
        t.lock(r.last_node),
        Err(crate::error::Error::UnknownNode { .. })
    ));
    t.insert(0, &[5, 6], &pages(0..2)).unwrap(); // may reuse the slot
    assert!(t.lock(r.last_node).is_err());
}

/// A step of the chain test.
#[derive(Debug, Clone)]
enum Op {
    Insert(Vec<u32>),
    Match(Vec<u32>),
    Evict(usize, bool),
    Lock(usize),
    Unlock(usize),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    // Two token values and four-token pages: 16 distinct pages, so siblings are many.
    let toks = || proptest::collection::vec(1u32..=2, 0..24);
    prop_oneof![
        4 => toks().prop_map(Op::Insert),
        3 => toks().prop_map(Op::Match),
        1 => (1usize..6, any::<bool>()).prop_map(|(n, d)| Op::Evict(n, d)),
        1 => (0usize..8).prop_map(Op::Lock),
        1 => (0usize..8).prop_map(Op::Unlock),
    ]
}

proptest::proptest! {
    #![proptest_config(crate::testing::proptest_config(256, "radix"))]

    /// Siblings whose first-page keys collide (every key of a four-token page falls in one of
    /// three values) chain: the tree behaves exactly as one whose keys do not collide, result
    /// for result, and both stay valid after every step.
    #[test]
    fn colliding_first_page_keys_chain(ops in proptest::collection::vec(op(), 1..80)) {
        let mut plain = RadixTree::new(4).unwrap();
        let mut chained = RadixTree::new(4).unwrap();
        chained.set_colliding();
        let mut next_page = 0u32;
        let mut nodes = Vec::new();
        let mut held = Vec::new();
        for op in ops {
            match op {
                Op::Insert(t) => {
                    let n = (t.len() / 4) as u32;
                    let given = pages(next_page..next_page + n);
                    next_page += n;
                    let a = plain.insert(0, &t, &given).unwrap();
                    let b = chained.insert(0, &t, &given).unwrap();
                    // Node ids differ between trees (each draws its own from the process-wide
                    // serial): the rest must agree, and the ids go in pairs.
                    let strip = |r: &InsertResult| {
                        (r.prefix_len, r.duplicates.clone(), r.own, r.needs_backup.len())
                    };
                    proptest::prop_assert_eq!(strip(&a), strip(&b));
                    nodes.push((a.last_node, b.last_node));
                }
                Op::Match(t) => {
                    let wide: Vec<i64> = t.iter().map(|&v| i64::from(v)).collect();
                    let a = plain.match_prefix(0, &t);
                    let b = chained.match_prefix(0, &wide);
                    let strip = |m: &MatchResult| (m.device_len, m.host_len, m.device_pages.clone());
                    proptest::prop_assert_eq!(strip(&a), strip(&b));
                }
                Op::Evict(n, drop) => {
                    proptest::prop_assert_eq!(
                        plain.evict_device(n, drop),
                        chained.evict_device(n, drop)
                    );
                }
                Op::Lock(i) if i < nodes.len() => {
                    let (a, b) = (plain.lock(nodes[i].0), chained.lock(nodes[i].1));
                    proptest::prop_assert_eq!(a.is_ok(), b.is_ok());
                    if a.is_ok() {
                        held.push(nodes[i]);
                    }
                }
                // Only locks this test holds are undone (an unlock of another node is the
                // caller's error, which the tree does not detect on interior nodes).
                Op::Unlock(i) if i < held.len() => {
                    let (p, c) = held.swap_remove(i);
                    plain.unlock(p).unwrap();
                    chained.unlock(c).unwrap();
                }
                Op::Lock(_) | Op::Unlock(_) => {}
            }
            plain.validate().map_err(proptest::test_runner::TestCaseError::fail)?;
            chained.validate().map_err(proptest::test_runner::TestCaseError::fail)?;
        }
    }
}

#[test]
fn a_bad_token_in_a_late_chunk_refuses_the_insert() {
    // Narrowing runs in 4 KiB chunks: a value past the first ones is still caught, and the
    // tree is left as it was.
    let mut t = RadixTree::new(1).unwrap();
    let mut toks: Vec<i64> = (1..=3000).collect();
    for bad in [2500usize, 2999] {
        toks[bad] = i64::from(u32::MAX) + 1;
        let err = t.insert(0, &toks, &pages(0..3000)).unwrap_err();
        assert!(err.to_string().contains("tokens"), "{err}");
        assert_eq!(
            (t.device_pages(), t.node_count()),
            (0, 0),
            "not even a root"
        );
        toks[bad] = -1;
        assert!(t.insert(0, &toks, &pages(0..3000)).is_err());
        toks[bad] = bad as i64;
    }
    t.insert(0, &toks, &pages(0..3000)).unwrap();
    t.validate().unwrap();
}
