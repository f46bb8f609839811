//! Starting a replay warm: the stored states of some limits at one instant, read from Redis
//! (read only) or from the file they were saved to, and put into each policy's buckets
//! before the first request (`docs/replay.md`, "Starting warm").

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use crate::algo::calendar::CalendarState;
use crate::algo::tiers::{TierLog, TierState};
use crate::backend::{MemoryBackend, kit};
use crate::config::Limits;
use crate::key::BucketKey;

/// The version of the snapshot file's format (its first line's `snapshot`).
pub const SNAPSHOT_VERSION: u32 = 1;

/// The longest line of a snapshot file (a concurrency key's leases are the longest state).
const MAX_SNAPSHOT_LINE: usize = 4 << 20;

/// The most keys a snapshot holds by default (the memory backend's own cap).
pub const DEFAULT_SNAPSHOT_KEYS: usize = crate::backend::memory::DEFAULT_MAX_KEYS;

/// The stored states of some limits at one instant: what a replay starts both policies from
/// ([`Replay::snapshot`](crate::Replay::snapshot)), so that the keys that were already busy
/// when the log begins are busy in the replay too.
///
/// Read from Redis with [`Snapshot::from_redis`] (feature `redis`; read only), saved with
/// [`Snapshot::write`] and read back with [`Snapshot::read`]: one JSON line per key after a
/// header (`docs/replay.md`, "Starting warm").
///
/// ```
/// use tower_ratelimits::{kit, Snapshot};
/// let mut snapshot = Snapshot::new(1_764_064_800_000_000);
/// snapshot.push("PerIp", "192.0.2.1", kit::Stored::Tat(1_764_064_801_000_000));
/// let mut file = Vec::new();
/// snapshot.write(&mut file)?;
/// let back = Snapshot::read(&file[..])?;
/// assert_eq!((back.instant_us(), back.keys().len()), (1_764_064_800_000_000, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    instant_us: u64,
    keys: Vec<SnapshotKey>,
    foreign: u64,
    /// Each key's line in the file it was read from (none for a snapshot of a store).
    lines: Vec<u64>,
}

/// Two snapshots are equal when they hold the same keys, wherever they were read from.
impl PartialEq for Snapshot {
    fn eq(&self, other: &Self) -> bool {
        (self.instant_us, &self.keys, self.foreign)
            == (other.instant_us, &other.keys, other.foreign)
    }
}

impl Eq for Snapshot {}

/// One key of a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotKey {
    /// The limit's name.
    pub limit: String,
    /// The id's text (as its `Display` writes it: `192.0.2.1`, `2001:db8:1::/48`, `42`).
    pub id: String,
    /// The state, as the batch kit keeps it.
    pub state: kit::Stored,
}

/// Why a snapshot could not be read.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The file could not be read or written.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A line of the file is not what a snapshot holds.
    #[error("line {line}: {reason}")]
    Line {
        /// Its number, from 1.
        line: u64,
        /// Why.
        reason: String,
    },
    /// More keys than the bound ([`Snapshot::from_redis`]'s `max_keys`).
    #[error("more than {0} keys: raise the bound (--max-keys) or snapshot fewer limits")]
    TooManyKeys(usize),
    /// The store could not be read.
    #[error("reading the store: {0}")]
    Store(crate::backend::BackendError),
    /// The store could not be reached.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error("{0}")]
    Connect(crate::backend::RedisSetupError),
}

impl std::fmt::Debug for SnapshotError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// What starting from a snapshot did, in a [`Plan`](crate::Plan)'s `warm`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Warm {
    /// The snapshot's instant (RFC 3339): the replay starts there.
    pub instant: String,
    /// The keys in the snapshot.
    pub keys: u64,
    /// Values the snapshot found that are not a state of ours, left out.
    pub foreign: u64,
    /// Keys put into the current policy's buckets (the others: a limit it does not define,
    /// an id its kind refuses, a disabled limit, a state of another shape).
    pub current_seeded: u64,
    /// Keys put into the candidate's buckets, each read under the candidate's limit by the
    /// change rule.
    pub candidate_seeded: u64,
    /// Keys whose id the limit's kind refuses, under the current policy and the candidate (a
    /// snapshot of another deployment's limits): left out of that policy.
    #[serde(default)]
    pub refused_ids: [u64; 2],
    /// The first of them (at most 10), with their line in the snapshot file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_id_examples: Vec<RefusedId>,
    /// Lines before the instant, not replayed (their requests are in the snapshot).
    pub lines_before: u64,
}

