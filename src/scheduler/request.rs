//! Per-request block state the step scheduler keeps: how many tokens are written, which pages
//! exist, where the page being written sits, which shared prefix the first pages belong to,
//! and what each layer selected last step (the prefetch prediction).

use super::kept_store::KeptSlot;
use super::prefix::PrefixTier;
use crate::directory::{LayerGroup, ObjectHint, ObjectKey};
use crate::ids::{RequestId, SlotId};
use crate::radix::NodeId;
use crate::transfer::TransferEvents;
use std::sync::Arc;

/// The namespace and whole-page count of a shared prefix (a system prompt stored once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    /// The prefix's namespace.
    pub namespace: u64,
    /// Whole pages the request reads from it.
    pub pages: u32,
}

/// A page a layer's selection kept from one step to the next: its object stays pinned (held
/// by the directory) at `slot`, so the next plan that selects it again reads the slot without
/// a directory call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kept {
    /// The request page.
    pub page: u32,
    /// The directory's object index.
    pub object: u32,
    /// Its device slot.
    pub slot: i32,
}

impl Kept {
    /// A page newly selected, in a row's next kept list until the resolve fills it in.
    pub fn placeholder(page: u32) -> Self {
        Kept {
            page,
            object: u32::MAX,
            slot: -1,
        }
    }
}

/// One running request.
#[derive(Debug)]
pub struct RequestState {
    /// The request, also the namespace of its own objects.
    pub id: RequestId,
    /// Tokens written (prefix included).
    pub len: u64,
    /// The shared prefix its first pages come from, if any.
    pub prefix: Option<Prefix>,
    /// Device slots (one per layer) of the page being written; empty when the next token
    /// starts a new page.
    pub tail: Vec<SlotId>,
    /// Per layer: last step's selection as sorted distinct pages.
    pub last_selection: Vec<Vec<u32>>,
    /// The last batch (plan or append) that named it: refuses a request twice in one batch.
    pub batch_mark: u64,
    /// Per layer, page -> where the directory holds its object (`ObjectHint::NONE` where
    /// unknown): resolve hints that save a hash probe per selected page. Checked by the
    /// directory.
    pub index: Vec<Vec<ObjectHint>>,
    /// Joined mode: its pages live at prefix-cache host pages (see [`PrefixTier`]).
    pub joined: bool,
    /// Joined mode, per page: (host page, generation), the identity of its objects.
    pub homes: Vec<(u32, u32)>,
    /// Joined mode, per page: its Indexer-K (sidecar) device page.
    pub idx_pages: Vec<u32>,
    /// Joined mode: leading pages matched in the prefix cache (the tree's, locked by `node`).
    pub matched: u32,
    /// Joined mode: the locked last node of the match.
    pub node: Option<NodeId>,
    /// Joined mode: the prompt it was admitted with.
    pub tokens: Vec<u32>,
    /// Joined mode: the Indexer-K restores of the matched pages it waits on, layer by layer.
    pub restores: Vec<Arc<TransferEvents>>,
    /// Joined mode: matched pages from here on were restored from host (before: Indexer-K
    /// already on the device).
    pub restored_from: u32,
    /// Joined mode: one bit per (matched page, layer) whose main KV it loaded already.
    pub prefix_seen: Vec<u64>,
    /// Joined mode: the restore policy's decision at admission.
    pub restore: Option<super::restore_policy::RestoreDecision>,
    /// Joined mode: the objects a bulk restore (full or predicted) loaded at admission, in
    /// `restore_submissions` submissions.
    pub restore_loaded: u64,
    /// (See `restore_loaded`.)
    pub restore_submissions: u64,
    /// Joined mode: per host-restored page, its objects off the device at admission.
    pub restore_absent: Vec<u32>,
    /// Time its layers waited on loads and restores on the host (a decode wait counts for
    /// every request of the step).
    pub exposed_wait_ns: u64,
    /// Its run in every layer's kept lists (the pages its last selection of the layer kept
    /// pinned, sorted by page: [`super::kept_store`]).
    pub kept_slot: KeptSlot,
    /// Unique to this state (a request ended and added again under its id gets another): a
    /// plan's kept rows apply only to the state they were merged against.
    pub serial: u64,
    /// Plain mode: the versions of its own namespace and of its prefix's (an id used again
    /// after it ended has a new one).
    pub versions: (u32, u32),
}

