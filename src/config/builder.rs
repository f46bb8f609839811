//! Limits built in code: [`LimitsBuilder`], and the rule for limit names.

use std::sync::Arc;

use super::{ConfigError, ConfigErrorKind, Limits, NameEntry, RegionFloor};
use crate::key::{BucketKey, IdKind, LimitName};
use crate::quota::Quota;

/// Builds [`Limits`]; errors are reported by [`LimitsBuilder::build`], the first one found.
#[derive(Debug, Default)]
pub struct LimitsBuilder {
    pub(super) limits: Limits,
    error: Option<ConfigError>,
}

/// Limit names: 1 to 64 ASCII letters, digits, `_`, `-`, `.`.
pub(crate) fn check_name(name: &str) -> Result<(), ConfigErrorKind> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ConfigErrorKind::InvalidName(
            name.chars().take(80).collect(),
        ))
    }
}

impl LimitsBuilder {
    fn fail(&mut self, e: ConfigError) {
        self.error.get_or_insert(e);
    }

    /// Defines `name` with ids of any kind and a default limit (a [`Limit`](crate::Limit) or a
    /// [`TieredLimit`](crate::algo::tiers::TieredLimit)).
    pub fn limit(self, name: &str, limit: impl Into<Quota>) -> Self {
        self.define(name, IdKind::Any, 1, Some(limit.into()))
    }

    /// Defines `name` with ids of `kind` and a default limit.
    pub fn limit_for(self, name: &str, kind: IdKind, limit: impl Into<Quota>) -> Self {
        self.define(name, kind, 1, Some(limit.into()))
    }

    /// Defines `name` in full: id kind, the cost of a request when a transaction sets none, and
    /// the default limit (`None`: the limit applies only to overridden ids).
    pub fn define(mut self, name: &str, kind: IdKind, cost: u64, default: Option<Quota>) -> Self {
        if let Err(e) = self.try_define(name, kind, cost, default) {
            self.fail(e.for_limit(name));
        }
        self
    }

    pub(crate) fn try_define(
        &mut self,
        name: &str,
        kind: IdKind,
        cost: u64,
        default: Option<Quota>,
    ) -> Result<(), ConfigError> {
        check_name(name).map_err(ConfigError::new)?;
        if self.limits.config.by_text.contains_key(name) {
            return Err(ConfigError::new(ConfigErrorKind::DuplicateName(
                name.to_owned(),
            )));
        }
        if let Some(l) = &default
            && cost > l.max_cost()
        {
            return Err(ConfigError::new(ConfigErrorKind::CostAboveBurst {
                cost,
                burst: l.max_cost(),
            }));
        }
        let name = LimitName::intern(name);
        let index = self.limits.config.names.len();
        let config = Arc::make_mut(&mut self.limits.config);
        config.by_name.insert(name, index);
        if let (Some(slot), Ok(at)) = (
            crate::key::dense_slot(&mut config.by_number, name.number()),
            u32::try_from(index + 1),
        ) {
            *slot = at;
        }
        config.by_text.insert(name.as_str(), index);
        config.names.push(NameEntry {
            name,
            kind,
            cost,
            default,
            fail_closed: false,
            across_regions: None,
            penalty: None,
        });
        Ok(())
    }

    /// Makes a store failure refuse every request with a rule of `name` (`503`, gRPC
    /// `UNAVAILABLE`), whatever the layer's failure policy: a quota that must hold through an
    /// outage (a monthly plan) neither opens nor falls back to memory. YAML:
    /// `on_store_failure: fail_closed` on the limit.
    ///
    /// ```
    /// use tower_ratelimits::{CalendarQuota, Limits, Period};
    /// let limits = Limits::builder()
    ///     .limit("ApiCallsPerMonth", CalendarQuota::new(100_000, Period::Month).unwrap())
    ///     .fail_closed("ApiCallsPerMonth")
    ///     .build()
    ///     .unwrap();
    /// assert!(limits.fails_closed(limits.name("ApiCallsPerMonth").unwrap()));
    /// ```
    pub fn fail_closed(mut self, name: &str) -> Self {
        match self.limits.config.by_text.get(name).copied() {
            Some(i) => Arc::make_mut(&mut self.limits.config).names[i].fail_closed = true,
            None => self.fail(ConfigError::new(ConfigErrorKind::UnknownName(
                name.chars().take(80).collect(),
            ))),
        }
        self
    }

    /// Makes `name` one limit across every region, with `floor` reserved in each
    /// (`docs/regions.md`; YAML: `across_regions: true`, `region_floor: 10%`). Its default and
    /// every override must be a GCRA limit without prefetched tokens. On a backend without a
    /// regional mode the limit decides as a limit per region, and the limiter warns once.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimits::{Limit, Limits, RegionFloor};
    /// let limits = Limits::builder()
    ///     .limit("PerKey", Limit::new(1_000, 1_000, Duration::from_secs(1)).unwrap())
    ///     .across_regions("PerKey", RegionFloor::default())
    ///     .build()
    ///     .unwrap();
    /// let floor = limits.across_regions(limits.name("PerKey").unwrap()).unwrap();
    /// assert_eq!(floor.of(1_000), 100);
    /// ```
    pub fn across_regions(mut self, name: &str, floor: RegionFloor) -> Self {
        if let Err(e) = self.try_across_regions(name, floor) {
            self.fail(e.for_limit(name));
        }
        self
    }