/// A snapshot's key whose id a policy's limit refuses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RefusedId {
    /// `current` or `candidate`.
    pub policy: String,
    /// The limit.
    pub limit: String,
    /// The id, as the snapshot holds it.
    pub id: String,
    /// Its line in the snapshot file (0: a snapshot read from the store).
    pub line: u64,
    /// Why the limit's kind refuses it.
    pub reason: String,
}

/// The most [`RefusedId`]s a plan lists.
const REFUSED_ID_EXAMPLES: usize = 10;

/// The header line of a snapshot file.
#[derive(Serialize, Deserialize)]
struct Header {
    snapshot: u32,
    instant_us: u64,
    #[serde(default)]
    instant: String,
    keys: u64,
    #[serde(default)]
    foreign: u64,
}

/// A key's line: its limit, its id and exactly one state.
#[derive(Serialize, Deserialize, Default)]
struct Line {
    limit: String,
    id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gcra: Option<GcraLine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tiers: Option<Vec<TierLine>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    leases: Option<Vec<(u64, u64)>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    calendar: Option<CalendarLine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fair_share: Option<FairLine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    adaptive: Option<AdaptiveLine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    adaptive_pool: Option<PoolLine>,
}

/// The keys of an adaptive limit that share a capacity (its `id` is empty: the limit's own
/// key): each key's state, and the keys waiting under their share.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolLine {
    keys: Vec<(String, AdaptiveLine)>,
    /// `(id, until_us)`.
    waiting: Vec<(String, u64)>,
}

impl PoolLine {
    fn of(p: &kit::AdaptivePool) -> PoolLine {
        PoolLine {
            keys: p
                .keys()
                .map(|(id, s)| (id.to_string(), AdaptiveLine::of(s)))
                .collect(),
            waiting: p
                .waiters()
                .iter()
                .map(|(id, until)| (id.to_string(), *until))
                .collect(),
        }
    }

    fn into_state(self) -> Result<kit::Stored, String> {
        if self.keys.len() > kit::MAX_POOL_KEYS || self.waiting.len() > kit::MAX_POOL_WAITERS {
            return Err("adaptive_pool: more keys or waiters than a limit keeps".into());
        }
        let id = |text: &str| crate::key::Id::new(text).map_err(|e| format!("adaptive_pool: {e}"));
        let mut keys = Vec::with_capacity(self.keys.len());
        for (k, line) in self.keys {
            keys.push((id(&k)?, line.into_adaptive()));
        }
        let mut waiting = Vec::with_capacity(self.waiting.len());
        for (w, until) in self.waiting {
            waiting.push((id(&w)?, until));
        }
        Ok(kit::Stored::AdaptivePool(Box::new(kit::AdaptivePool::new(
            keys, waiting,
        ))))
    }
}

/// An adaptive concurrency key's state: its leases, its controller, its window.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdaptiveLine {
    leases: Vec<(u64, u64)>,
    limit_milli: u64,
    long_us: u64,
    /// `(completions, failures, latency_sum_us, max_in_flight)`.
    window: (u64, u64, u64, u64),
    window_start_us: u64,
    last_us: u64,
}

impl AdaptiveLine {
    fn of(a: &crate::algo::adaptive::AdaptiveState) -> Self {
        let w = &a.window;
        AdaptiveLine {
            leases: a.leases.clone(),
            limit_milli: a.controller.limit_milli,
            long_us: a.controller.long_us,
            window: (w.completions, w.failures, w.latency_sum_us, w.max_in_flight),
            window_start_us: a.window_start_us,
            last_us: a.last_us,
        }
    }

    fn into_adaptive(self) -> crate::algo::adaptive::AdaptiveState {
        use crate::algo::adaptive::{AdaptiveState, Controller, Window};
        let (completions, failures, latency_sum_us, max_in_flight) = self.window;
        AdaptiveState {
            leases: self.leases,
            controller: Controller {
                limit_milli: self.limit_milli,
                long_us: self.long_us,
            },
            window: Window {
                completions,
                failures,
                latency_sum_us,
                max_in_flight,
            },
            window_start_us: self.window_start_us,
            last_us: self.last_us,
        }
    }
}

