//! The step scheduler's counters as `stats()` and `prefix_stats()` hand them to Python, read
//! under the scheduler's lock.

use crate::py::stats::Stats;
use crate::scheduler::{JoinedScheduler, StepScheduler, Tier};

/// Joined mode's prefix-tier counters and the prefix cache's page counts (`prefix_stats`),
/// read under the lock.
pub(super) fn prefix_stats(s: &JoinedScheduler) -> Stats {
    let (t, p) = (s.prefix_totals(), s.prefix_tier());
    let mut d = Stats::default();
    d.put("requests", t.requests);
    d.put("hits", t.hits);
    d.put("device_hit_tokens", t.device_hit_tokens);
    d.put("host_hit_tokens", t.host_hit_tokens);
    d.put("indexer_bytes_restored", t.sidecar_bytes_restored);
    d.put("prefix_kv_bytes_loaded", t.prefix_kv_bytes_loaded);
    d.put("prefix_kv_bytes_first", t.prefix_kv_bytes_first);
    d.put("device_part_kv_bytes_loaded", t.device_part_kv_bytes_loaded);
    d.put("full_restore_bytes", t.full_restore_bytes);
    d.put("restores_refused", t.restores_refused);
    d.put("restores_failed", t.restores_failed);
    d.put("pages_inserted", t.pages_inserted);
    d.put("writes_failed", t.writes_failed);
    d.put("restores_indexer_only", t.restores_indexer_only);
    d.put("restores_full", t.restores_full);
    d.put("restores_predicted", t.restores_predicted);
    d.put("restores_partial", t.restores_partial);
    d.put("restore_objects_predicted", t.restore_objects_predicted);
    d.put("restore_objects_loaded", t.restore_objects_loaded);
    d.put("restore_model_abs_error", t.restore_model_abs_error);
    d.put("restore_objects_if_indexer", t.restore_objects_if_indexer);
    d.put("restore_objects_if_full", t.restore_objects_if_full);
    d.put(
        "restore_objects_if_predicted",
        t.restore_objects_if_predicted,
    );
    d.put("restore_copy_overhead", s.restore_policy().copy_overhead());
    let c = p.cache();
    let (hf, hc) = c.host_free_capacity();
    d.put("device_free", c.device_free());
    d.put("device_capacity", c.device_capacity());
    d.put("host_free", hf);
    d.put("host_capacity", hc);
    d.put("tree_nodes", c.tree().node_count());
    d.put("finishing", s.finishing());
    d
}

/// The directory's counts and the scheduler's own (`stats`), read under the lock.
pub(super) fn scheduler_stats<T: Tier>(
    s: &StepScheduler<T>,
) -> (crate::directory::DirectoryStats, Stats) {
    let mut d = Stats::default();
    let (loads, backups) = s.in_flight();
    let (plans, prefetches) = s.outstanding();
    // A release build has no fault hooks: nothing is ever armed (the keys stay, as 0).
    #[cfg(feature = "testing")]
    let ((fl, fb, fr), panics) = (s.armed_faults(), s.copy_panics_injected());
    #[cfg(not(feature = "testing"))]
    let ((fl, fb, fr), panics) = ((0u64, 0u64, 0u64), 0u64);
    d.put("faults_armed_loads", fl);
    d.put("faults_armed_backups", fb);
    d.put("faults_armed_restores", fr);
    d.put("copy_panics_injected", panics);
    d.put("loads_in_flight", loads);
    d.put("backups_in_flight", backups);
    d.put("plans_outstanding", plans);
    d.put("prefetches_outstanding", prefetches);
    d.put("requests", s.requests().count());
    d.put("kept_pins", s.kept_pins());
    (s.directory().stats(), d)
}
