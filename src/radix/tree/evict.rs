//! Eviction: device pages of unlocked nodes (LRU, leaves first), host pages of host-only
//! nodes, and namespaces dropped whole.

use super::*;

impl RadixTree {
    /// Evicts device pages of least recently used device leaves until at least `n_pages` are
    /// freed or nothing is evictable. A node with a Ready host copy keeps it (L2 only); a node
    /// without one is dropped when `drop_unbacked` and it has no children, else skipped.
    /// Returns the freed device pages.
    pub fn evict_device(&mut self, n_pages: usize, drop_unbacked: bool) -> Vec<PageId> {
        let mut freed = Vec::new();
        let mut skipped = Vec::new();
        while freed.len() < n_pages {
            let Some(&(stamp, idx)) = self.device_lru.iter().next() else {
                break;
            };
            self.device_lru.remove(&(stamp, idx));
            self.nodes[idx].in_device_lru = None;
            match self.nodes[idx].host {
                HostCopy::Ready => freed.extend(self.set_device(idx, Vec::new())),
                HostCopy::None if drop_unbacked && self.nodes[idx].children.is_empty() => {
                    freed.extend(self.set_device(idx, Vec::new()));
                    self.remove_leaf(idx);
                }
                _ => skipped.push(idx),
            }
        }
        // Skipped nodes stay evictable later (once backed up): put them back.
        for idx in skipped {
            self.refresh(idx);
        }
        freed
    }

    /// Evicts host pages of least recently used host-only leaves (not on the device, not
    /// locked) until at least `n_pages` are freed; such nodes leave the tree. Returns the
    /// freed host pages.
    pub fn evict_host(&mut self, n_pages: usize) -> Vec<PageId> {
        let mut freed = Vec::new();
        while freed.len() < n_pages {
            let Some(&(_, idx)) = self.host_lru.iter().next() else {
                break;
            };
            let pages = std::mem::take(&mut self.nodes[idx].host_pages);
            self.host_pages -= pages.len();
            self.nodes[idx].host = HostCopy::None;
            freed.extend(pages);
            self.remove_leaf(idx);
        }
        freed
    }

    /// Removes a leaf that holds no pages.
    pub(super) fn remove_leaf(&mut self, idx: usize) {
        let n = &self.nodes[idx];
        debug_assert!(n.children.is_empty() && n.device.is_empty() && n.host_pages.is_empty());
        let parent = n.parent;
        if let Some(s) = n.in_device_lru {
            self.device_lru.remove(&(s, idx));
        }
        if let Some(s) = n.in_host_lru {
            self.host_lru.remove(&(s, idx));
        }
        self.remove_child(parent, idx);
        self.nodes.remove(idx);
        self.refresh(parent);
    }

    /// Removes namespace `ns` (a model version going away): every node of its tree, handing
    /// back (device pages, host pages) to free. Refused, changing nothing, while any node is
    /// locked or has a transfer in flight: the caller drains and unlocks first.
    pub fn drop_namespace(&mut self, ns: u32) -> Result<(Vec<PageId>, Vec<PageId>)> {
        let Some(&root) = self.roots.get(&ns) else {
            return Ok((Vec::new(), Vec::new()));
        };
        let mut stack = vec![root];
        let mut subtree = Vec::new();
        while let Some(i) = stack.pop() {
            let n = &self.nodes[i];
            if n.parent != NIL
                && (n.lock_ref > 0
                    || n.storage_pins > 0
                    || n.loading.is_some()
                    || matches!(n.host, HostCopy::Writing(_)))
            {
                return Err(Error::config(
                    "namespace",
                    ns,
                    "a namespace with no locked node and no transfer in flight (unlock and drain first)",
                ));
            }
            stack.extend(self.children_of(i));
            subtree.push(i);
        }
        let (mut dev, mut host) = (Vec::new(), Vec::new());
        for i in subtree {
            let n = self.nodes.remove(i);
            if let Some(s) = n.in_device_lru {
                self.device_lru.remove(&(s, i));
            }
            if let Some(s) = n.in_host_lru {
                self.host_lru.remove(&(s, i));
            }
            self.device_pages -= n.device.len();
            self.host_pages -= n.host_pages.len();
            dev.extend(n.device);
            host.extend(n.host_pages);
        }
        self.roots.remove(&ns);
        Ok((dev, host))
    }
}
