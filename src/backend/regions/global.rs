//! The global store of regional mode (`docs/regions.md`): its two kinds of record, as text, and
//! the decisions an instance makes on them with the protocol's own functions
//! (`src/algo/regions.rs`). Records are read with the store's clock and written by a
//! compare-and-set (`global.lua`): the store itself decides nothing.
//!
//! - The **registry** (`<prefix>{regions}`, never expires): an epoch, until when the store is
//!   quiet (it found its records lost, or is new), and each registered region with when it
//!   registered. `1 <epoch> <quiet until>` then one line per region, `<name> <registered at>`.
//! - A **key's record** (`<prefix>{<limit>:<id>}:g`, beside the key's slot, expiring once every
//!   grant in it has lapsed): until when the key is quiet (its record was not ours), then one
//!   line per region that holds something: `<name> <answered> <granted rate> <granted burst>
//!   <held rate> <held burst> <issued at> <demand> <limit rate> <limit burst> <floor rate>
//!   <floor burst>`, the last four the limit and floor the region asked under. A region the
//!   instance does not know as registered is kept and counted (it may still use what it
//!   holds). Regions that disagree on the limit (a rolling deploy, an override not yet seen
//!   everywhere) are granted under the smaller limit and the larger floors.
//!
//! Times are the global store's microseconds. Every value is bounded: at most
//! [`MAX_REGIONS`] regions, names of at most 32 characters, numbers below 2^63; a value that is
//! not a record of ours is read as lost (the registry) or as a key quiet for one lease and the
//! margin (a key's record), and replaced.

use crate::algo::regions::{
    GlobalKey, Grant, Held, Registry, Request, Settings, Share, later_registration,
};

/// The most regions a registry or a key's record holds.
pub(crate) const MAX_REGIONS: usize = 64;

/// Whether `name` may name a region: 1 to 32 ASCII letters, digits, `-` or `_`.
pub(crate) fn is_region_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The registry, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct RegistryRecord {
    /// Set when the registry is made: a registry with another epoch is another store's.
    pub(crate) epoch: u64,
    /// Until when nothing above the floors is granted.
    pub(crate) quiet_until: u64,
    /// Each registered region and when it registered, sorted by name.
    pub(crate) regions: Vec<(String, u64)>,
}

impl RegistryRecord {
    // The text form is the Redis global store's (memory keeps the records as they are).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    /// The record `text` holds; `None` when it is not one of ours.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let mut head = lines.next()?.split(' ');
        if head.next()? != "1" {
            return None;
        }
        let epoch = head.next()?.parse().ok()?;
        let quiet_until = head.next()?.parse().ok()?;
        if head.next().is_some() {
            return None;
        }
        let mut regions = Vec::new();
        for line in lines {
            if regions.len() == MAX_REGIONS {
                return None;
            }
            let (name, at) = line.split_once(' ')?;
            if !is_region_name(name) {
                return None;
            }
            regions.push((name.to_owned(), at.parse().ok()?));
        }
        regions.sort();
        regions.dedup_by(|a, b| a.0 == b.0);
        Some(Self {
            epoch,
            quiet_until,
            regions,
        })
    }

    // The text form is the Redis global store's (memory keeps the records as they are).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    /// The record as stored.
    pub(crate) fn text(&self) -> String {
        let mut out = format!("1 {} {}", self.epoch, self.quiet_until);
        for (name, at) in &self.regions {
            out.push_str(&format!("\n{name} {at}"));
        }
        out
    }

    /// The registrations of `other` (a registry another instance of the region saw, as the
    /// region's store keeps it) merged into these: each region either saw, at the later time
    /// (`later_registration`). What an instance makes a lost registry again from.
    // An instance's view is kept by the Redis backend (memory regions have one instance each).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn merge_seen(&mut self, other: &RegistryRecord) {
        for (name, at) in &other.regions {
            if let Some((_, mine)) = self.regions.iter_mut().find(|(n, _)| n == name) {
                *mine = later_registration(Some(*mine), Some(*at)).unwrap_or(*at);
            } else if self.regions.len() < MAX_REGIONS {
                self.regions.push((name.clone(), *at));
            }
        }
        self.regions.sort();
    }

    /// When `region` registered, if it did.
    pub(crate) fn registered_at(&self, region: &str) -> Option<u64> {
        self.regions
            .iter()
            .find(|(name, _)| name == region)
            .map(|(_, at)| *at)
    }
}

