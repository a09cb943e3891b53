//! Pool groups and the host-budget plan.
//!
//! A [`PoolGroup`] is one KV anchor plus sidecars (Indexer-K, SWA, draft), each with a
//! [`HitPolicy`]. Every pool of a group has the anchor's page size and page count on both
//! tiers, so one page index is valid in every pool of the group on that tier (host page 2 may
//! still restore into device page 5: the tiers' numbers are independent). A window-sized SWA
//! device pool is later work.
//!
//! [`plan_stack`] turns a group and a [`StackConfig`] into a [`Plan`]: per pool and tier, the
//! page bytes, pages, logical token capacity and buffer bytes. The plan reports the target
//! budget and the actual buffer bytes separately: page rounding and reserve pages make them
//! differ.
//!
//! # The host budget
//! With an absolute budget B, the anchor gets `B x anchor_bytes / total_bytes` (the source's
//! rule), where `total_bytes` counts each pool's real device buffer bytes once (a sidecar is
//! never counted twice). The anchor's host page count is that share over its page bytes, rounded
//! down, and the sidecars copy it; each sidecar then holds its own proportional share.

use crate::config::{HitPolicy, HostBudget, StackConfig};
use crate::error::{Error, Result};
use crate::layout::{Component, HostLayout};
use crate::pool::PoolSpec;

/// Where a pool lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// GPU memory (L1).
    Device,
    /// Pinned host memory (L2).
    Host,
}

impl Tier {
    /// Canonical name, as the plan's JSON spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
        }
    }
}

/// One pool of a group with its hit policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupMember {
    /// The device pool's geometry.
    pub spec: PoolSpec,
    /// How the pool decides a prefix hit.
    pub hit: HitPolicy,
}

/// An anchor (KV) pool plus sidecars. Member 0 is the anchor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolGroup {
    members: Vec<GroupMember>,
}

impl PoolGroup {
    /// Builds a group from device pool specs: the first must be the KV anchor; each sidecar
    /// component appears at most once; every pool shares the anchor's page size and page
    /// count. `swa_window`
    /// (tokens) is required when an SWA pool is present and refused otherwise.
    pub fn new(pools: &[PoolSpec], swa_window: Option<u32>) -> Result<Self> {
        let Some(anchor) = pools.first() else {
            return Err(Error::config(
                "pools",
                "[]",
                "a list whose first pool is the KV anchor",
            ));
        };
        if anchor.component != Component::Kv {
            return Err(Error::config(
                "pools[0].component",
                anchor.component.name(),
                "KV: the first pool is the group's anchor",
            ));
        }
        let has_swa = pools.iter().any(|p| p.component == Component::Swa);
        match (has_swa, swa_window) {
            (true, None) | (true, Some(0)) => {
                return Err(Error::config(
                    "swa_window",
                    format!("{swa_window:?}"),
                    "a window of >= 1 tokens when an SWA pool is present",
                ))
            }
            (false, Some(w)) => {
                return Err(Error::config(
                    "swa_window",
                    w,
                    "None when the group has no SWA pool",
                ))
            }
            _ => {}
        }
        let mut members = Vec::with_capacity(pools.len());
        for (i, spec) in pools.iter().enumerate() {
            if i > 0 && pools[..i].iter().any(|p| p.component == spec.component) {
                return Err(Error::config(
                    format!("pools[{i}].component"),
                    spec.component.name(),
                    "a component not already in the group (one KV anchor, at most one \
                     INDEXER, SWA and DRAFT each)",
                ));
            }
            if spec.page_size != anchor.page_size {
                return Err(Error::config(
                    format!("pools[{i}].page_size"),
                    spec.page_size,
                    format!("{}: the page size of the KV anchor", anchor.page_size),
                ));
            }
            if spec.pages != anchor.pages {
                return Err(Error::config(
                    format!("pools[{i}].pages"),
                    spec.pages,
                    format!(
                        "{}: the page count of the KV anchor (one page index addresses every \
                         pool of the group)",
                        anchor.pages
                    ),
                ));
            }
            let hit = match spec.component {
                Component::Swa => HitPolicy::Window(swa_window.unwrap_or(1)),
                _ => HitPolicy::AllPages,
            };
            members.push(GroupMember { spec: *spec, hit });
        }
        Ok(PoolGroup { members })
    }

