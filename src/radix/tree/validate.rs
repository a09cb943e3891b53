//! The tree's invariants, checked from scratch (after every step of the state-machine tests).

use super::*;

impl RadixTree {
    /// Checks every invariant; returns the first one broken.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let ps = self.page_size;
        let (mut dev, mut host) = (0, 0);
        let mut seen_dev = rustc_hash::FxHashSet::default();
        let mut seen_host = rustc_hash::FxHashSet::default();
        for (idx, n) in &self.nodes {
            if let Some(p) = n.device.iter().find(|p| !seen_dev.insert(**p)) {
                return Err(format!("device page {p} owned twice"));
            }
            if let Some(p) = n.host_pages.iter().find(|p| !seen_host.insert(**p)) {
                return Err(format!("host page {p} owned twice"));
            }
            let root = n.parent == NIL;
            if !root {
                if n.key.is_empty() || n.key.len() % ps != 0 {
                    return Err(format!("node {idx}: key of {} tokens", n.key.len()));
                }
                let pages = n.key.len() / ps;
                if n.on_device() && n.device.len() != pages {
                    return Err(format!(
                        "node {idx}: {} device pages for {pages}",
                        n.device.len()
                    ));
                }
                if (n.host == HostCopy::None) != n.host_pages.is_empty()
                    || (!n.host_pages.is_empty() && n.host_pages.len() != pages)
                {
                    return Err(format!("node {idx}: host state and pages disagree"));
                }
                if !self.children_of(n.parent).any(|c| c == idx) {
                    return Err(format!("node {idx}: parent does not list it"));
                }
                if self.find_child(n.parent, &n.key[..ps]) != Some(idx) {
                    return Err(format!("node {idx}: its first page does not find it"));
                }
                if n.loading.is_some() && !n.on_device() {
                    return Err(format!("node {idx}: loading without device pages"));
                }
            }
            let dc = self
                .children_of(idx)
                .filter(|&c| self.nodes[c].on_device())
                .count() as u32;
            if dc != n.device_children {
                return Err(format!(
                    "node {idx}: device_children {} != {dc}",
                    n.device_children
                ));
            }
            let dev_ok = !root
                && n.on_device()
                && n.loading.is_none()
                && n.lock_ref == 0
                && n.device_children == 0;
            let host_ok = !root
                && n.host == HostCopy::Ready
                && !n.on_device()
                && n.loading.is_none()
                && n.lock_ref == 0
                && n.storage_pins == 0
                && n.children.is_empty();
            if dev_ok
                != n.in_device_lru
                    .is_some_and(|s| self.device_lru.contains(&(s, idx)))
            {
                return Err(format!("node {idx}: device LRU membership wrong"));
            }
            if host_ok
                != n.in_host_lru
                    .is_some_and(|s| self.host_lru.contains(&(s, idx)))
            {
                return Err(format!("node {idx}: host LRU membership wrong"));
            }
            if !root {
                let parent_lock = self.nodes[n.parent].lock_ref;
                if self.nodes[n.parent].parent != NIL && parent_lock < n.lock_ref {
                    return Err(format!(
                        "node {idx}: locked {} times under a parent locked {parent_lock}",
                        n.lock_ref
                    ));
                }
                let below: u32 = n.children.values().map(|&c| self.chain_lock_refs(c)).sum();
                if n.lock_ref != n.own_locks + below {
                    return Err(format!(
                        "node {idx}: lock count {} is not its own locks {} and its children's {below}",
                        n.lock_ref, n.own_locks
                    ));
                }
            }
            dev += n.device.len();
            host += n.host_pages.len();
        }
        let in_sets = self
            .nodes
            .iter()
            .filter(|(_, n)| n.in_device_lru.is_some())
            .count();
        if in_sets != self.device_lru.len() {
            return Err("device LRU set holds stale entries".into());
        }
        if self
            .nodes
            .iter()
            .filter(|(_, n)| n.in_host_lru.is_some())
            .count()
            != self.host_lru.len()
        {
            return Err("host LRU set holds stale entries".into());
        }
        let locked: usize = self
            .nodes
            .iter()
            .filter(|(_, n)| n.lock_ref > 0)
            .map(|(_, n)| n.device.len())
            .sum();
        if locked != self.locked_device_pages {
            return Err(format!(
                "locked device pages {locked} != counter {}",
                self.locked_device_pages
            ));
        }
        if (dev, host) != (self.device_pages, self.host_pages) {
            return Err(format!(
                "page totals {dev}/{host} != counters {}/{}",
                self.device_pages, self.host_pages
            ));
        }
        Ok(())
    }
}
