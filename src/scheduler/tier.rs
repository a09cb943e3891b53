//! The two kinds of step scheduler, as types. What differs between them is here; the step
//! itself (`append`, `plan`, `ready`, `finish`, `end_step`) is generic over the kind.
//!
//! - [`Plain`]: host copies live in a host pool of the scheduler's own; shared prompts are
//!   stored by namespace (`add_prompt`) and requests registered by length (`add_request`).
//! - [`PrefixTier`]: the joined scheduler. Host copies live at the host pages of a radix
//!   prefix cache; requests are admitted by their tokens (`admit`) and their pages enter the
//!   cache when they end.
//!
//! The trait is sealed: these two are the kinds there are. A call only the other kind has
//! does not compile:
//!
//! ```compile_fail
//! fn store(s: &mut sparsetier::scheduler::JoinedScheduler) {
//!     s.add_prompt(1, 2).unwrap(); // a joined scheduler admits requests by their tokens
//! }
//! ```
//!
//! ```compile_fail
//! fn admit(s: &mut sparsetier::scheduler::StepScheduler) {
//!     s.admit(sparsetier::ids::RequestId::new(1), &[1, 2, 3]).unwrap();
//! }
//! ```
//!
//! ```
//! fn both<T: sparsetier::scheduler::Tier>(s: &mut sparsetier::scheduler::StepScheduler<T>) {
//!     s.end_step().unwrap(); // the step is the same for both
//! }
//! ```

use super::core::StepScheduler;
use super::prefix::PrefixTier;
use crate::directory::{ObjectHint, ObjectKey};
use crate::error::Result;
use crate::ids::{RequestId, SlotId};
use rustc_hash::FxHashMap;
use std::ops::Range;

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Plain {}
    impl Sealed for super::PrefixTier {}
}

/// Where a step scheduler's host copies live, and the hooks of the step that depend on it.
pub trait Tier: sealed::Sealed + Sized + Send + 'static {
    /// Host copies live at prefix-cache pages (the directory's own host allocator is unused,
    /// and matched prefix pages are counted apart).
    const JOINED: bool;

    /// Creates every layer's object of the pages `starts` name (per start, layer-major) on
    /// the device; returns their keys and slots.
    fn start_pages(
        s: &mut StepScheduler<Self>,
        starts: &[(RequestId, Range<u32>)],
    ) -> Result<(Vec<ObjectKey>, Vec<SlotId>)>;

    /// Counts the loads of matched prefix pages (`from_prefix[i]`: the page key `i` reads,
    /// or `NONE`), and hands what the host loaded (`keys`, the plan's; empty for loads the
    /// device resolver made itself) to the resolver's mirror; only called when
    /// [`Self::JOINED`].
    fn count_loads(
        s: &mut StepScheduler<Self>,
        layer: u16,
        keys: &[ObjectKey],
        loaded: &[bool],
        from_prefix: &[u32],
        key_rids: &[RequestId],
    );

    /// At the end of a step, after the transfers were polled.
    fn end_step(s: &mut StepScheduler<Self>) -> Result<()>;

    /// At the end of `drain`, once every transfer landed.
    fn drain(s: &mut StepScheduler<Self>) -> Result<()>;

    /// The tier's own invariants.
    fn validate(s: &StepScheduler<Self>) -> std::result::Result<(), String>;

    /// When the host runs out of device slots: gives back what the tier holds on the device
    /// that it can do without (joined: the device resolver's holds, grant and pool).
    fn make_room(s: &mut StepScheduler<Self>) -> Result<()>;

    /// When the host lacks `n` device slots: frees them from what the tier keeps on the device
    /// for itself, if it can, before anything is given up (joined: the device resolver's
    /// pool). Returns the slots freed.
    fn reclaim(s: &mut StepScheduler<Self>, n: usize) -> Result<usize>;

    /// Before the host resolves `keys` (a plan's): what the tier holds on the device for
    /// itself of them is handed to the directory where it is, so that it is not loaded again
    /// (joined: objects the device resolver's pool holds).
    fn adopt_own(
        s: &mut StepScheduler<Self>,
        keys: &[ObjectKey],
        hints: &[ObjectHint],
    ) -> Result<()>;

    /// Pins the tier holds outside plans, prefetches and kept selections (joined: the device
    /// resolver's holds and victims).
    fn extra_pins(s: &StepScheduler<Self>) -> u64;

    /// Objects the device may evict at its next step, which a kept selection must not hold
    /// (joined: the victims the device resolver's standing grant holds).
    fn device_victims(s: &StepScheduler<Self>) -> rustc_hash::FxHashSet<u32>;

    /// Whether a device step is open (joined: between `begin_device_step` and `end_step`).
    fn device_step_open(&self) -> bool;

    /// Restore faults still armed (joined only; test builds).
    #[cfg(any(test, feature = "testing"))]
    fn restore_faults(&self) -> u64;
}

/// The plain scheduler's own state: the shared prompts it stores.
#[derive(Debug, Default)]
pub struct Plain {
    /// Whole pages of each stored prompt, by namespace.
    pub(super) prompts: FxHashMap<u64, u32>,
    /// Per stored prompt, per layer: the directory's object index of each page.
    pub(super) prompt_index: FxHashMap<u64, Vec<Vec<ObjectHint>>>,
    /// The namespace version of each stored prompt (see `fresh_version`).
    pub(super) prompt_versions: FxHashMap<u64, u32>,
}
