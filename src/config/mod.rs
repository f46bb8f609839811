//! Limits: names, their id kinds, defaults and per-id overrides.
//!
//! [`Limits`] is an immutable snapshot. Names are interned ([`LimitName`]) when the snapshot is
//! built; resolving the limit of a bucket on the request path is one hash lookup in the
//! overrides (skipped when there are none) and one in the names, both on precomputed hashes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::key::{BucketKey, IdKind, LimitName};
use crate::quota::Quota;

mod builder;
mod error;
mod regions;
mod stored;
#[cfg(feature = "yaml")]
mod yaml;

pub use builder::LimitsBuilder;
#[cfg(feature = "yaml")]
pub(crate) use builder::check_name;
pub use error::{ConfigError, ConfigErrorKind, Location};
pub use regions::RegionFloor;
pub use stored::OverrideRefusal;
pub(crate) use stored::{StoredSet, check_override};
#[cfg(feature = "stream")]
mod price;
#[cfg(feature = "stream")]
pub use price::{ModelPrice, PriceOf, PriceTable, UnitPrice};
#[cfg(feature = "yaml")]
pub use yaml::RuleSet;
#[cfg(all(feature = "yaml", feature = "stream"))]
pub(crate) use yaml::{RuleAtLimit, RuleModel, RulePer, RulePrice, RulePriceOf};
#[cfg(feature = "yaml")]
pub(crate) use yaml::{RuleCost, RuleKey, RuleMissing, RuleOutcome};

/// What the configuration says of one name.
#[derive(Debug, Clone)]
pub(crate) struct NameEntry {
    name: LimitName,
    pub(crate) kind: IdKind,
    /// The cost of a request when its transaction sets none.
    pub(crate) cost: u64,
    pub(crate) default: Option<Quota>,
    /// A store failure refuses a request with a rule of this name, whatever the layer's
    /// failure policy (`on_store_failure: fail_closed`).
    pub(crate) fail_closed: bool,
    /// Marked `across_regions`: one limit for every region, with this floor in each
    /// (`docs/regions.md`); `None`: a limit per region.
    pub(crate) across_regions: Option<RegionFloor>,
    /// A penalty ladder on what the limit counts (`docs/penalties.md`); `None`: none.
    pub(crate) penalty: Option<PenaltyEntry>,
}

/// A penalty on a limit marked `across_regions`: how a ban crosses regions is not specified.
pub(super) const PENALTY_ACROSS_REGIONS: ConfigErrorKind =
    ConfigErrorKind::Penalty("cannot be on a limit marked across_regions yet");

/// Whether `quota` may be the limit of a name with a penalty: one that counts units (not one
/// that holds leases or keeps one state for all its ids).
pub(super) fn check_penalized(quota: &Quota) -> Result<(), ConfigErrorKind> {
    if quota.holds_leases() || quota.state_per_limit() {
        return Err(ConfigErrorKind::Penalty(
            "needs a limit that counts units (GCRA, burst tiers or a calendar quota)",
        ));
    }
    Ok(())
}

impl Limits {
    /// Whether every limit with a penalty may carry one: not marked `across_regions`, and its
    /// default and overrides count units ([`check_penalized`]).
    fn check_penalties(&self) -> Result<(), ConfigError> {
        for entry in self.config.names.iter().filter(|e| e.penalty.is_some()) {
            let name = entry.name.as_str();
            if entry.across_regions.is_some() {
                return Err(ConfigError::new(PENALTY_ACROSS_REGIONS).for_limit(name));
            }
            let overrides = self.config.overrides.iter();
            let overrides = overrides
                .filter(|(k, _)| k.name() == entry.name)
                .map(|(_, q)| q);
            for quota in entry.default.iter().chain(overrides) {
                check_penalized(quota).map_err(|e| ConfigError::new(e).for_limit(name))?;
            }
        }
        Ok(())
    }
}

/// A limit's penalty ladder, and the name its penalty states are kept under: the limit's name
/// with `:pen` (a text no limit name can be, so a key's penalty state is never one of a
/// limit's buckets; in-process, as every name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PenaltyEntry {
    pub(crate) ladder: crate::algo::penalty::Ladder,
    pub(crate) state: LimitName,
}