/// A fair-share limit's state (its `id` is empty: the limit's own key).
#[derive(Serialize, Deserialize)]
struct FairLine {
    /// The budget's stored word (its TAT and its writer's bound).
    word: u64,
    epoch: u64,
    weights: (u64, u64),
    mins: (u64, u64),
    #[serde(default)]
    ids: (u64, u64),
    /// `(id, until_us, cost)`.
    waiting: Vec<(String, u64, u64)>,
    /// `(id, tat_us, epoch, weight, min)`.
    members: Vec<(String, u64, u64, u64, u64)>,
    /// The units admitted below their share by period (`Pool::held`; none before it was kept).
    #[serde(default)]
    held: [u64; 3],
    /// `(id, units by period, the latest's period)` of the members admitted below their share
    /// (`Member::below`).
    #[serde(default)]
    below: Vec<(String, [u64; 3], u64)>,
    /// The last period an id seen before was refused in, and the units new ids took in
    /// `epoch` (`Pool::pressed`, `Pool::fresh`; none before they were kept).
    #[serde(default)]
    pressed: u64,
    #[serde(default)]
    fresh: u64,
    /// `(id, period)` of the members first counted since they were last forgotten
    /// (`Member::since`).
    #[serde(default)]
    since: Vec<(String, u64)>,
}

impl FairLine {
    fn of(p: &kit::FairPool) -> FairLine {
        let pool = &p.pool;
        FairLine {
            word: pool.tat,
            epoch: pool.epoch,
            weights: pool.weights,
            mins: pool.mins,
            ids: pool.ids,
            waiting: pool
                .waiting
                .iter()
                .map(|w| (w.id.to_string(), w.until_us, w.cost))
                .collect(),
            members: p
                .members()
                .map(|(id, m)| (id.to_string(), m.tat, m.epoch, m.weight, m.min))
                .collect(),
            held: pool.held,
            below: p
                .members()
                .filter(|(_, m)| m.below != [0; 3])
                .map(|(id, m)| (id.to_string(), m.below, m.below_at))
                .collect(),
            pressed: pool.pressed,
            fresh: pool.fresh,
            since: p
                .members()
                .filter(|(_, m)| m.since != 0)
                .map(|(id, m)| (id.to_string(), m.since))
                .collect(),
        }
    }

    fn into_state(self) -> Result<kit::Stored, String> {
        use crate::algo::fair_share::{MAX_MEMBERS, MAX_WAITERS, Member, Pool, Waiter};
        if self.waiting.len() > MAX_WAITERS || self.members.len() > 2 * MAX_MEMBERS {
            return Err("fair_share: more waiters or members than a limit keeps".into());
        }
        let id = |text: &str| crate::key::Id::new(text).map_err(|e| format!("fair_share: {e}"));
        let mut waiting = Vec::with_capacity(self.waiting.len());
        for (w, until_us, cost) in &self.waiting {
            waiting.push(Waiter {
                id: id(w)?,
                until_us: *until_us,
                cost: *cost,
            });
        }
        let mut members = std::collections::HashMap::with_capacity(self.members.len());
        for (m, tat, epoch, weight, min) in &self.members {
            let member = Member {
                tat: *tat,
                epoch: *epoch,
                weight: *weight,
                min: *min,
                ..Member::default()
            };
            members.insert(id(m)?, member);
        }
        for (m, below, below_at) in &self.below {
            if let Some(member) = members.get_mut(&id(m)?) {
                (member.below, member.below_at) = (*below, *below_at);
            }
        }
        for (m, since) in &self.since {
            if let Some(member) = members.get_mut(&id(m)?) {
                member.since = *since;
            }
        }
        let pool = Pool {
            tat: self.word,
            epoch: self.epoch,
            weights: self.weights,
            mins: self.mins,
            ids: self.ids,
            waiting,
            held: self.held,
            pressed: self.pressed,
            fresh: self.fresh,
        };
        Ok(kit::Stored::FairShare(Box::new(kit::FairPool::new(
            pool, members,
        ))))
    }
}

#[derive(Serialize, Deserialize)]
struct GcraLine {
    tat_us: u64,
    bound_bits: u32,
}

#[derive(Serialize, Deserialize)]
struct TierLine {
    entered_us: Option<u64>,
    grants: Vec<(u64, u64)>,
}

