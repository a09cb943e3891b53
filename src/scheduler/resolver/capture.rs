//! A layer's launches (its marks, then its resolve) captured in a CUDA graph and replayed in
//! later steps. They take the same arguments every step while the kernel's buffers stay where they are (the step's
//! grant length, serial, log room and request count are in device memory, `st`); the kernel
//! counts the moves of those buffers as an epoch. The host learns nothing from a replay, so
//! the engine says which layers a replay runs before it replays them (`will_replay`), and the
//! resolver accounts them as the step's calls, as if they had been launched one by one.
//! Captures are kept by layer and rows (a graph per batch bucket): the latest of each.

use super::kernel::CaptureTo;
use super::ResolverState;
use crate::error::{Error, Result};
use crate::ids::RequestId;

/// A layer's captured launch: the epoch of the buffers it names, its selection's rows (a
/// step of fewer requests leaves the rest as padding) and width, and its place among the
/// step's calls.
#[derive(Debug, Clone, Copy)]
pub(super) struct Captured {
    epoch: u64,
    k: usize,
    call: u32,
}

impl ResolverState {
    /// Captures `layer`'s launch over `cells` = (sel, table, cells, k) for the batch `rids`
    /// (`to`: a capturing stream, or in test builds the host), and keeps what its replays
    /// must find.
    ///
    /// # Safety
    /// As [`ResolverState::resolve_layer_device`]'s, for every replay.
    pub(super) unsafe fn capture_launch(
        &mut self,
        to: CaptureTo,
        (layer, rids): (u16, &[RequestId]),
        cells: (u64, u64, usize, usize),
        tokens: bool,
    ) -> Result<()> {
        if rids != self.step_order.as_slice() {
            return Err(Error::config(
                "rids",
                format!("{} requests, not the step's in its order", rids.len()),
                "the step's batch in begin_device_step's order (a captured launch reads the \
                 rows uploaded when the step opened)",
            ));
        }
        let k = cells.3;
        // (Rows of no entries: as many as the batch.)
        let rows = cells.2.checked_div(k).unwrap_or(rids.len());
        let call = self.capture_call(layer, rows)?;
        let page_size = self.page_size;
        let Some(kern) = self.kernel.as_mut() else {
            return Err(Error::config(
                "resolver",
                "the reference (CPU)",
                "a resolver whose kernel runs on a device",
            ));
        };
        // SAFETY: the caller's contract.
        unsafe { kern.capture(to, (layer, rows), cells, call, (page_size, tokens))? };
        self.captured_launch(layer, rows, k, call);
        Ok(())
    }

    /// The call a launch of `layer` over `rows` rows captured now takes: the one after the
    /// last launch of as many rows captured since the step opened and not replayed yet, or
    /// else after the step's calls (each batch bucket's graph numbers its launches on from
    /// where its replay will start). Refused for a layer captured already in this step at
    /// these rows.
    fn capture_call(&self, layer: u16, rows: usize) -> Result<u32> {
        if self.pending.contains(&(layer, rows)) {
            return Err(Error::config(
                "layer",
                layer,
                format!("a layer not captured yet this step over {rows} rows"),
            ));
        }
        let last = self.pending.iter().rev().find(|p| p.1 == rows);
        Ok(last.map_or(self.call, |p| self.captured[p].call) + 1)
    }

    /// Keeps what a replay of `layer`'s launch over `rows` rows, captured as call `call`,
    /// must find: a step of at most `rows` requests granted rows of `k` entries at least, in
    /// the same epoch.
    fn captured_launch(&mut self, layer: u16, rows: usize, k: usize, call: u32) {
        let epoch = self.kernel.as_ref().map_or(0, |k| k.epoch);
        self.pending.push((layer, rows));
        self.captured
            .insert((layer, rows), Captured { epoch, k, call });
    }

    /// Forgets every capture (the kernel's buffers were replaced).
    pub(super) fn forget_captures(&mut self) {
        self.captured.clear();
        self.pending.clear();
    }

    /// The epoch of the open step's launch arguments (`None` on the reference, which has
    /// none): a launch captured in a step of another epoch names buffers that moved.
    pub fn graph_epoch(&self) -> Option<u64> {
        self.kernel.as_ref().map(|k| k.epoch)
    }

    /// Accounts the captured launches of `layers`, in order, as the open step's next calls,
    /// before a graph replays them (on the step's stream). `rows` names the graph's rows (its
    /// batch bucket); `None` when each layer has one capture. Refused, with nothing changed,
    /// unless each layer's launch was captured, is not resolved yet this step, was captured
    /// with at least a row per request of this step (the rest padding) no wider than this
    /// step's grant, in this epoch, and takes the step's next call.
    pub fn will_replay(&mut self, layers: &[u16], rows: Option<usize>) -> Result<()> {
        if !self.open {
            return Err(Error::config(
                "step",
                "not granted",
                "a step the core granted (begin_device_step) and did not end yet",
            ));
        }
        let Some(epoch) = self.graph_epoch() else {
            return Err(Error::config(
                "resolver",
                "the reference (CPU)",
                "a resolver whose kernel runs on a device",
            ));
        };
        let mut call = self.call;
        let mut seen = vec![false; self.layers as usize];
        let mut keys = Vec::with_capacity(layers.len());
        for &layer in layers {
            if layer >= self.layers {
                return Err(Error::out_of_range("layers", layer, 0, self.layers));
            }
            let key = self.capture_of(layer, rows)?;
            let c = self.captured[&key];
            if self.resolved[layer as usize] || seen[layer as usize] {
                return Err(Error::config(
                    "layers",
                    layer,
                    "a layer not resolved yet this step (each layer once a step)",
                ));
            }
            seen[layer as usize] = true;
            if key.1 < self.step_rids.len() {
                return Err(Error::config(
                    "rids",
                    format!("a step of {} requests", self.step_rids.len()),
                    format!(
                        "a step of at most {} requests, the rows captured (the rest padding)",
                        key.1
                    ),
                ));
            }
            if c.k > self.entries {
                return Err(Error::config(
                    "selection.shape",
                    format!("rows of {} entries, as captured", c.k),
                    format!(
                        "at most {} entries a row, as granted by begin_device_step",
                        self.entries
                    ),
                ));
            }
            if c.epoch != epoch {
                return Err(Error::config(
                    "graph_epoch",
                    c.epoch,
                    format!(
                        "the open step's, {epoch}: the resolver's buffers moved since the \
                         capture (capture again)"
                    ),
                ));
            }
            if c.call != call + 1 {
                return Err(Error::config(
                    "layers",
                    layer,
                    format!(
                        "the captured launches in the order they were captured, from the \
                         step's call {} (layer {layer} was captured as call {})",
                        call + 1,
                        c.call
                    ),
                ));
            }
            call += 1;
            keys.push(key);
        }
        for key in keys {
            self.resolved[key.0 as usize] = true;
            self.pending.retain(|p| *p != key);
        }
        self.call = call;
        Ok(())
    }