    /// The members, anchor first.
    pub fn members(&self) -> &[GroupMember] {
        &self.members
    }

    /// The KV anchor.
    pub fn anchor(&self) -> &PoolSpec {
        &self.members[0].spec
    }

    /// Bytes of one page index across every pool of the group.
    pub fn page_bytes_all_pools(&self) -> u64 {
        self.members
            .iter()
            .map(|m| m.spec.page_bytes_all_layers())
            .sum()
    }

    /// Device bytes of the whole group, each pool counted once.
    pub fn device_bytes(&self) -> u64 {
        self.members.iter().map(|m| m.spec.total_bytes()).sum()
    }
}

/// One pool on one tier in a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolPlan {
    /// What the pool holds.
    pub component: Component,
    /// Where it lives.
    pub tier: Tier,
    /// Buffer layout (device pools are always layer-first).
    pub layout: HostLayout,
    /// Hit policy of the pool in its group.
    pub hit: HitPolicy,
    /// Bytes of one page across every plane and layer.
    pub page_bytes: u64,
    /// Pages in the buffer, reserve included.
    pub pages: u32,
    /// Reserved pages, never handed out.
    pub reserve_pages: u32,
    /// Logical token capacity: usable pages x page size.
    pub tokens: u64,
    /// Actual buffer bytes.
    pub bytes: u64,
    /// The pool's geometry on this tier.
    pub spec: PoolSpec,
}

/// The layout of a whole stack across both tiers.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Device pools then host pools, anchor first within each tier.
    pub pools: Vec<PoolPlan>,
    /// The host budget aimed at, in bytes (for a ratio: device bytes x ratio).
    pub target_bytes: u64,
    /// The host buffers' real bytes.
    pub actual_bytes: u64,
}

impl Plan {
    /// Pools of one tier, anchor first.
    pub fn tier(&self, tier: Tier) -> impl Iterator<Item = &PoolPlan> {
        self.pools.iter().filter(move |p| p.tier == tier)
    }

    /// Total buffer bytes of one tier.
    pub fn tier_bytes(&self, tier: Tier) -> u64 {
        self.tier(tier).map(|p| p.bytes).sum()
    }

    /// Logical token capacity of one tier: the anchor's.
    pub fn tier_tokens(&self, tier: Tier) -> u64 {
        self.tier(tier).next().map_or(0, |p| p.tokens)
    }

    /// Pages of one tier's anchor (every host pool has the same count).
    pub fn tier_pages(&self, tier: Tier) -> u32 {
        self.tier(tier).next().map_or(0, |p| p.pages)
    }
}

/// Plans the device and host pools of `group` under `cfg`.
pub fn plan_stack(group: &PoolGroup, cfg: &StackConfig) -> Result<Plan> {
    if group.anchor().page_size != cfg.page_size {
        return Err(Error::config(
            "pools[0].page_size",
            group.anchor().page_size,
            format!("{}: the stack's page_size", cfg.page_size),
        ));
    }
    let mut pools = Vec::with_capacity(group.members().len() * 2);
    for m in group.members() {
        if cfg.device_reserve >= m.spec.pages {
            return Err(Error::config(
                "device_reserve",
                cfg.device_reserve,
                format!(
                    "fewer than the {} device pages of the {} pool",
                    m.spec.pages,
                    m.spec.component.name()
                ),
            ));
        }
        pools.push(pool_plan(
            m,
            m.spec,
            Tier::Device,
            HostLayout::LayerFirst,
            cfg.device_reserve,
        ));
    }
    let (host_pages, target_bytes) = host_pages(group, cfg)?;
    for m in group.members() {
        let spec = m.spec.with_pages(host_pages)?;
        pools.push(pool_plan(m, spec, Tier::Host, cfg.layout, cfg.host_reserve));
    }
    let actual_bytes = pools
        .iter()
        .filter(|p| p.tier == Tier::Host)
        .map(|p| p.bytes)
        .sum();
    Ok(Plan {
        pools,
        target_bytes,
        actual_bytes,
    })
}