#[derive(Serialize, Deserialize)]
struct CalendarLine {
    end_us: u64,
    used: u64,
}

impl Line {
    fn of(key: &SnapshotKey) -> Line {
        let mut line = Line {
            limit: key.limit.clone(),
            id: key.id.clone(),
            ..Line::default()
        };
        match &key.state {
            kit::Stored::Tat(word) => {
                let (tat_us, bound) = kit::gcra_unword(*word);
                line.gcra = Some(GcraLine {
                    tat_us,
                    bound_bits: if bound == 0 {
                        0
                    } else {
                        bound.trailing_zeros()
                    },
                });
            }
            kit::Stored::Tiers(state) => {
                line.tiers = Some(
                    state
                        .tiers()
                        .iter()
                        .map(|t| TierLine {
                            entered_us: t.entry(),
                            grants: t.grants().to_vec(),
                        })
                        .collect(),
                );
            }
            kit::Stored::Leases(leases) => line.leases = Some(leases.clone()),
            kit::Stored::Calendar(c) => {
                line.calendar = Some(CalendarLine {
                    end_us: c.end_us,
                    used: c.used,
                });
            }
            kit::Stored::FairShare(p) => line.fair_share = Some(FairLine::of(p)),
            kit::Stored::Adaptive(a) => line.adaptive = Some(AdaptiveLine::of(a)),
            kit::Stored::AdaptivePool(p) => line.adaptive_pool = Some(PoolLine::of(p)),
        }
        line
    }

    fn into_key(self) -> Result<SnapshotKey, String> {
        let shapes = [
            self.gcra.is_some(),
            self.tiers.is_some(),
            self.leases.is_some(),
            self.calendar.is_some(),
            self.fair_share.is_some(),
            self.adaptive.is_some(),
            self.adaptive_pool.is_some(),
        ];
        if shapes.iter().filter(|&&s| s).count() != 1 {
            return Err(
                "a key holds exactly one of gcra, tiers, leases, calendar, fair_share, \
                 adaptive, adaptive_pool"
                    .into(),
            );
        }
        if let Some(a) = self.adaptive {
            return Ok(SnapshotKey {
                limit: self.limit,
                id: self.id,
                state: kit::Stored::Adaptive(Box::new(a.into_adaptive())),
            });
        }
        if let Some(p) = self.adaptive_pool {
            return Ok(SnapshotKey {
                limit: self.limit,
                id: self.id,
                state: p.into_state()?,
            });
        }
        if let Some(f) = self.fair_share {
            return Ok(SnapshotKey {
                limit: self.limit,
                id: self.id,
                state: f.into_state()?,
            });
        }
        let state = match (self.gcra, self.tiers, self.leases, self.calendar) {
            (Some(g), None, None, None) => {
                if g.bound_bits > 52 {
                    return Err(format!("bound_bits {} is above 52", g.bound_bits));
                }
                let bound = (1u64 << g.bound_bits) - 1;
                kit::gcra_word_bound(g.tat_us, bound)
                    .map(kit::Stored::Tat)
                    .map_err(|e| format!("tat_us {}: {e}", g.tat_us))?
            }
            (None, Some(t), None, None) => kit::Stored::Tiers(TierState::from_tiers(
                t.into_iter()
                    .map(|t| TierLog::new(t.entered_us, t.grants))
                    .collect(),
            )),
            (None, None, Some(l), None) => kit::Stored::Leases(l),
            (None, None, None, Some(c)) => kit::Stored::Calendar(CalendarState {
                end_us: c.end_us,
                used: c.used,
            }),
            _ => return Err("a key holds exactly one of gcra, tiers, leases, calendar".into()),
        };
        Ok(SnapshotKey {
            limit: self.limit,
            id: self.id,
            state,
        })
    }
}

/// Reads one line into `buf`, at most one byte more than the longest a snapshot holds.
fn read_line<R: BufRead>(input: &mut R, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    std::io::Read::take(input, MAX_SNAPSHOT_LINE as u64 + 1).read_until(b'\n', buf)
}

impl Snapshot {
    /// An empty snapshot taken at `instant_us` (microseconds since the Unix epoch).
    pub fn new(instant_us: u64) -> Snapshot {
        Snapshot {
            instant_us,
            ..Snapshot::default()
        }
    }

