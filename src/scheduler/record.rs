//! The step record: seed 002's record table for one decode step, folded inside the scheduler.
//!
//! Every figure is counted where the event happens (plan, ready, finish, settle), so a record
//! never depends on Python having looked at anything.

/// What one decode step (everything between two `end_step` calls) selected, moved and waited.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepRecord {
    /// Step number (0-based).
    pub step: u64,
    /// Requests appended this step.
    pub requests: u64,
    /// Layer plans finished.
    pub layers: u64,
    /// Selection entries (blocks or tokens) that named a page, before dedup.
    pub selected: u64,
    /// Distinct objects read after dedup: (request, page, layer), or in the joined mode (home,
    /// layer), so a prefix page two requests read counts once.
    pub pages: u64,
    /// Of those, already Ready on the device.
    pub ready: u64,
    /// Of those, loaded by this step's plans (were Absent).
    pub loaded: u64,
    /// Of those, found Loading: joined an in-flight transfer (in-flight reuse).
    pub joined: u64,
    /// Bytes of the selected tokens (what attention reads), over every distinct page.
    pub bytes_needed: u64,
    /// Bytes moved host -> device: demand loads, retries and prefetch loads.
    pub bytes_transferred: u64,
    /// Bytes of selected tokens inside the pages this step moved: the denominator of read
    /// amplification as seed 002 defines it.
    pub bytes_needed_of_transferred: u64,
    /// Load submissions (one per planned layer with misses, prefetches and retries).
    pub load_submissions: u64,
    /// Contiguous copies those submissions made after merging.
    pub copy_segments: u64,
    /// Pages written through to host this step (submitted).
    pub backup_pages: u64,
    /// Backup submissions.
    pub backup_submissions: u64,
    /// Pages prefetch predicted (last step's selection of the same layer).
    pub prefetch_predicted: u64,
    /// Predicted pages the real selection then named.
    pub prefetch_hits: u64,
    /// Pages prefetch loaded (were Absent).
    pub prefetch_loaded: u64,
    /// Pages prefetch loaded that no selection named: wasted.
    pub prefetch_wasted: u64,
    /// Bytes of the wasted prefetch loads.
    pub prefetch_wasted_bytes: u64,
    /// Prefetches skipped because the device could not hold them next to the pinned work.
    pub prefetch_skipped: u64,
    /// Load transfers that failed (each failure, retries included).
    pub failed_loads: u64,
    /// Retries submitted after a failed load.
    pub retried_loads: u64,
    /// Distinct requests reported failed (after a retry failed too) this step.
    pub failed_requests: u64,
    /// Backup transfers that failed.
    pub failed_backups: u64,
    /// Sum over plans of selection done -> last load submitted (queueing), ns.
    pub queue_ns: u64,
    /// Sum over plans of submitted -> loads finished (transfer), ns; plans without loads add 0.
    pub transfer_ns: u64,
    /// Time the consumer was blocked in `ready` (the wait prefetch and overlap did not hide), ns.
    pub exposed_wait_ns: u64,
    /// When the step's first selection was handed to `plan` (ns since the scheduler started).
    pub selection_done_ns: u64,
    /// When the step's last load was submitted (0 if none).
    pub submitted_ns: u64,
    /// When the step's last plan became readable (`ready` returned).
    pub ready_ns: u64,
    /// When the step's last plan was consumed (`finish`).
    pub consumed_ns: u64,
    /// CPU time spent inside the scheduler's step calls (plan, ready, finish, append, end_step),
    /// exposed wait excluded, ns.
    pub cpu_ns: u64,
    /// Of `cpu_ns`: inside `plan`, ns. The five calls' shares sum to `cpu_ns`.
    pub cpu_plan_ns: u64,
    /// Of `cpu_ns`: inside `ready`, exposed wait excluded (settling loads, retries), ns.
    pub cpu_ready_ns: u64,
    /// Of `cpu_ns`: inside `finish` (kept lists refreshed, pins released), ns.
    pub cpu_finish_ns: u64,
    /// Of `cpu_ns`: inside `append`, ns.
    pub cpu_append_ns: u64,
    /// Of `cpu_ns`: inside `end_step` (backups submitted, transfers settled), ns.
    pub cpu_end_step_ns: u64,
    /// Of `cpu_plan_ns`: the selection's rows (pages mapped, merged with the kept lists,
    /// resolve hints looked up), ns.
    pub cpu_rows_ns: u64,
    /// Of `cpu_plan_ns`: the directory's resolve of the rows' new pages (room made
    /// included), ns.
    pub cpu_resolve_ns: u64,
    /// Of `cpu_plan_ns`: the load's submission to the copy engine, ns.
    pub cpu_submit_ns: u64,
    /// Prefetches issued (inside `plan` for the layers ahead, inside `end_step` for the next
    /// step's first), ns.
    pub cpu_prefetch_ns: u64,
    /// Device slots held by objects at the end of the step.
    pub device_used: u64,
    /// Usable device slots.
    pub device_capacity: u64,
    /// Most objects pinned at once during the step.
    pub pinned_peak: u64,
    /// Most objects pinned by prefetch at once during the step (prefetch occupancy).
    pub prefetch_pinned_peak: u64,
}