    /// The capture of `layer` a replay names: over `rows` rows, or its only one.
    fn capture_of(&self, layer: u16, rows: Option<usize>) -> Result<(u16, usize)> {
        if let Some(r) = rows {
            return if self.captured.contains_key(&(layer, r)) {
                Ok((layer, r))
            } else {
                Err(Error::config(
                    "layers",
                    layer,
                    format!("layers whose launch a graph captured over {r} rows"),
                ))
            };
        }
        let mut of_layer = self.captured.keys().filter(|k| k.0 == layer);
        match (of_layer.next(), of_layer.next()) {
            (Some(&key), None) => Ok(key),
            (None, _) => Err(Error::config(
                "layers",
                layer,
                "layers whose launch a graph captured (resolve under capture)",
            )),
            (Some(_), Some(_)) => {
                let mut all: Vec<usize> = self
                    .captured
                    .keys()
                    .filter(|k| k.0 == layer)
                    .map(|k| k.1)
                    .collect();
                all.sort_unstable();
                Err(Error::config(
                    "rows",
                    "None",
                    format!(
                        "the rows of the graph replayed: layer {layer} has captures over {all:?}"
                    ),
                ))
            }
        }
    }

    /// Sizes the kernel's buffers for steps of up to `requests` requests (and as many
    /// running), rows of up to `entries` entries and requests of up to `pages` pages, so
    /// that `graph_epoch` stays put while steps stay within them: graphs captured once
    /// replay for the whole run. Only between steps; nothing to do on the reference.
    pub fn reserve(&mut self, requests: usize, entries: usize, pages: usize) -> Result<()> {
        if self.open {
            return Err(Error::config(
                "step",
                "open",
                "no step granted and not yet ended",
            ));
        }
        let Some(kern) = self.kernel.as_mut() else {
            return Ok(());
        };
        // A layer's cells, and the longest grant: twice a step's misses (a cell a layer
        // each), and never more than the device has slots.
        let too_big = || {
            Error::config(
                "requests",
                format!("{requests} x {entries} entries x {pages} pages"),
                "sizes whose buffers a 32-bit index holds",
            )
        };
        let cells = requests
            .checked_mul(entries.min(pages))
            .filter(|&c| i32::try_from(c.saturating_mul(self.layers as usize)).is_ok())
            .ok_or_else(too_big)?;
        let slots = self.device.pages() as usize;
        let grant = (2 * cells * self.layers as usize).clamp(cells, slots.max(cells));
        kern.reserve(requests, (cells, grant, pages))
    }

    /// Whether a CUDA graph is capturing `stream` (a stream of the kernel's device).
    pub fn stream_capturing(&self, stream: u64) -> Result<bool> {
        match &self.kernel {
            Some(k) => k.capturing(stream),
            None => Ok(false),
        }
    }

    /// Test builds: from now on (`on`), launches over host memory are recorded instead of
    /// run, as a graph's capture records them (the kernel on the CPU only).
    #[cfg(any(test, feature = "testing"))]
    pub fn record_launches(&mut self, on: bool) -> Result<()> {
        if !self.kernel.as_ref().is_some_and(|k| k.on_host()) {
            return Err(Error::config(
                "resolver",
                "not the kernel on the CPU",
                "the kernel's source on CPU threads (use_host_kernel)",
            ));
        }
        self.recording = on;
        Ok(())
    }

    /// Test builds: runs the recorded launches of `layers` over `rows` rows as they were
    /// recorded (a graph's replay, after [`Self::will_replay`]).
    ///
    /// # Safety
    /// The host memory the recorded launches name as their selection and table is alive.
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn replay_recorded(&mut self, layers: &[u16], rows: Option<usize>) -> Result<()> {
        let mut keys = Vec::with_capacity(layers.len());
        for &layer in layers {
            keys.push(self.capture_of(layer, rows)?);
        }
        let Some(kern) = self.kernel.as_mut().filter(|k| k.on_host()) else {
            return Err(Error::config(
                "resolver",
                "not the kernel on the CPU",
                "the kernel's source on CPU threads (use_host_kernel)",
            ));
        };
        for (layer, r) in keys {
            // SAFETY: the caller's contract.
            unsafe { kern.replay_recorded(layer, r)? };
        }
        Ok(())
    }
}
