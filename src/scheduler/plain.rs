//! The plain step scheduler: host copies in a host pool of its own, shared prompts stored by
//! namespace, requests registered by their prefilled length.
//!
//! # One request, plain
//! `add_prompt(ns, pages)` (optional: a shared prefix, written by the caller, written through
//! at the next `end_step`) -> `add_request(id, tokens, prefix)` (over the prefix, then
//! `extend`ed by the rest) -> decode steps -> `finish_request(id)` (its objects go now, or
//! when the last pin or transfer touching them ends; shared prompts stay until
//! `drop_prompt`).

use super::core::{SchedulerConfig, StepScheduler};
use super::request::{Prefix, RequestState};
use super::tier::{Plain, Tier};
use crate::directory::{LayerGroup, Namespace, ObjectHint, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::{RequestId, SlotId};
use crate::transfer::binding::{check_disjoint, check_same_rows};
use crate::transfer::{CopyEngine, PageTransferBinding};
use std::ops::Range;
use std::sync::Arc;

impl StepScheduler<Plain> {
    /// A scheduler over one-layer KV pools whose pages are the objects' slots: `device` holds
    /// `device_pages` pages, `host` holds `host_pages`, both of `page_size` tokens.
    pub fn new(
        cfg: SchedulerConfig,
        device: PageTransferBinding,
        host: PageTransferBinding,
        engine: Arc<dyn CopyEngine>,
    ) -> Result<Self> {
        if cfg.layers == 0 {
            return Err(Error::config("layers", 0, "an integer >= 1"));
        }
        if device.layers() != 1 || host.layers() != 1 {
            return Err(Error::config(
                "device/host bindings",
                format!("{} and {} layers", device.layers(), host.layers()),
                "one-layer KV pools: one page of them is one layer of one page of a request",
            ));
        }
        for (field, b, pages) in [
            ("device.pages", &device, cfg.device_pages),
            ("host.pages", &host, cfg.host_pages),
        ] {
            if b.pages() != pages {
                return Err(Error::config(field, b.pages(), format!("{pages}")));
            }
            if b.page_size() != cfg.page_size {
                return Err(Error::config(
                    "page_size",
                    b.page_size(),
                    format!("{}: the scheduler's page size", cfg.page_size),
                ));
            }
        }
        check_disjoint(&[("device", &device), ("host", &host)])?;
        check_same_rows(("device", &device), ("host", &host))?;
        Self::assemble(cfg, device, host, engine, Plain::default())
    }

    /// Stores a shared prefix of `pages` whole pages under `namespace`: its objects are
    /// allocated for every layer and returned layer-major (`[layer][page]`); the caller writes
    /// them before its next call, and they are written through to host at the next `end_step`.
    pub fn add_prompt(&mut self, namespace: u64, pages: u32) -> Result<Vec<SlotId>> {
        if self.tier.prompts.contains_key(&namespace)
            || self.requests.contains_key(&RequestId::new(namespace))
        {
            return Err(Error::config(
                "namespace",
                namespace,
                "a namespace no prompt or request uses",
            ));
        }
        if pages == 0 {
            return Err(Error::config("pages", 0, "an integer >= 1"));
        }
        self.check_fits("pages", pages, u64::from(pages))?;
        let v = self.fresh_version(namespace);
        let keys: Vec<ObjectKey> = (0..self.cfg.layers)
            .flat_map(|l| {
                (0..pages).map(move |p| ObjectKey::new(namespace, v, p, LayerGroup::Layer(l)))
            })
            .collect();
        let slots = self.allocate_with_room(&keys, None)?;
        let idx = self.dir.index_of(&keys);
        let per = pages as usize;
        self.tier.prompt_index.insert(
            namespace,
            (0..self.cfg.layers as usize)
                .map(|l| idx[l * per..(l + 1) * per].to_vec())
                .collect(),
        );
        self.xfer.pending.extend_from_slice(&keys);
        self.tier.prompts.insert(namespace, pages);
        self.tier.prompt_versions.insert(namespace, v);
        Ok(slots)
    }

    /// Whole pages of a stored prefix.
    pub fn prompt_pages(&self, namespace: u64) -> Option<u32> {
        self.tier.prompts.get(&namespace).copied()
    }

    /// Ends a stored prefix; refused while a running request reads it.
    pub fn drop_prompt(&mut self, namespace: u64) -> Result<()> {
        if !self.tier.prompts.contains_key(&namespace) {
            return Err(Error::config("namespace", namespace, "a stored prompt"));
        }
        if let Some(r) = self
            .requests
            .values()
            .find(|r| r.prefix.is_some_and(|p| p.namespace == namespace))
        {
            return Err(Error::config(
                "namespace",
                namespace,
                format!("a prompt no running request reads (request {} does)", r.id),
            ));
        }
        self.tier.prompts.remove(&namespace);
        self.tier.prompt_index.remove(&namespace);
        self.xfer.pending.retain(|k| k.namespace.id != namespace);
        let version = self.tier.prompt_versions.remove(&namespace).unwrap_or(0);
        self.dir
            .drop_namespace(Namespace {
                id: namespace,
                version,
            })
            .map(|_| ())
    }

    /// The version a request or prompt starting under namespace `id` takes: the first the
    /// directory does not remember as dropped. It refuses a dropped namespace's keys (a late
    /// key of the old request is never taken for the new one's) until it forgets it, so an id
    /// used again needs another version; nothing is kept per id once it ends.
    fn fresh_version(&self, id: u64) -> u32 {
        // (At most as many tries as the directory remembers drops of this id.)
        let mut version = 0;
        while self.dir.remembers_dropped(Namespace { id, version }) {
            version += 1;
        }
        version
    }

    /// Admits request `id` with `tokens` tokens already prefilled, the first `prefix.pages`
    /// pages read from a stored prefix: registers it over the prefix, then [`Self::extend`]s
    /// it by the rest and returns those slots (`[layer][page]`, see `extend`).
    pub fn add_request(
        &mut self,
        id: RequestId,
        tokens: u64,
        prefix: Option<Prefix>,
    ) -> Result<Vec<SlotId>> {
        if self.requests.contains_key(&id) || self.tier.prompts.contains_key(&id.raw()) {
            return Err(Error::KeyExists {
                key: format!("request {id}"),
            });
        }
        let ps = u64::from(self.cfg.page_size);
        let from_prefix = prefix.map_or(0, |p| u64::from(p.pages) * ps);
        if let Some(p) = prefix {
            let stored = self.tier.prompts.get(&p.namespace).copied().unwrap_or(0);
            if p.pages == 0 || p.pages > stored || from_prefix > tokens {
                return Err(Error::config(
                    "prefix",
                    format!("({}, {} pages)", p.namespace, p.pages),
                    format!(
                        "a stored prompt and 1..={} of its pages, no more than the request's \
                         {tokens} tokens cover",
                        stored.min((tokens / ps) as u32)
                    ),
                ));
            }
        }
        if tokens == 0 {
            return Err(Error::config("tokens", 0, "an integer >= 1"));
        }
        let layers = self.cfg.layers as usize;
        let mut state = RequestState::new(id, from_prefix, prefix, layers, self.kept.add());
        state.versions = (
            self.fresh_version(id.raw()),
            prefix.map_or(0, |p| {
                self.tier
                    .prompt_versions
                    .get(&p.namespace)
                    .copied()
                    .unwrap_or(0)
            }),
        );
        if let (Some(p), Some(t)) = (
            prefix,
            prefix.and_then(|p| self.tier.prompt_index.get(&p.namespace)),
        ) {
            for (l, idx) in t.iter().enumerate() {
                state.set_index(l as u16, 0..p.pages, &idx[..p.pages as usize]);
            }
        }
        self.requests.insert(id, state);
        if tokens == from_prefix {
            return Ok(Vec::new());
        }
        match self.extend(id, tokens - from_prefix) {
            Ok((_, slots)) => Ok(slots),
            Err(e) => {
                let r = self.requests.remove(&id).expect("inserted above");
                self.release_kept_of(r.kept_slot)?;
                Err(e)
            }
        }
    }

    /// Ends request `id`: its objects go now, or when the last pin or transfer touching them
    /// ends. Shared prefixes stay.
    pub fn finish_request(&mut self, id: RequestId) -> Result<()> {
        let Some(r) = self.requests.remove(&id) else {
            return Err(Error::config("rid", id, "a running request"));
        };
        self.release_kept_of(r.kept_slot)?;
        self.xfer.forget(id.raw());
        self.dir
            .drop_namespace(Namespace {
                id: id.raw(),
                version: r.versions.0,
            })
            .map(|_| ())
    }
}

impl Tier for Plain {
    const JOINED: bool = false;

    fn start_pages(
        s: &mut StepScheduler<Self>,
        starts: &[(RequestId, Range<u32>)],
    ) -> Result<(Vec<ObjectKey>, Vec<SlotId>)> {
        let n: usize = starts.iter().map(|(_, r)| r.len()).sum();
        let mut keys = Vec::with_capacity(n * s.cfg.layers as usize);
        for (id, range) in starts {
            let r = &s.requests[id];
            for l in 0..s.cfg.layers {
                keys.extend(range.clone().map(|page| r.key(page, l)));
            }
        }
        let slots = s.allocate_with_room(&keys, None)?;
        Ok((keys, slots))
    }

    fn count_loads(
        _: &mut StepScheduler<Self>,
        _: u16,
        _: &[ObjectKey],
        _: &[bool],
        _: &[u32],
        _: &[RequestId],
    ) {
    }

    fn end_step(_: &mut StepScheduler<Self>) -> Result<()> {
        Ok(())
    }

    fn drain(_: &mut StepScheduler<Self>) -> Result<()> {
        Ok(())
    }

    fn validate(_: &StepScheduler<Self>) -> std::result::Result<(), String> {
        Ok(())
    }

    fn make_room(_: &mut StepScheduler<Self>) -> Result<()> {
        Ok(())
    }

    fn adopt_own(_: &mut StepScheduler<Self>, _: &[ObjectKey], _: &[ObjectHint]) -> Result<()> {
        Ok(())
    }

    fn reclaim(_: &mut StepScheduler<Self>, _: usize) -> Result<usize> {
        Ok(0)
    }

    fn extra_pins(_: &StepScheduler<Self>) -> u64 {
        0
    }

    fn device_victims(_: &StepScheduler<Self>) -> rustc_hash::FxHashSet<u32> {
        Default::default()
    }

    fn device_step_open(&self) -> bool {
        false
    }

    #[cfg(any(test, feature = "testing"))]
    fn restore_faults(&self) -> u64 {
        0
    }
}
