//! A layer's launch captured in a CUDA graph and replayed in later steps. A launch takes the
//! same arguments every step while the kernel's buffers stay where they are (the step's
//! grant length, serial and log room are in device memory, `st`); the kernel counts the
//! moves of those buffers as an epoch. The host learns nothing from a replay, so the engine
//! says which layers a replay runs before it replays them (`will_replay`), and the resolver
//! accounts them as the step's calls, as if they had been launched one by one.

use super::ResolverState;
use crate::error::{Error, Result};

/// A layer's captured launch: the epoch of the buffers it names, its batch's row count and
/// width, and its place among the step's calls.
#[derive(Debug, Clone, Copy)]
pub(super) struct Captured {
    epoch: u64,
    rows: usize,
    k: usize,
    call: u32,
}

impl ResolverState {
    /// Keeps what a replay of `layer`'s captured launch must find: a step of `rows` requests
    /// granted rows of `k` entries at least, in the same epoch. (A captured launch's call
    /// comes after the step's calls and the launches captured since it opened.)
    pub(super) fn captured_launch(&mut self, layer: u16, rows: usize, k: usize, call: u32) {
        let epoch = self.kernel.as_ref().map_or(0, |k| k.epoch);
        self.captured_calls += 1;
        self.captured[layer as usize] = Some(Captured {
            epoch,
            rows,
            k,
            call,
        });
    }

    /// The epoch of the open step's launch arguments (`None` on the reference, which has
    /// none): a launch captured in a step of another epoch names buffers that moved.
    pub fn graph_epoch(&self) -> Option<u64> {
        self.kernel.as_ref().map(|k| k.epoch)
    }

    /// Accounts the captured launches of `layers`, in order, as the open step's next calls,
    /// before a graph replays them (on the step's stream). Refused, with nothing changed,
    /// unless each layer's launch was captured, is not resolved yet this step, was captured
    /// for a step of as many requests with rows no wider than this step's grant, in this
    /// epoch, and takes the step's next call.
    pub fn will_replay(&mut self, layers: &[u16]) -> Result<()> {
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
        for &layer in layers {
            if layer >= self.layers {
                return Err(Error::out_of_range("layers", layer, 0, self.layers));
            }
            let Some(c) = self.captured[layer as usize] else {
                return Err(Error::config(
                    "layers",
                    layer,
                    "layers whose launch a graph captured (resolve under capture)",
                ));
            };
            if self.resolved[layer as usize] || seen[layer as usize] {
                return Err(Error::config(
                    "layers",
                    layer,
                    "a layer not resolved yet this step (each layer once a step)",
                ));
            }
            seen[layer as usize] = true;
            if c.rows != self.step_rids.len() {
                return Err(Error::config(
                    "rids",
                    format!("a step of {} requests", self.step_rids.len()),
                    format!("a step of {} requests, as captured", c.rows),
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
        }
        for &layer in layers {
            self.resolved[layer as usize] = true;
        }
        self.call = call;
        Ok(())
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

    /// Test builds: runs the recorded launches of `layers` as they were recorded (a graph's
    /// replay, after [`Self::will_replay`]).
    ///
    /// # Safety
    /// The host memory the recorded launches name as their selection and table is alive.
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn replay_recorded(&mut self, layers: &[u16]) -> Result<()> {
        let Some(kern) = self.kernel.as_mut().filter(|k| k.on_host()) else {
            return Err(Error::config(
                "resolver",
                "not the kernel on the CPU",
                "the kernel's source on CPU threads (use_host_kernel)",
            ));
        };
        for &layer in layers {
            // SAFETY: the caller's contract.
            unsafe { kern.replay_recorded(layer)? };
        }
        Ok(())
    }
}