fn pool_plan(
    m: &GroupMember,
    spec: PoolSpec,
    tier: Tier,
    layout: HostLayout,
    reserve: u32,
) -> PoolPlan {
    PoolPlan {
        component: spec.component,
        tier,
        layout,
        hit: m.hit,
        page_bytes: spec.page_bytes_all_layers(),
        pages: spec.pages,
        reserve_pages: reserve,
        tokens: u64::from(spec.pages - reserve) * u64::from(spec.page_size),
        bytes: spec.total_bytes(),
        spec,
    }
}

/// Host pages of every pool of the group (reserve included), and the target budget in bytes.
fn host_pages(group: &PoolGroup, cfg: &StackConfig) -> Result<(u32, u64)> {
    let group_page = group.page_bytes_all_pools();
    let (pages, target, field, given): (u128, u64, &str, String) = match cfg.host_budget {
        HostBudget::Bytes(budget) => {
            let anchor = group.anchor();
            let share = u128::from(budget) * u128::from(anchor.total_bytes())
                / u128::from(group.device_bytes());
            (
                share / u128::from(anchor.page_bytes_all_layers()),
                budget,
                "hicache_size",
                format!("{} GB", budget as f64 / 1e9),
            )
        }
        HostBudget::Ratio(r) => {
            let usable = f64::from(group.anchor().pages - cfg.device_reserve);
            let pages = (usable * r).floor() as u128 + u128::from(cfg.host_reserve);
            let target = (group.device_bytes() as f64 * r).round() as u64;
            (pages, target, "hicache_ratio", format!("{r}"))
        }
    };
    let need = u128::from(cfg.host_reserve) + 1;
    if pages < need {
        let min_bytes = need * u128::from(group_page);
        return Err(Error::config(
            field,
            given,
            format!(
                "a host budget of at least {min_bytes} bytes ({} GB): one page of every pool \
                 of the group ({group_page} bytes) plus {} reserve page(s)",
                min_bytes as f64 / 1e9,
                cfg.host_reserve
            ),
        ));
    }
    let pages = u32::try_from(pages).map_err(|_| {
        Error::config(
            field,
            &given,
            format!("a budget of at most {} host pages", u32::MAX),
        )
    })?;
    Ok((pages, target))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RawStackConfig;
    use crate::layout::Dtype;

    const GIB: u64 = 1 << 30;

    fn kv(pages: u32) -> PoolSpec {
        // 8 heads x 128 x 2 planes x bf16 = 4 KiB per token per layer; 64-token pages.
        PoolSpec::new(Component::Kv, 1, 2, 8, 128, Dtype::Bf16, 64, pages).unwrap()
    }

    fn indexer(pages: u32) -> PoolSpec {
        // One 128-dim bf16 key per token: 256 B, a sixteenth of the KV.
        PoolSpec::new(Component::Indexer, 1, 1, 1, 128, Dtype::Bf16, 64, pages).unwrap()
    }

    /// The source's budget example has Indexer-K at a quarter of the KV bytes: 4 heads here.
    fn wide_indexer(pages: u32) -> PoolSpec {
        PoolSpec::new(Component::Indexer, 1, 1, 4, 128, Dtype::Bf16, 64, pages).unwrap()
    }

    #[test]
    fn source_budget_example_splits_24_and_6() {
        // Device: 8 GiB of KV and 2 GiB of Indexer-K (32768 pages of 256 KiB and 64 KiB);
        // host budget: 30 GiB, given in bytes so the proportions come out exactly.
        let group = PoolGroup::new(&[kv(32768), wide_indexer(32768)], None).unwrap();
        assert_eq!(group.members()[0].spec.total_bytes(), 8 * GIB);
        assert_eq!(group.members()[1].spec.total_bytes(), 2 * GIB);
        let mut cfg = RawStackConfig::default().check().unwrap();
        cfg.host_budget = HostBudget::Bytes(30 * GIB);
        let plan = plan_stack(&group, &cfg).unwrap();
        let host: Vec<_> = plan.tier(Tier::Host).collect();
        assert_eq!(host[0].bytes, 24 * GIB);
        assert_eq!(host[1].bytes, 6 * GIB);
        assert_eq!(host[0].pages, host[1].pages);
        assert_eq!(host[0].tokens, host[1].tokens);
        assert_eq!(plan.actual_bytes, plan.target_bytes);
    }

    #[test]
    fn decimal_budget_rounds_down_to_whole_pages() {
        let group = PoolGroup::new(&[kv(32768), wide_indexer(32768)], None).unwrap();
        let cfg = RawStackConfig {
            hicache_size: Some(30.0),
            ..Default::default()
        }
        .check()
        .unwrap();
        let plan = plan_stack(&group, &cfg).unwrap();
        // 30e9 B over 320 KiB per page index: 91552 whole pages, 240640 B short of target.
        assert_eq!(plan.tier_pages(Tier::Host), 91_552);
        assert_eq!(plan.target_bytes, 30_000_000_000);
        assert_eq!(plan.actual_bytes, 91_552 * 320 * 1024);
        assert_eq!(plan.target_bytes - plan.actual_bytes, 240_640);
    }

    #[test]
    fn ratio_mirrors_usable_device_pages() {
        let group = PoolGroup::new(&[kv(101), indexer(101)], None).unwrap();
        let cfg = RawStackConfig {
            hicache_ratio: Some(2.0),
            ..Default::default()
        }
        .check()
        .unwrap();
        let plan = plan_stack(&group, &cfg).unwrap();
        // device: 101 pages, 1 reserved -> 6400 tokens; host: 200 pages -> 12800 tokens.
        assert_eq!(plan.tier_tokens(Tier::Device), 6400);
        assert_eq!(plan.tier_pages(Tier::Host), 200);
        assert_eq!(plan.tier_tokens(Tier::Host), 12800);
    }

    #[test]
    fn budget_too_small_for_one_page_is_refused() {
        let group = PoolGroup::new(&[kv(16), indexer(16)], None).unwrap();
        let cfg = RawStackConfig {
            hicache_size: Some(0.0001),
            ..Default::default()
        }
        .check()
        .unwrap();
        let err = plan_stack(&group, &cfg).unwrap_err();
        assert!(matches!(err, Error::Config { ref field, .. } if field == "hicache_size"));
    }

    #[test]
    fn group_checks() {
        let ik = indexer(4);
        assert!(PoolGroup::new(&[ik], None).is_err());
        assert!(PoolGroup::new(&[], None).is_err());
        let other_page =
            PoolSpec::new(Component::Indexer, 1, 1, 1, 128, Dtype::Bf16, 16, 4).unwrap();
        let e = PoolGroup::new(&[kv(4), other_page], None).unwrap_err();
        assert!(matches!(e, Error::Config { ref field, .. } if field == "pools[1].page_size"));
        let e = PoolGroup::new(&[kv(4), indexer(5)], None).unwrap_err();
        assert!(matches!(e, Error::Config { ref field, .. } if field == "pools[1].pages"));
        assert!(PoolGroup::new(&[kv(4), ik, ik], None).is_err());
        let swa = PoolSpec::new(Component::Swa, 1, 2, 8, 128, Dtype::Bf16, 64, 4).unwrap();
        assert!(PoolGroup::new(&[kv(4), swa], None).is_err());
        assert!(PoolGroup::new(&[kv(4)], Some(128)).is_err());
        let g = PoolGroup::new(&[kv(4), swa], Some(128)).unwrap();
        assert_eq!(g.members()[1].hit, HitPolicy::Window(128));
    }
}