impl NameEntry {
    /// Whether `quota` may replace this name's limit for an id (a file or stored override):
    /// a limit that fits a request of the name's cost, of the default's shape, and one that
    /// can be one limit across regions when the name is marked.
    pub(crate) fn admits(&self, quota: &Quota) -> Result<(), ConfigErrorKind> {
        if self.cost > quota.max_cost() {
            return Err(ConfigErrorKind::CostAboveBurst {
                cost: self.cost,
                burst: quota.max_cost(),
            });
        }
        if self.across_regions.is_some() {
            regions::check_marked(quota)?;
        }
        if self.penalty.is_some() {
            check_penalized(quota)?;
        }
        if let Some(d) = &self.default {
            d.keeps_on_override(quota)
                .map_err(ConfigErrorKind::OverrideMustKeep)?;
        }
        Ok(())
    }
}

/// A snapshot of every limit: names (interned), id kinds, default costs, defaults and overrides.
///
/// Build one with [`Limits::builder`] or load YAML with [`Limits::from_yaml_str`] /
/// [`Limits::from_yaml_files`].
///
/// ```
/// use tower_ratelimits::{BucketKey, Id, IdKind, Limit, Limits};
/// use std::time::Duration;
///
/// let limits = Limits::builder()
///     .limit_for("ApiPerIp", IdKind::Ip, Limit::new(20, 20, Duration::from_secs(1)).unwrap())
///     .override_for("ApiPerIp", "10.0.0.2", Limit::new(20, 40, Duration::from_secs(1)).unwrap())
///     .build()
///     .unwrap();
/// let name = limits.name("ApiPerIp").unwrap();
/// let key = BucketKey::new(name, Id::new("10.0.0.2").unwrap());
/// assert_eq!(limits.resolve(&key).unwrap().as_gcra().unwrap().count(), 40);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Limits {
    /// What the configuration says, shared by the snapshots that differ only in their stored
    /// overrides (a stored change copies two pointers, not the configuration).
    config: Arc<Config>,
    /// Overrides kept in the store (`Limiter::set_override`), applied to these limits; `None`
    /// when there are none (the request path checks one pointer).
    stored: Option<Arc<StoredSet>>,
}

/// The configuration's part of a [`Limits`]: names, defaults, file overrides.
#[derive(Debug, Clone, Default)]
struct Config {
    /// In definition order (for listing only: nothing is keyed by a position).
    names: Vec<NameEntry>,
    /// By the name's process number ([`LimitName::number`]), for the first
    /// [`DENSE_NAMES`](crate::key::DENSE_NAMES) names interned: the entry's index plus one, 0
    /// for a name this configuration lacks. A load where a hash lookup cost about 20
    /// instructions, twice per rule per request.
    by_number: Vec<u32>,
    by_name: HashMap<LimitName, usize, nohash_hasher::BuildNoHashHasher<LimitName>>,
    by_text: HashMap<&'static str, usize, foldhash::fast::RandomState>,
    overrides: HashMap<BucketKey, Quota, foldhash::fast::RandomState>,
    /// Ids an override makes unlimited (`unlimited: true`): no limit, whatever the default.
    unlimited: HashSet<BucketKey, foldhash::fast::RandomState>,
}

impl Limits {
    /// A builder.
    pub fn builder() -> LimitsBuilder {
        LimitsBuilder::default()
    }

    /// A name's entry: one lookup, for everything the request path needs of the name.
    #[inline]
    pub(crate) fn entry(&self, name: LimitName) -> Option<&NameEntry> {
        let n = name.number();
        let i = if n < crate::key::DENSE_NAMES {
            (*self.config.by_number.get(n)? as usize).checked_sub(1)?
        } else {
            *self.config.by_name.get(&name)?
        };
        self.config.names.get(i)
    }

    /// The name `text`, when this configuration defines it.
    pub fn name(&self, text: &str) -> Option<LimitName> {
        self.config
            .by_text
            .get(text)
            .map(|&i| self.config.names[i].name)
    }

    /// Whether this configuration defines `name`.
    pub fn contains(&self, name: LimitName) -> bool {
        self.config.by_name.contains_key(&name)
    }

    /// The id kind a name is keyed by.
    pub fn id_kind(&self, name: LimitName) -> Option<IdKind> {
        self.entry(name).map(|e| e.kind)
    }

    /// The cost of one request against a name when the transaction sets none (1 by default).
    pub fn default_cost(&self, name: LimitName) -> u64 {
        self.entry(name).map_or(1, |e| e.cost)
    }

    /// Whether a store failure refuses the requests of `name` whatever the layer's failure
    /// policy ([`LimitsBuilder::fail_closed`]).
    pub fn fails_closed(&self, name: LimitName) -> bool {
        self.entry(name).is_some_and(|e| e.fail_closed)
    }

    /// The floor of `name` in each region when it is one limit across regions
    /// ([`LimitsBuilder::across_regions`]); `None`: a limit per region.
    pub fn across_regions(&self, name: LimitName) -> Option<RegionFloor> {
        self.entry(name).and_then(|e| e.across_regions)
    }