/// Serials of request states.
static NEXT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl RequestState {
    /// A request of `len` tokens over `layers` layers, its kept lists at `kept_slot`.
    pub fn new(
        id: RequestId,
        len: u64,
        prefix: Option<Prefix>,
        layers: usize,
        kept_slot: KeptSlot,
    ) -> Self {
        RequestState {
            id,
            len,
            prefix,
            tail: Vec::new(),
            last_selection: vec![Vec::new(); layers],
            batch_mark: 0,
            index: vec![Vec::new(); layers],
            joined: false,
            homes: Vec::new(),
            idx_pages: Vec::new(),
            matched: 0,
            node: None,
            tokens: Vec::new(),
            restores: Vec::new(),
            prefix_seen: Vec::new(),
            restore: None,
            restore_loaded: 0,
            restore_submissions: 0,
            restore_absent: Vec::new(),
            exposed_wait_ns: 0,
            restored_from: 0,
            kept_slot,
            serial: NEXT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            versions: (0, 0),
        }
    }

    /// Pages holding at least one written token.
    pub fn pages(&self, page_size: u32) -> u32 {
        self.len.div_ceil(u64::from(page_size)) as u32
    }

    /// Records the directory's object indices of `pages` at `layer`.
    pub fn set_index(&mut self, layer: u16, pages: std::ops::Range<u32>, idx: &[ObjectHint]) {
        let t = &mut self.index[layer as usize];
        let need = pages.end as usize;
        if t.len() < need {
            if t.capacity() < need {
                // Room to decode into: a table sized exactly by the prefill moved at the
                // request's first decode page, every layer's in the same step.
                t.reserve_exact(need + need / 8 + 16 - t.len());
            }
            t.resize(need, ObjectHint::NONE);
        }
        t[pages.start as usize..pages.end as usize].copy_from_slice(idx);
    }

    /// The resolve hint of `page` at `layer`.
    #[inline]
    pub fn hint(&self, page: u32, layer: u16) -> ObjectHint {
        self.index[layer as usize]
            .get(page as usize)
            .copied()
            .unwrap_or(ObjectHint::NONE)
    }

    /// The object of `page` at `layer`: in the prefix's namespace below its pages, else in the
    /// request's own; in the joined mode, the object at the page's host page.
    #[inline]
    pub fn key(&self, page: u32, layer: u16) -> ObjectKey {
        if self.joined {
            let (h, gen) = self.homes[page as usize];
            return PrefixTier::key(h, gen, layer);
        }
        let (ns, version) = match self.prefix {
            Some(p) if page < p.pages => (p.namespace, self.versions.1),
            _ => (self.id.raw(), self.versions.0),
        };
        ObjectKey::new(ns, version, page, LayerGroup::Layer(layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefilled_hint_table_has_room_for_decode_pages() {
        let mut r = RequestState::new(
            RequestId::new(1),
            64 * 1000,
            None,
            2,
            super::super::kept_store::KeptStore::new(2).add(),
        );
        let idx: Vec<ObjectHint> = (0..1000).map(|i| ObjectHint::new(i, 7)).collect();
        r.set_index(1, 0..1000, &idx);
        assert!(r.index[1].capacity() >= 1100, "{}", r.index[1].capacity());
        let at = r.index[1].as_ptr();
        // The decode pages that follow land in the same buffer: no table moves (for every
        // layer at once) at the request's first decode page.
        for page in 1000..1100 {
            r.set_index(1, page..page + 1, &[ObjectHint::new(page, 7)]);
        }
        assert_eq!(r.index[1].as_ptr(), at);
        assert_eq!(r.hint(1099, 1), ObjectHint::new(1099, 7));
        assert_eq!(r.hint(1100, 1), ObjectHint::NONE);
        assert_eq!(r.hint(5, 0), ObjectHint::NONE, "layer 0 untouched");
    }
}