/// Why a region cannot register.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RegisterError {
    /// Its floor with the registered regions' would sum above a marked limit.
    #[error(
        "region {region} cannot register: with the {registered} regions registered, floors of \
         {floor_bp} basis points each would sum above the limit"
    )]
    FloorsAbove {
        region: String,
        registered: usize,
        floor_bp: u16,
    },
    /// The registry already holds [`MAX_REGIONS`] regions.
    #[error("region {0} cannot register: the registry holds {MAX_REGIONS} regions")]
    Full(String),
}

/// The registry after `region` registers at `now` (global clock), from `stored` (`None`: no
/// registry, or not one of ours: the store is new or lost its records). A lost registry is
/// made again with a new `epoch`, quiet for one lease and the margin, holding every
/// registration the instance has `seen` (with their times: a confirmed region stays
/// confirmed). `floor_bp` is the largest floor of the marked limits, in basis points: the
/// floors of the registered regions must fit in every limit. `None`: nothing to write.
pub(crate) fn register(
    stored: Option<&RegistryRecord>,
    seen: &[(String, u64)],
    region: &str,
    now: u64,
    hold_us: u64,
    floor_bp: u16,
    epoch: u64,
) -> Result<Option<RegistryRecord>, RegisterError> {
    let (mut record, changed) = match stored {
        Some(r) => (r.clone(), false),
        None => (
            RegistryRecord {
                epoch,
                quiet_until: now.saturating_add(hold_us),
                regions: seen.iter().take(MAX_REGIONS).cloned().collect(),
            },
            true,
        ),
    };
    record.regions.sort();
    record.regions.dedup_by(|a, b| a.0 == b.0);
    if record.registered_at(region).is_some() {
        return Ok(changed.then_some(record));
    }
    if record.regions.len() >= MAX_REGIONS {
        return Err(RegisterError::Full(region.to_owned()));
    }
    // The rule is the protocol's (`Registry::register`), on floors in basis points of a limit
    // of 10,000: floors that fit there fit every limit, each rounded down.
    let n = record.regions.len();
    let mut registry = Registry::new(n + 1);
    for (i, (_, at)) in record.regions.iter().enumerate() {
        registry.registered_at[i] = Some(*at);
    }
    let whole = Share {
        rate: 10_000,
        burst: 10_000,
    };
    let floor = Share {
        rate: u64::from(floor_bp),
        burst: u64::from(floor_bp),
    };
    if !registry.register(n, now, whole, &vec![floor; n + 1]) {
        return Err(RegisterError::FloorsAbove {
            region: region.to_owned(),
            registered: n,
            floor_bp,
        });
    }
    record.regions.push((region.to_owned(), now));
    record.regions.sort();
    Ok(Some(record))
}

/// The limit a region asked under, and its floor in it (its configuration, its overrides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Asked {
    /// The limit's rate (per its period) and burst.
    pub(crate) total: Share,
    /// The region's floor of it.
    pub(crate) floor: Share,
    /// The limit's period, in microseconds: the rates above (and the parts granted under it)
    /// count requests per this period.
    pub(crate) period_us: u64,
}

impl Asked {
    /// What a region asks under for a key of `limit` with `floor`.
    pub(crate) fn of(limit: &crate::algo::gcra::Limit, floor: crate::config::RegionFloor) -> Asked {
        Asked {
            total: Share {
                rate: limit.count(),
                burst: limit.burst(),
            },
            floor: Share {
                rate: floor.of(limit.count()),
                burst: floor.of(limit.burst()),
            },
            period_us: limit.period_us(),
        }
    }
}

/// The first word of a key's record: 2 since each region's line ends with its limit's period
/// (a record of version 1 reads as foreign: nothing above the floors for one hold).
const KEY_RECORD_VERSION: &str = "2";

/// One key's record in the global store, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct KeyRecord {
    /// Until when nothing above the floors is granted for this key.
    pub(crate) quiet_until: u64,
    /// Each region that holds something, by name, with the limit it last asked under.
    pub(crate) regions: Vec<(String, Held, Asked)>,
}