    /// The penalty ladder of `name` ([`LimitsBuilder::penalty`]), if it has one.
    pub fn penalty(&self, name: LimitName) -> Option<&crate::algo::penalty::Ladder> {
        self.entry(name)
            .and_then(|e| e.penalty.as_ref())
            .map(|p| &p.ladder)
    }

    /// The default limit of a name (`None`: disabled unless overridden).
    pub fn default_limit(&self, name: LimitName) -> Option<&Quota> {
        self.entry(name).and_then(|e| e.default.as_ref())
    }

    /// The defined name `text` most likely meant, for an error: one equal but for ASCII case,
    /// else the nearest by edit distance when at most a third of its length away (at least
    /// one).
    pub(crate) fn nearest_name(&self, text: &str) -> Option<&'static str> {
        let names = || self.names().map(|n| n.as_str());
        if let Some(same) = names().find(|n| n.eq_ignore_ascii_case(text)) {
            return Some(same);
        }
        let most = (text.chars().count() / 3).max(1);
        names()
            .map(|n| (error::edit_distance(text, n, most), n))
            .filter(|(d, _)| *d <= most)
            .min_by_key(|(d, _)| *d)
            .map(|(_, n)| n)
    }

    /// Every name, in the order they were defined.
    pub fn names(&self) -> impl Iterator<Item = LimitName> + '_ {
        self.config.names.iter().map(|e| e.name)
    }

    /// The names whose default or a file override prefetches tokens
    /// ([`Limit::with_prefetch`](crate::Limit::with_prefetch)), in definition order.
    pub(crate) fn prefetching_names(&self) -> Vec<LimitName> {
        let prefetches = Quota::prefetches;
        // One pass over the overrides (a file may hold millions), then one over the names.
        let mut by_override: Vec<LimitName> = Vec::new();
        for (key, quota) in &self.config.overrides {
            if prefetches(quota) && !by_override.contains(&key.name()) {
                by_override.push(key.name());
            }
        }
        self.config
            .names
            .iter()
            .filter(|e| e.default.as_ref().is_some_and(prefetches) || by_override.contains(&e.name))
            .map(|e| e.name)
            .collect()
    }

    /// The names marked `across_regions`, in definition order.
    pub(crate) fn across_regions_names(&self) -> Vec<LimitName> {
        self.config
            .names
            .iter()
            .filter(|e| e.across_regions.is_some())
            .map(|e| e.name)
            .collect()
    }

    /// The number of overrides (unlimited ids included), not counting stored ones.
    pub fn override_count(&self) -> usize {
        self.config.overrides.len() + self.config.unlimited.len()
    }

    /// The number of stored overrides ([`Limiter::set_override`](crate::Limiter::set_override))
    /// that apply to these limits.
    pub fn stored_override_count(&self) -> usize {
        self.stored.as_ref().map_or(0, |s| s.len())
    }

    /// These limits with `stored` applied in place of the stored overrides they had (the
    /// configuration is shared, not copied).
    pub(crate) fn with_stored(&self, stored: Option<Arc<StoredSet>>) -> Self {
        Self {
            config: self.config.clone(),
            stored,
        }
    }

    /// The stored overrides applied to these limits.
    pub(crate) fn stored(&self) -> Option<&Arc<StoredSet>> {
        self.stored.as_ref()
    }

    /// The limit that applies to a bucket: its override, else the name's default, else `None`
    /// (disabled, or a name this configuration does not define).
    pub fn resolve(&self, key: &BucketKey) -> Option<&Quota> {
        self.resolve_in(self.entry(key.name())?, key).quota
    }

    /// The limit that applies to a bucket and where it comes from: the one home of the
    /// precedence (a stored override, then a file override, then the name's default).
    #[inline(always)]
    pub(crate) fn resolve_in<'a>(
        &'a self,
        entry: &'a NameEntry,
        key: &BucketKey,
    ) -> Resolution<'a> {
        if let Some(stored) = &self.stored
            && let Some(r) = Self::resolve_stored(stored, entry, key)
        {
            return r;
        }
        if !self.config.overrides.is_empty()
            && let Some(l) = self.config.overrides.get(key)
        {
            return Resolution::of(Some(l), LimitSource::Override);
        }
        if !self.config.unlimited.is_empty() && self.config.unlimited.contains(key) {
            return Resolution::of(None, LimitSource::Override);
        }
        Resolution::of(entry.default.as_ref(), LimitSource::Default)
    }
}

