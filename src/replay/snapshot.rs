//! Starting a replay warm: the stored states of some limits at one instant, read from Redis
//! (read only) or from the file they were saved to, and put into each policy's buckets
//! before the first request (`docs/replay.md`, "Starting warm").

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

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

/// A key's line as written: its limit, its id and its state, which each shape writes
/// (`kit::Stored`'s form: one field named for the shape).
#[derive(Serialize)]
struct Line<'a> {
    limit: &'a str,
    id: &'a str,
    #[serde(flatten)]
    state: &'a kit::Stored,
}

impl<'a> Line<'a> {
    fn of(key: &'a SnapshotKey) -> Line<'a> {
        Line {
            limit: &key.limit,
            id: &key.id,
            state: &key.state,
        }
    }
}

/// A key's line as read: its limit, its id and exactly one other field, the state, which its
/// shape reads.
#[derive(Deserialize)]
struct LineRead {
    limit: String,
    id: String,
    #[serde(flatten)]
    state: serde_json::Map<String, serde_json::Value>,
}

impl LineRead {
    fn into_key(self) -> Result<SnapshotKey, String> {
        if self.state.len() != 1 {
            return Err(format!(
                "a key holds exactly one state beside its limit and id, found {} fields",
                self.state.len()
            ));
        }
        let state = serde_json::from_value(serde_json::Value::Object(self.state))
            .map_err(|e| e.to_string())?;
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
        // started from would be the file's order (read silently before). A key's penalty
        // state is a state of its own, on a line of its own.
        let mut lines: std::collections::HashMap<(String, String, bool), u64> =
            std::collections::HashMap::new();
        while let Some(line) = next(&mut buf)? {
            if buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if snapshot.keys.len() >= DEFAULT_SNAPSHOT_KEYS {
                return Err(SnapshotError::TooManyKeys(DEFAULT_SNAPSHOT_KEYS));
            }
            let parsed: LineRead =
                serde_json::from_slice(&buf).map_err(|e| bad(line, e.to_string()))?;
            let key = parsed.into_key().map_err(|e| bad(line, e))?;
            let penalty = matches!(key.state, kit::Stored::Penalty(_));
            let seen = (key.limit.clone(), key.id.clone(), penalty);
            if let Some(first) = lines.insert(seen, line) {
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
            // A key's penalty state goes to its limit's ladder, kept at the key's id under
            // the ladder's own name (a policy without one reads none).
            let (bucket, penalty) = match (&key.state, limits.entry(name)) {
                (kit::Stored::Penalty(_), Some(entry)) => match &entry.penalty {
                    Some(p) => (BucketKey::new(p.state, bucket.id().clone()), Some(p)),
                    None => continue,
                },
                _ if key.state.is_shape_of(quota) => (bucket, None),
                _ => continue,
            };
            if memory
                .restore(&bucket, quota, penalty, key.state.clone(), self.instant_us)
                .unwrap_or(false)
            {
                seeded += 1;
            }
        }
        seeded
    }
}