/// Calls `$m!` with the fields a step record sums across plans and steps (one list for `fold`
/// and `pairs`).
macro_rules! summed_counters {
    ($m:ident $(, $extra:ident)*) => {
        $m! {
            requests,
            layers,
            selected,
            pages,
            ready,
            loaded,
            joined,
            bytes_needed,
            bytes_transferred,
            bytes_needed_of_transferred,
            load_submissions,
            copy_segments,
            backup_pages,
            backup_submissions,
            prefetch_predicted,
            prefetch_hits,
            prefetch_loaded,
            prefetch_wasted,
            prefetch_wasted_bytes,
            prefetch_skipped,
            failed_loads,
            retried_loads,
            failed_requests,
            failed_backups,
            queue_ns,
            transfer_ns,
            exposed_wait_ns,
            cpu_ns,
            cpu_plan_ns,
            cpu_ready_ns,
            cpu_finish_ns,
            cpu_append_ns,
            cpu_end_step_ns,
            cpu_rows_ns,
            cpu_resolve_ns,
            cpu_submit_ns,
            cpu_prefetch_ns
            $(, $extra)*
        }
    };
}

/// Calls `$m!` with every field of a step record: the summed counters, then the step number,
/// timestamps, usage and peaks (what `pairs` exports and the Python record's attributes).
macro_rules! all_fields {
    ($m:ident) => {
        $crate::scheduler::record::summed_counters! {
            $m,
            step,
            selection_done_ns,
            submitted_ns,
            ready_ns,
            consumed_ns,
            device_used,
            device_capacity,
            pinned_peak,
            prefetch_pinned_peak
        }
    };
}
#[cfg(feature = "python")] // the Python record's attributes (`py/step_results.rs`)
pub(crate) use all_fields;
pub(crate) use summed_counters;

impl StepRecord {
    /// Bytes transferred / bytes needed among what was transferred (seed 002): 1 when whole
    /// selected pages moved, above 1 when selected tokens sit sparsely in moved pages or
    /// prefetch moved pages nobody read (infinite when nothing that moved was read). `None`
    /// when nothing moved: there is nothing to amplify, and 0 would read as a figure below
    /// the 1 the definition cannot go under.
    pub fn read_amplification(&self) -> Option<f64> {
        match (self.bytes_transferred, self.bytes_needed_of_transferred) {
            (0, _) => None,
            (_, 0) => Some(f64::INFINITY),
            (t, n) => Some(t as f64 / n as f64),
        }
    }

    /// Share of the selected distinct pages already on the device (equal-size pages, so it is
    /// also the byte hit rate); `None` when nothing was selected.
    pub fn device_byte_hit_rate(&self) -> Option<f64> {
        ratio(self.ready, self.pages)
    }

    /// Share of the selected pages that prefetch had predicted; `None` when nothing was
    /// selected.
    pub fn prefetch_accuracy(&self) -> Option<f64> {
        ratio(self.prefetch_hits, self.pages)
    }

    /// Every field by name (what the Python binding exports): the summed counters, then the
    /// step number, timestamps, usage and peaks.
    pub fn pairs(&self) -> Vec<(&'static str, u64)> {
        macro_rules! pairs {
            ($($f:ident),*) => { vec![$((stringify!($f), self.$f)),*] };
        }
        all_fields!(pairs)
    }

    /// Adds the counters of `o` (peaks take the max; capacity and usage take `o`'s).
    pub fn fold(&mut self, o: &StepRecord) {
        macro_rules! add {
            ($($f:ident),*) => { $( self.$f += o.$f; )* };
        }
        summed_counters!(add);
        self.pinned_peak = self.pinned_peak.max(o.pinned_peak);
        if self.selection_done_ns == 0
            || (o.selection_done_ns != 0 && o.selection_done_ns < self.selection_done_ns)
        {
            self.selection_done_ns = o.selection_done_ns;
        }
        self.submitted_ns = self.submitted_ns.max(o.submitted_ns);
        self.ready_ns = self.ready_ns.max(o.ready_ns);
        self.consumed_ns = self.consumed_ns.max(o.consumed_ns);
        self.prefetch_pinned_peak = self.prefetch_pinned_peak.max(o.prefetch_pinned_peak);
        self.device_used = o.device_used;
        self.device_capacity = o.device_capacity;
    }
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b != 0).then(|| a as f64 / b as f64)
}

#[cfg(test)]
mod tests {
    use super::StepRecord;

    #[test]
    fn ratios_are_undefined_without_a_denominator() {
        let idle = StepRecord::default();
        assert_eq!(idle.read_amplification(), None, "nothing moved");
        assert_eq!(idle.device_byte_hit_rate(), None, "nothing selected");
        assert_eq!(idle.prefetch_accuracy(), None);
        let hits_only = StepRecord {
            pages: 4,
            ready: 4,
            ..StepRecord::default()
        };
        assert_eq!(hits_only.read_amplification(), None);
        assert_eq!(hits_only.device_byte_hit_rate(), Some(1.0));
        let wasted = StepRecord {
            bytes_transferred: 128,
            ..StepRecord::default()
        };
        assert_eq!(wasted.read_amplification(), Some(f64::INFINITY));
        let sparse = StepRecord {
            bytes_transferred: 128,
            bytes_needed_of_transferred: 32,
            ..StepRecord::default()
        };
        assert_eq!(sparse.read_amplification(), Some(4.0));
    }
}