impl Limits {
    /// A stored override of `key`, out of line: the request path of limits without stored
    /// overrides stays as small as before they existed (one pointer checked).
    #[inline(never)]
    fn resolve_stored<'a>(
        stored: &'a StoredSet,
        entry: &'a NameEntry,
        key: &BucketKey,
    ) -> Option<Resolution<'a>> {
        stored
            .resolve(key, entry.default.as_ref())
            .map(|r| Resolution {
                quota: r.quota,
                source: LimitSource::Store,
                block_s: r.block_s,
            })
    }
}

/// The limit that applies to a bucket ([`Limits::resolve_in`]).
pub(crate) struct Resolution<'a> {
    /// `None`: no limit (disabled for this id, or unlimited).
    pub(crate) quota: Option<&'a Quota>,
    pub(crate) source: LimitSource,
    /// A stored block: seconds until it ends, rounded up (0: not blocked; `Retry-After` is in
    /// whole seconds too). A blocked transaction is denied without asking the backend.
    pub(crate) block_s: u32,
}

impl<'a> Resolution<'a> {
    #[inline]
    fn of(quota: Option<&'a Quota>, source: LimitSource) -> Self {
        Self {
            quota,
            source,
            block_s: 0,
        }
    }
}

impl Limits {
    /// What replacing `self` with `new` changes, by name.
    pub(crate) fn change_to(&self, new: &Limits) -> LimitsChange {
        let mut change = LimitsChange::default();
        fn overrides_of(limits: &Limits, name: LimitName) -> Vec<(String, Option<&Quota>)> {
            let mut o: Vec<(String, Option<&Quota>)> = limits
                .config
                .overrides
                .iter()
                .filter(|(k, _)| k.name() == name)
                .map(|(k, q)| (k.id().to_string(), Some(q)))
                .chain(
                    limits
                        .config
                        .unlimited
                        .iter()
                        .filter(|k| k.name() == name)
                        .map(|k| (k.id().to_string(), None)),
                )
                .collect();
            o.sort_by(|a, b| a.0.cmp(&b.0));
            o
        }
        for e in &new.config.names {
            match self.entry(e.name) {
                None => change.added.push(e.name.to_string()),
                Some(old) => {
                    if old.kind != e.kind
                        || old.cost != e.cost
                        || old.default != e.default
                        || overrides_of(self, e.name) != overrides_of(new, e.name)
                    {
                        change.changed.push(e.name.to_string());
                    }
                }
            }
        }
        for e in &self.config.names {
            if !new.contains(e.name) {
                change.removed.push(e.name.to_string());
            }
        }
        change
    }

    /// The same limits at `percent` of their size (1 to 100), for an in-memory fallback
    /// limiter per instance (each shape scales as `Quota::scaled` says; nothing below the
    /// configured cost of a request). Errors name the limit that cannot be scaled.
    pub(crate) fn scaled(&self, percent: u8) -> Result<Limits, ConfigError> {
        let quota = |q: &Quota, cost: u64| q.scaled(percent, cost).map_err(ConfigErrorKind::from);
        let mut scaled = self.clone();
        for e in &mut Arc::make_mut(&mut scaled.config).names {
            if let Some(q) = &e.default {
                e.default = Some(
                    quota(q, e.cost).map_err(|k| ConfigError::new(k).for_limit(e.name.as_str()))?,
                );
            }
        }
        for (key, q) in &mut Arc::make_mut(&mut scaled.config).overrides {
            let cost = self.entry(key.name()).map_or(1, |e| e.cost);
            *q = quota(q, cost).map_err(|k| ConfigError::new(k).for_limit(key.name().as_str()))?;
        }
        // Stored overrides' limits scale too (a block or unlimited stays what it is).
        if let Some(stored) = &self.stored {
            let mut stored = (**stored).clone();
            stored.try_map_quotas(|key, q| {
                let cost = self.entry(key.name()).map_or(1, |e| e.cost);
                quota(q, cost).map_err(|k| ConfigError::new(k).for_limit(key.name().as_str()))
            })?;
            scaled.stored = Some(Arc::new(stored));
        }
        Ok(scaled)
    }
}

/// What a reload changed, by limit name (in the new configuration's order; removed names in
/// the old one's). Its `Display` is one line for a log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LimitsChange {
    /// Names the new configuration adds.
    pub added: Vec<String>,
    /// Names it removes.
    pub removed: Vec<String>,
    /// Names whose id kind, cost, default or overrides changed.
    pub changed: Vec<String>,
}