    /// Adds a key's state.
    pub fn push(&mut self, limit: impl Into<String>, id: impl Into<String>, state: kit::Stored) {
        self.keys.push(SnapshotKey {
            limit: limit.into(),
            id: id.into(),
            state,
        });
    }

    /// When it was taken: the store's clock when the read began (microseconds since the Unix
    /// epoch).
    pub fn instant_us(&self) -> u64 {
        self.instant_us
    }

    /// Its keys.
    pub fn keys(&self) -> &[SnapshotKey] {
        &self.keys
    }

    /// Values found under the limits' keys that are not a state of ours (another program's
    /// data, a format this version does not read), left out.
    pub fn foreign(&self) -> u64 {
        self.foreign
    }

    /// Reads the states of every key of `limits`' names from the store `backend` connects to
    /// (its URL, prefix, timeouts; connected here, read only: no stored override is read or
    /// followed), at most `max_keys` of them ([`DEFAULT_SNAPSHOT_KEYS`]): `SCAN` on every
    /// master, then `GET`, `PEXPIRETIME`, `ZCARD`, `ZRANGE`. Nothing is written. The instant
    /// is the store's clock (`TIME`) when the read began, or the backend's own with
    /// [`caller_time`](crate::RedisBackendBuilder::caller_time). A request decided while the
    /// read runs may be in the snapshot and in the lines replayed after its instant.
    ///
    /// ```no_run
    /// # async fn read() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_ratelimits::{Limits, RedisBackend, Snapshot};
    /// let limits = Limits::from_yaml_file("limits.yaml")?;
    /// let backend = RedisBackend::from_url("redis://127.0.0.1:6379").prefix("rl:");
    /// let snapshot = Snapshot::from_redis(backend, &limits, 1_000_000).await?;
    /// snapshot.write(std::fs::File::create("state.jsonl")?)?;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub async fn from_redis(
        backend: crate::backend::RedisBackendBuilder,
        limits: &Limits,
        max_keys: usize,
    ) -> Result<Snapshot, SnapshotError> {
        use crate::backend::redis::snapshot::ReadError;
        let backend = backend
            .read_only()
            .connect()
            .await
            .map_err(SnapshotError::Connect)?;
        let names: Vec<&str> = limits.names().map(|n| n.as_str()).collect();
        let states = backend
            .read_states(&names, max_keys)
            .await
            .map_err(|e| match e {
                ReadError::Store(e) => SnapshotError::Store(e),
                ReadError::TooMany(n) => SnapshotError::TooManyKeys(n),
            })?;
        Ok(Snapshot {
            instant_us: states.instant_us,
            foreign: states.foreign,
            lines: Vec::new(),
            keys: states
                .keys
                .into_iter()
                .map(|k| SnapshotKey {
                    limit: k.limit,
                    id: k.id,
                    state: k.state,
                })
                .collect(),
        })
    }

    /// Writes it: a header line (`snapshot`, `instant_us`, `instant`, `keys`, `foreign`), then
    /// one JSON line per key (`limit`, `id`, and one of `gcra` (`tat_us`, `bound_bits`),
    /// `tiers` (per tier `entered_us` and `grants`, `[time, units]`), `leases` (`[id,
    /// deadline]`), `calendar` (`end_us`, `used`)).
    pub fn write(&self, mut out: impl Write) -> std::io::Result<()> {
        let header = Header {
            snapshot: SNAPSHOT_VERSION,
            instant_us: self.instant_us,
            instant: crate::time::instant_text(self.instant_us),
            keys: self.keys.len() as u64,
            foreign: self.foreign,
        };
        serde_json::to_writer(&mut out, &header)?;
        out.write_all(b"\n")?;
        for key in &self.keys {
            serde_json::to_writer(&mut out, &Line::of(key))?;
            out.write_all(b"\n")?;
        }
        out.flush()
    }

    /// Reads what [`write`](Self::write) wrote, at most [`DEFAULT_SNAPSHOT_KEYS`] keys, each
    /// line at most 4 MiB.
    pub fn read(mut input: impl BufRead) -> Result<Snapshot, SnapshotError> {
        let mut buf = Vec::new();
        let mut number = 0u64;
        let mut next = |buf: &mut Vec<u8>| -> Result<Option<u64>, SnapshotError> {
            buf.clear();
            number += 1;
            let read = read_line(&mut input, buf)?;
            if read == 0 {
                return Ok(None);
            }
            if buf.len() > MAX_SNAPSHOT_LINE {
                return Err(SnapshotError::Line {
                    line: number,
                    reason: format!("longer than {MAX_SNAPSHOT_LINE} bytes"),
                });
            }
            Ok(Some(number))
        };
        let bad = |line: u64, reason: String| SnapshotError::Line { line, reason };
        let Some(line) = next(&mut buf)? else {
            return Err(bad(1, "empty: not a snapshot".into()));
        };
        let header: Header = serde_json::from_slice(&buf)
            .map_err(|e| bad(line, format!("not a snapshot's header: {e}")))?;
        if header.snapshot != SNAPSHOT_VERSION {
            return Err(bad(
                line,
                format!(
                    "snapshot format {} (this version reads {SNAPSHOT_VERSION})",
                    header.snapshot
                ),
            ));
        }
        let mut snapshot = Snapshot::new(header.instant_us);
        snapshot.foreign = header.foreign;
        // Each key's line: a key twice is two states for one bucket, and which one a replay
        // started from would be the file's order (read silently before).
        let mut lines: std::collections::HashMap<(String, String), u64> =
            std::collections::HashMap::new();
        while let Some(line) = next(&mut buf)? {
            if buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if snapshot.keys.len() >= DEFAULT_SNAPSHOT_KEYS {
                return Err(SnapshotError::TooManyKeys(DEFAULT_SNAPSHOT_KEYS));
            }
            let parsed: Line =
                serde_json::from_slice(&buf).map_err(|e| bad(line, e.to_string()))?;
            let key = parsed.into_key().map_err(|e| bad(line, e))?;
            if let Some(first) = lines.insert((key.limit.clone(), key.id.clone()), line) {
                return Err(bad(
                    line,
                    format!(
                        "limit {:?} id {:?} is on line {first} too: a key has one state",
                        key.limit, key.id
                    ),
                ));
            }
            snapshot.keys.push(key);
            snapshot.lines.push(line);
        }
        if snapshot.keys.len() as u64 != header.keys {
            return Err(bad(
                number,
                format!(
                    "the header promises {} keys, the file holds {} (cut short?)",
                    header.keys,
                    snapshot.keys.len()
                ),
            ));
        }
        Ok(snapshot)
    }

    /// Puts every key a policy reads into its buckets: the keys of limits it defines, whose
    /// id its kind reads and whose state is of the shape of the limit that applies to it.
    /// How many were put; the keys whose id the kind refuses are counted in `warm` (`side` 0:
    /// the current policy, 1: the candidate), the first with their lines.
    pub(super) fn seed(
        &self,
        limits: &Limits,
        memory: &MemoryBackend,
        side: usize,
        warm: &mut Warm,
    ) -> u64 {
        let mut seeded = 0;
        for (i, key) in self.keys.iter().enumerate() {
            let Some(name) = limits.name(&key.limit) else {
                continue;
            };
            // A state kept for the whole limit (a fair share's): its id is empty.
            let (bucket, quota) = if key.id.is_empty() {
                let Some(quota) = limits.default_limit(name) else {
                    continue;
                };
                (BucketKey::limit_wide(name), quota)
            } else {
                let Some(kind) = limits.id_kind(name) else {
                    continue;
                };
                let id = match kind.parse(&key.id) {
                    Ok(id) => id,
                    Err(e) => {
                        warm.refused_ids[side] += 1;
                        if warm.refused_id_examples.len() < REFUSED_ID_EXAMPLES {
                            warm.refused_id_examples.push(RefusedId {
                                policy: ["current", "candidate"][side].into(),
                                limit: key.limit.clone(),
                                id: key.id.clone(),
                                line: self.lines.get(i).copied().unwrap_or(0),
                                reason: e.to_string(),
                            });
                        }
                        continue;
                    }
                };
                let bucket = BucketKey::new(name, id);
                let Some(quota) = limits.resolve(&bucket) else {
                    continue;
                };
                (bucket, quota)
            };
            if key.state.is_shape_of(quota)
                && memory
                    .restore(&bucket, quota, key.state.clone(), self.instant_us)
                    .unwrap_or(false)
            {
                seeded += 1;
            }
        }
        seeded
    }
}