impl KeyRecord {
    // The text form is the Redis global store's (memory keeps the records as they are).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    /// The record `text` holds; `None` when it is not one of ours.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let mut head = lines.next()?.split(' ');
        if head.next()? != KEY_RECORD_VERSION {
            return None;
        }
        let quiet_until = head.next()?.parse().ok()?;
        if head.next().is_some() {
            return None;
        }
        let mut regions = Vec::new();
        for line in lines {
            if regions.len() == MAX_REGIONS {
                return None;
            }
            let mut f = line.split(' ');
            let name = f.next()?;
            if !is_region_name(name) {
                return None;
            }
            let mut n = || -> Option<u64> { f.next()?.parse().ok() };
            let held = Held {
                answered: n()?,
                granted: Share {
                    rate: n()?,
                    burst: n()?,
                },
                held: Share {
                    rate: n()?,
                    burst: n()?,
                },
                issued_at: n()?,
                demand: n()?,
            };
            let asked = Asked {
                total: Share {
                    rate: n()?,
                    burst: n()?,
                },
                floor: Share {
                    rate: n()?,
                    burst: n()?,
                },
                period_us: n()?,
            };
            if f.next().is_some() {
                return None;
            }
            regions.push((name.to_owned(), held, asked));
        }
        Some(Self {
            quiet_until,
            regions,
        })
    }

    // The text form is the Redis global store's (memory keeps the records as they are).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    /// The record as stored.
    pub(crate) fn text(&self) -> String {
        let mut out = format!("{KEY_RECORD_VERSION} {}", self.quiet_until);
        for (name, h, a) in &self.regions {
            out.push_str(&format!(
                "\n{name} {} {} {} {} {} {} {} {} {} {} {} {}",
                h.answered,
                h.granted.rate,
                h.granted.burst,
                h.held.rate,
                h.held.burst,
                h.issued_at,
                h.demand,
                a.total.rate,
                a.total.burst,
                a.floor.rate,
                a.floor.burst,
                a.period_us
            ));
        }
        out
    }
}

/// What was stored for a key: nothing, a record of ours, or a value that is not one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored<T> {
    None,
    Ours(T),
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Foreign,
}

impl<T> Stored<T> {
    // The text form is the Redis global store's (memory keeps the records as they are).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    /// `text` as read (`''`: none), parsed by `parse`.
    pub(crate) fn read(text: &str, parse: impl Fn(&str) -> Option<T>) -> Self {
        if text.is_empty() {
            return Stored::None;
        }
        parse(text).map_or(Stored::Foreign, Stored::Ours)
    }
}

/// What the global store answers one region's request for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answered {
    /// The record to write in place of the one read (`None`: delete it).
    pub(crate) record: Option<KeyRecord>,
    /// How long the record lives, in milliseconds: until every grant in it has lapsed, and
    /// its quiet period has ended.
    pub(crate) ttl_ms: u64,
    /// The grant, if the request was answered (a late or repeated one is not).
    pub(crate) grant: Option<Grant>,
    /// Whether the answer may change once the other regions have reported and confirmed in
    /// this period (the task asks again later in it): `Grant::short`.
    pub(crate) ask_again: bool,
}