impl LimitsChange {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

impl std::fmt::Display for LimitsChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            return f.write_str("no limit changed");
        }
        let mut first = true;
        for (what, names) in [
            ("added", &self.added),
            ("removed", &self.removed),
            ("changed", &self.changed),
        ] {
            if names.is_empty() {
                continue;
            }
            if !first {
                f.write_str("; ")?;
            }
            first = false;
            write!(f, "{what}: {}", names.join(", "))?;
        }
        Ok(())
    }
}

/// Where the limit in force for a bucket comes from ([`Limiter::inspect`](crate::Limiter::inspect)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LimitSource {
    /// The name's default limit (or none: the name is disabled for ids without an override).
    Default,
    /// An override for this id in the [`Limits`]: its overrides file, or
    /// [`LimitsBuilder::override_for`] in code. An `unlimited` override is one too.
    Override,
    /// An override kept in the store ([`Limiter::set_override`](crate::Limiter::set_override)),
    /// which wins over the other two.
    Store,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::gcra::Limit;
    use crate::algo::tiers::{Tier, TieredLimit};

    /// Without the feature `acme`, a file naming one of its kinds is refused at the kind's
    /// line, saying which feature brings it (not "unknown kind"). Run by `.ci/run`'s unit tests
    /// with the default features.
    #[cfg(all(feature = "yaml", not(feature = "acme")))]
    #[test]
    fn an_acme_kind_without_the_feature_names_it_at_its_line() {
        let e = Limits::from_yaml_str(
            "Certs:\n  kind: account_domain\n  burst: 1\n  count: 1\n  period: 1s\n",
            None,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "<defaults>:2: limit Certs: invalid id: id kind \"account_domain\" needs the `acme` \
             feature of tower-ratelimits"
        );
    }

    #[test]
    fn scaled_limits_keep_names_costs_and_shares() {
        let s = |secs| std::time::Duration::from_secs(secs);
        let limits = Limits::builder()
            .limit("Gcra", Limit::new(20, 20, s(1)).unwrap())
            .define(
                "Costly",
                IdKind::Any,
                5,
                Some(Limit::new(6, 6, s(1)).unwrap().into()),
            )
            .limit(
                "Tiered",
                TieredLimit::new([
                    Tier::new(5, s(1), s(1), s(0)),
                    Tier::new(50, s(5), s(5), s(15)),
                ])
                .unwrap(),
            )
            .override_for("Gcra", "vip", Limit::new(100, 100, s(1)).unwrap())
            .build()
            .unwrap();
        let half = limits.scaled(50).unwrap();
        let gcra = |l: &Limits, name: &str| {
            *l.default_limit(l.name(name).unwrap())
                .unwrap()
                .as_gcra()
                .unwrap()
        };
        // GCRA: half the burst, the same count over twice the period: half the rate, exactly.
        let g = gcra(&half, "Gcra");
        assert_eq!((g.burst(), g.count(), g.period_us()), (10, 20, 2_000_000));
        assert_eq!(g.emission_interval_us(), 100_000);
        // Never below a request's configured cost.
        assert_eq!(gcra(&half, "Costly").burst(), 5);
        // Tiers scale their limits.
        let t = half
            .default_limit(half.name("Tiered").unwrap())
            .unwrap()
            .as_tiered()
            .unwrap()
            .clone();
        assert_eq!(
            t.tiers().iter().map(Tier::limit).collect::<Vec<_>>(),
            [2, 25]
        );
        // Overrides scale too.
        let vip = BucketKey::new(
            half.name("Gcra").unwrap(),
            crate::key::Id::new("vip").unwrap(),
        );
        assert_eq!(half.resolve(&vip).unwrap().as_gcra().unwrap().burst(), 50);
        // So do stored overrides (the fallback follows them).
        let vip_store = crate::overrides::StoredOverride {
            limit: "Gcra".into(),
            id: "store-vip".into(),
            kind: crate::overrides::OverrideKind::Quota(Limit::new(80, 80, s(1)).unwrap().into()),
            expires_at_ms: None,
        };
        let with_stored = limits.with_stored(StoredSet::build(
            &limits,
            &[vip_store],
            Arc::new(crate::time::SystemClock),
        ));
        let half = with_stored.scaled(50).unwrap();
        let key = BucketKey::new(
            half.name("Gcra").unwrap(),
            crate::key::Id::new("store-vip").unwrap(),
        );
        assert_eq!(half.resolve(&key).unwrap().as_gcra().unwrap().burst(), 40);
        assert_eq!(half.stored_override_count(), 1);
        // 100% is the same limits.
        assert_eq!(
            gcra(&limits.scaled(100).unwrap(), "Gcra"),
            gcra(&limits, "Gcra")
        );
    }
}