    pub(crate) fn try_across_regions(
        &mut self,
        name: &str,
        floor: RegionFloor,
    ) -> Result<(), ConfigError> {
        let i = self
            .limits
            .config
            .by_text
            .get(name)
            .copied()
            .ok_or_else(|| {
                ConfigError::new(ConfigErrorKind::UnknownName(
                    name.chars().take(80).collect(),
                ))
            })?;
        let entry = &self.limits.config.names[i];
        let overrides = self
            .limits
            .config
            .overrides
            .iter()
            .filter(|(key, _)| key.name() == entry.name)
            .map(|(_, quota)| quota);
        for quota in entry.default.iter().chain(overrides) {
            super::regions::check_marked(quota).map_err(ConfigError::new)?;
        }
        Arc::make_mut(&mut self.limits.config).names[i].across_regions = Some(floor);
        Ok(())
    }

    /// Puts a penalty ladder on `name` (`docs/penalties.md`): a key whose requests the limit
    /// counts `after` units of within `within` is banned, each ban longer than the one before.
    /// Decided with the limit in the request's one batch. A limit that counts units takes one
    /// (GCRA, burst tiers, a calendar quota: not one that holds leases or keeps one state for
    /// all its ids), and not one marked `across_regions`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimits::{Ladder, Limit, Limits};
    /// let minute = 60_000_000;
    /// let ladder = Ladder::new(10, 10 * minute, minute, 5, 1_440 * minute).unwrap();
    /// let limits = Limits::builder()
    ///     .limit("LoginPerAccount", Limit::new(10, 10, Duration::from_secs(60)).unwrap())
    ///     .penalty("LoginPerAccount", ladder)
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(limits.penalty(limits.name("LoginPerAccount").unwrap()), Some(&ladder));
    /// ```
    pub fn penalty(mut self, name: &str, ladder: crate::algo::penalty::Ladder) -> Self {
        if let Err(e) = self.try_penalty(name, ladder) {
            self.fail(e.for_limit(name));
        }
        self
    }

    /// [`penalty`](Self::penalty), its error at once: an unknown name, or a limit that cannot
    /// carry one (its overrides are checked when the limits are built).
    pub(crate) fn try_penalty(
        &mut self,
        name: &str,
        ladder: crate::algo::penalty::Ladder,
    ) -> Result<(), ConfigError> {
        let Some(i) = self.limits.config.by_text.get(name).copied() else {
            return Err(ConfigError::new(ConfigErrorKind::UnknownName(
                name.chars().take(80).collect(),
            )));
        };
        let entry = &self.limits.config.names[i];
        if entry.across_regions.is_some() {
            return Err(ConfigError::new(super::PENALTY_ACROSS_REGIONS));
        }
        if let Some(quota) = &entry.default {
            super::check_penalized(quota).map_err(ConfigError::new)?;
        }
        let state = LimitName::intern(&format!("{name}:pen"));
        let config = Arc::make_mut(&mut self.limits.config);
        config.names[i].penalty = Some(super::PenaltyEntry { ladder, state });
        Ok(())
    }

    /// Overrides `name`'s limit for one id, given as text and checked against the name's kind.
    pub fn override_for(mut self, name: &str, id: &str, limit: impl Into<Quota>) -> Self {
        if let Err(e) = self.try_override(name, id, Some(limit.into())) {
            self.fail(e.for_limit(name));
        }
        self
    }

    /// Makes `name` unlimited for one id (YAML: `unlimited: true` in an override entry): its
    /// requests are allowed without touching the store, like a limit with no default.
    pub fn unlimited_for(mut self, name: &str, id: &str) -> Self {
        if let Err(e) = self.try_override(name, id, None) {
            self.fail(e.for_limit(name));
        }
        self
    }

    /// An override: a limit, or `None` for unlimited.
    pub(crate) fn try_override(
        &mut self,
        name: &str,
        id: &str,
        limit: Option<Quota>,
    ) -> Result<(), ConfigError> {
        let index = *self
            .limits
            .config
            .by_text
            .get(name)
            .ok_or_else(|| ConfigError::new(ConfigErrorKind::UnknownName(name.to_owned())))?;
        let entry = &self.limits.config.names[index];
        if let Some(limit) = &limit {
            entry.admits(limit).map_err(ConfigError::new)?;
        }
        let parsed = entry.kind.parse(id).map_err(ConfigError::new)?;
        let key = BucketKey::new(entry.name, parsed);
        if self.limits.config.overrides.contains_key(&key)
            || self.limits.config.unlimited.contains(&key)
        {
            return Err(ConfigError::new(ConfigErrorKind::DuplicateId(
                id.to_owned(),
            )));
        }
        match limit {
            Some(limit) => {
                Arc::make_mut(&mut self.limits.config)
                    .overrides
                    .insert(key, limit);
            }
            None => {
                Arc::make_mut(&mut self.limits.config).unlimited.insert(key);
            }
        }
        Ok(())
    }

    /// The snapshot, or the first error met.
    pub fn build(self) -> Result<Limits, ConfigError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        self.limits.check_penalties()?;
        Ok(self.limits)
    }
}