/// The global store's answer at `now` (its clock) to `request` (`region` the requester; its
/// `region` field is ignored) for a key whose record is `stored`, under `registry`, asked
/// under the limit and floor of `asked` (the lease and margin of `settings`). The protocol's
/// transition ([`GlobalKey::on_request`]) over the regions of the registry and of the record
/// (one it does not know as registered is kept and counted, with no floor).
///
/// When the regions disagree on the limit (a rolling deploy, an override one region has not
/// seen yet), the smaller wins: the movable part is the smallest limit any region asked under
/// while its grant may be in use, less each registered region's largest floor of them.
pub(crate) fn answer(
    stored: Stored<KeyRecord>,
    registry: &RegistryRecord,
    region: &str,
    request: Request,
    asked: Asked,
    settings: &Settings,
    now: u64,
) -> Answered {
    let hold = settings.hold_us();
    let record = match stored {
        Stored::None => KeyRecord::default(),
        Stored::Ours(r) => r,
        // Not ours: what it held is unknown, so nothing above the floors for one hold.
        Stored::Foreign => KeyRecord {
            quiet_until: now.saturating_add(hold),
            regions: Vec::new(),
        },
    };
    let names = names_of(registry, &record, region);
    let mut positions = Registry::new(names.len());
    for (i, name) in names.iter().enumerate() {
        positions.registered_at[i] = registry.registered_at(name);
    }
    let Recorded {
        mut key,
        mut limits,
        total,
        floors,
        other_period,
    } = held_by(&record, &names, asked, now, hold);
    let me = names.iter().position(|n| *n == region).unwrap_or(0);
    limits[me] = asked;
    let movable = positions.movable(total, &floors);
    // Parts under another period (a rolling deploy that changes the period): nothing above the
    // floors until they have lapsed.
    let quiet_until = if other_period {
        u64::MAX
    } else {
        registry.quiet_until.max(record.quiet_until)
    };
    let grant = key.on_request(
        &Request {
            region: me,
            ..request
        },
        now,
        movable,
        quiet_until,
        settings,
    );
    let quiet_left = record.quiet_until.saturating_sub(now);
    let record = record_after(&names, &key, &limits, record.quiet_until, quiet_left);
    let ask_again = grant.is_some_and(|g| g.short);
    Answered {
        record,
        ttl_ms: hold.max(quiet_left).div_ceil(1_000).max(1),
        grant,
        ask_again,
    }
}

/// The regions of an answer, by position: the registered ones, then the record's others, then
/// `region` if neither holds it.
fn names_of<'a>(
    registry: &'a RegistryRecord,
    record: &'a KeyRecord,
    region: &'a str,
) -> Vec<&'a str> {
    let mut names: Vec<&str> = registry.regions.iter().map(|(n, _)| n.as_str()).collect();
    for (name, ..) in &record.regions {
        if !names.contains(&name.as_str()) {
            names.push(name);
        }
    }
    if !names.contains(&region) {
        names.push(region);
    }
    names
}

/// What a key's record holds for an answer, by the positions of `names`: each region's part
/// and the limit it asked under, the smallest limit and each region's largest floor among those
/// whose grant may be in use (a clock that went back: it still may), and whether a part granted
/// under another period may be in use (its rates do not compare).
struct Recorded {
    key: GlobalKey,
    limits: Vec<Asked>,
    total: Share,
    floors: Vec<Share>,
    other_period: bool,
}

fn held_by(record: &KeyRecord, names: &[&str], asked: Asked, now: u64, hold: u64) -> Recorded {
    let mut held = Recorded {
        key: GlobalKey::new(names.len()),
        limits: vec![asked; names.len()],
        total: asked.total,
        floors: vec![asked.floor; names.len()],
        other_period: false,
    };
    for (name, part, theirs) in &record.regions {
        if let Some(i) = names.iter().position(|n| n == name) {
            held.key.regions[i] = *part;
            held.limits[i] = *theirs;
            if now.checked_sub(part.issued_at).is_none_or(|age| age < hold) {
                held.total = held.total.min(theirs.total);
                held.floors[i] = held.floors[i].max(theirs.floor);
                held.other_period |=
                    theirs.period_us != asked.period_us && part.held != Share::ZERO;
            }
        }
    }
    held
}

/// The record written after an answer: the regions answered that hold a part or a demand,
/// and the quiet period while it lasts (`quiet_left` of it from `quiet_until`); `None`
/// (deleted) when neither is left.
fn record_after(
    names: &[&str],
    key: &GlobalKey,
    limits: &[Asked],
    quiet_until: u64,
    quiet_left: u64,
) -> Option<KeyRecord> {
    let regions: Vec<(String, Held, Asked)> = names
        .iter()
        .zip(&key.regions)
        .zip(limits)
        .filter(|((_, h), _)| h.answered != 0 && !(h.held == Share::ZERO && h.demand == 0))
        .map(|((n, h), a)| ((*n).to_owned(), *h, *a))
        .collect();
    (!regions.is_empty() || quiet_left > 0).then_some(KeyRecord {
        quiet_until: if quiet_left > 0 { quiet_until } else { 0 },
        regions,
    })
}

#[cfg(test)]
mod tests;
