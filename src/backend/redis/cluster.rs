//! Redis Cluster routing with one independent connection per master.
//!
//! fred's clustered client reconnects as a whole: while one master is unreachable it keeps
//! re-synchronizing and no command to any node is sent. A rate limiter must instead keep
//! deciding for every slot whose node is alive, so the backend routes by itself: it reads the
//! slot map (`CLUSTER SLOTS`), keeps one centralized fred client per master (each reconnecting
//! in the background on its own), sends each script to the master of its slot, and refreshes the
//! map on `MOVED`/`ASK` and, at most once a second, after a node could not be reached.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use fred::prelude::{
    Client, ClientLike, Config, Error as FredError, LuaInterface, ServerConfig, Value,
};

use super::breaker::{self, Breaker};
use super::script::SCRIPT;
use super::setup::{RedisSetupError, configured_builder};
use crate::backend::BackendError;

const SLOTS: usize = 16_384;

/// Why the slot map could not be read or installed (its text is a setup error's reason and a
/// refresh's warning).
#[derive(Debug, thiserror::Error)]
enum TopologyError {
    /// A node's client could not be built.
    #[error("{0}")]
    Client(FredError),
    /// No node answered; the last one's reason, or none to ask.
    #[error("no node to ask")]
    NoNode,
    /// A node could not be reached in time.
    #[error("{0}:{1}: cannot connect")]
    Connect(String, u16),
    /// A node's answer to `CLUSTER SLOTS`: an error, none in time, or not a slot map.
    #[error("{0}:{1}: {2}")]
    Asked(String, u16, SlotsError),
    /// The map read assigns no slot.
    #[error("the cluster serves no slot")]
    NoSlot,
}

/// What was wrong with one node's answer to `CLUSTER SLOTS`.
#[derive(Debug, thiserror::Error)]
enum SlotsError {
    #[error("{0}")]
    Store(FredError),
    #[error("CLUSTER SLOTS timed out")]
    TimedOut,
    #[error("CLUSTER SLOTS did not answer an array")]
    NotAnArray,
    #[error("malformed CLUSTER SLOTS entry")]
    Entry,
    #[error("malformed slot range")]
    Range,
    #[error("slot range without a master")]
    NoMaster,
    #[error("master without a port")]
    NoPort,
}

/// One range of slots of `CLUSTER SLOTS` and the master serving it.
struct SlotRange {
    start: u16,
    end: u16,
    host: String,
    port: u16,
}
const UNASSIGNED: u16 = u16::MAX;

struct Topology {
    /// Node index per slot (`UNASSIGNED`: no master).
    slots: Box<[u16]>,
    nodes: Vec<(String, u16, Client)>,
    /// Each node's circuit breaker, by node index (kept across refreshes for the same node).
    breakers: Vec<Arc<Breaker>>,
}

struct RouterInner {
    template: Config,
    timeout: Duration,
    seeds: Vec<(String, u16)>,
    topology: RwLock<Arc<Topology>>,
    breaker: breaker::Settings,
    refreshing: AtomicBool,
    started: Instant,
    /// Milliseconds since `started` of the last refresh.
    last_refresh_ms: AtomicU64,
}

/// Routes commands to the master of each slot.
#[derive(Clone)]
pub(super) struct ClusterRouter {
    inner: Arc<RouterInner>,
}

/// Whether the server answered that the slot lives elsewhere.
pub(super) fn is_redirect(e: &FredError) -> bool {
    let d = e.details();
    d.starts_with("MOVED") || d.starts_with("ASK") || d.contains(" MOVED ") || d.contains(" ASK ")
}

fn read_lock<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|p| p.into_inner())
}

impl ClusterRouter {
    /// Reads the slot map from the URL's nodes and connects to every master.
    pub(super) async fn connect(
        config: Config,
        timeout: Duration,
        breaker: breaker::Settings,
    ) -> Result<Self, RedisSetupError> {
        let ServerConfig::Clustered { hosts, .. } = &config.server else {
            return Err(RedisSetupError::InvalidUrl(
                "not a cluster configuration".into(),
            ));
        };
        let seeds: Vec<(String, u16)> =
            hosts.iter().map(|s| (s.host.to_string(), s.port)).collect();
        let router = Self {
            inner: Arc::new(RouterInner {
                template: config.clone(),
                timeout,
                seeds,
                topology: RwLock::new(Arc::new(Topology {
                    slots: vec![UNASSIGNED; SLOTS].into_boxed_slice(),
                    nodes: Vec::new(),
                    breakers: Vec::new(),
                })),
                breaker,
                refreshing: AtomicBool::new(false),
                started: Instant::now(),
                last_refresh_ms: AtomicU64::new(0),
            }),
        };
        let deadline = timeout.max(Duration::from_secs(2));
        match tokio::time::timeout(deadline, router.refresh()).await {
            Ok(Ok(())) => Ok(router),
            Ok(Err(e)) => Err(RedisSetupError::connect(
                &super::setup::address(&config),
                e.to_string(),
                false,
            )),
            Err(_) => Err(RedisSetupError::connect(
                &super::setup::address(&config),
                format!("no cluster slot map within {deadline:?}"),
                false,
            )),
        }
    }

    fn new_client(&self, host: &str, port: u16) -> Result<Client, TopologyError> {
        let mut config = self.inner.template.clone();
        config.server = ServerConfig::new_centralized(host, port);
        // Keep trying in the background when the node is down, also the first time.
        config.fail_fast = false;
        let client = configured_builder(config, self.inner.timeout)
            .build()
            .map_err(TopologyError::Client)?;
        drop(client.connect());
        Ok(client)
    }

    /// The client of the master of `slot`.
    pub(super) fn client_for_slot(&self, slot: u16) -> Result<Client, BackendError> {
        let topology = read_lock(&self.inner.topology).clone();
        match topology.slots.get(usize::from(slot)) {
            Some(&i) if i != UNASSIGNED => Ok(topology.nodes[usize::from(i)].2.clone()),
            _ => {
                self.refresh_soon();
                Err(BackendError::Unavailable(format!(
                    "no Redis Cluster master serves slot {slot}"
                )))
            }
        }
    }

    /// The circuit breaker of the master of `slot`.
    pub(super) fn breaker_for_slot(&self, slot: u16) -> Option<Arc<Breaker>> {
        let topology = read_lock(&self.inner.topology).clone();
        let i = *topology.slots.get(usize::from(slot))?;
        topology.breakers.get(usize::from(i)).cloned()
    }

    /// Every master's circuit breaker.
    pub(super) fn breakers(&self) -> Vec<Arc<Breaker>> {
        read_lock(&self.inner.topology).breakers.clone()
    }

    /// Every master's client (a replay's snapshot walks each; regional mode reads each one's
    /// start).
    pub(super) fn masters(&self) -> Vec<Client> {
        let topology = read_lock(&self.inner.topology).clone();
        topology.nodes.iter().map(|(_, _, c)| c.clone()).collect()
    }

    /// Some master's client.
    pub(super) fn any_client(&self) -> Client {
        let topology = read_lock(&self.inner.topology).clone();
        let i = topology.slots[0];
        let i = if i == UNASSIGNED { 0 } else { usize::from(i) };
        topology.nodes[i].2.clone()
    }

    /// Closes every node's connection (and stops its reconnection attempts).
    pub(super) fn close(&self) {
        let topology = read_lock(&self.inner.topology).clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for (_, _, client) in &topology.nodes {
            let client = client.clone();
            runtime.spawn(async move { client.quit().await });
        }
    }

    /// Loads the script on every master.
    pub(super) async fn load_script(&self, deadline: Duration) -> Result<(), RedisSetupError> {
        let topology = read_lock(&self.inner.topology).clone();
        for (host, port, client) in &topology.nodes {
            match tokio::time::timeout(deadline, client.script_load::<String, _>(SCRIPT)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    return Err(RedisSetupError::connect(
                        &format!("{host}:{port}"),
                        e.to_string(),
                        false,
                    ));
                }
                Err(_) => {
                    return Err(RedisSetupError::connect(
                        &format!("{host}:{port}"),
                        "SCRIPT LOAD timed out",
                        false,
                    ));
                }
            }
        }
        Ok(())
    }

    /// Refreshes the slot map now (after a redirect), unless another refresh is running.
    pub(super) async fn refresh_now(&self) {
        if self.inner.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Err(e) = self.refresh().await {
            tracing::warn!(target: crate::telemetry::target::BACKEND, error = %e, "could not refresh the Redis Cluster slot map");
        }
        self.inner.refreshing.store(false, Ordering::Release);
    }

    /// Refreshes the slot map in the background, at most once a second.
    pub(super) fn refresh_soon(&self) {
        let now_ms = self.inner.started.elapsed().as_millis() as u64;
        let last = self.inner.last_refresh_ms.load(Ordering::Relaxed);
        if now_ms.saturating_sub(last) < 1_000
            || self
                .inner
                .last_refresh_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let router = self.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move { router.refresh_now().await });
        }
    }

    async fn refresh(&self) -> Result<(), TopologyError> {
        let current = read_lock(&self.inner.topology).clone();
        let mut candidates: Vec<(String, u16, Option<Client>)> = current
            .nodes
            .iter()
            .filter(|(_, _, c)| c.is_connected())
            .map(|(h, p, c)| (h.clone(), *p, Some(c.clone())))
            .collect();
        candidates.extend(self.inner.seeds.iter().map(|(h, p)| (h.clone(), *p, None)));
        let mut last_error = TopologyError::NoNode;
        for (host, port, client) in candidates {
            let client = match client {
                Some(c) => c,
                None => {
                    let c = self.new_client(&host, port)?;
                    let connected = tokio::time::timeout(
                        self.inner.timeout.max(Duration::from_secs(1)),
                        c.wait_for_connect(),
                    )
                    .await;
                    if !matches!(connected, Ok(Ok(()))) {
                        let _ = c.quit().await;
                        last_error = TopologyError::Connect(host, port);
                        continue;
                    }
                    c
                }
            };
            let reply = tokio::time::timeout(
                self.inner.timeout.max(Duration::from_secs(1)),
                client.custom::<Value, _>(fred::cmd!("CLUSTER"), vec!["SLOTS"]),
            )
            .await;
            match reply {
                Ok(Ok(value)) => match parse_slots(&value, &host) {
                    Ok(ranges) => {
                        self.install(&current, ranges, (host, port, client))?;
                        self.inner.last_refresh_ms.store(
                            self.inner.started.elapsed().as_millis() as u64,
                            Ordering::Relaxed,
                        );
                        return Ok(());
                    }
                    Err(e) => last_error = TopologyError::Asked(host, port, e),
                },
                Ok(Err(e)) => last_error = TopologyError::Asked(host, port, SlotsError::Store(e)),
                Err(_) => last_error = TopologyError::Asked(host, port, SlotsError::TimedOut),
            }
        }
        Err(last_error)
    }

    fn install(
        &self,
        current: &Topology,
        ranges: Vec<SlotRange>,
        asked: (String, u16, Client),
    ) -> Result<(), TopologyError> {
        let mut existing: HashMap<(String, u16), Client> = current
            .nodes
            .iter()
            .map(|(h, p, c)| ((h.clone(), *p), c.clone()))
            .collect();
        existing.entry((asked.0, asked.1)).or_insert(asked.2);
        let mut nodes: Vec<(String, u16, Client)> = Vec::new();
        let mut slots = vec![UNASSIGNED; SLOTS].into_boxed_slice();
        for SlotRange {
            start,
            end,
            host,
            port,
        } in ranges
        {
            let index = match nodes.iter().position(|(h, p, _)| *h == host && *p == port) {
                Some(i) => i,
                None => {
                    let client = match existing.remove(&(host.clone(), port)) {
                        Some(c) => c,
                        None => self.new_client(&host, port)?,
                    };
                    nodes.push((host, port, client));
                    nodes.len() - 1
                }
            };
            for slot in start..=end.min(SLOTS as u16 - 1) {
                slots[usize::from(slot)] = index as u16;
            }
        }
        if nodes.is_empty() {
            return Err(TopologyError::NoSlot);
        }
        // A node keeps its circuit across refreshes; a new node starts closed.
        let breakers = nodes
            .iter()
            .map(|(host, port, _)| {
                current
                    .nodes
                    .iter()
                    .position(|(h, p, _)| h == host && p == port)
                    .and_then(|j| current.breakers.get(j).cloned())
                    .unwrap_or_else(|| {
                        Arc::new(Breaker::new(self.inner.breaker, format!("{host}:{port}")))
                    })
            })
            .collect();
        // Clients of nodes that no longer hold slots are dropped (and closed).
        for (_, client) in existing {
            tokio::spawn(async move {
                let _ = client.quit().await;
            });
        }
        *self
            .inner
            .topology
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Arc::new(Topology {
            slots,
            nodes,
            breakers,
        });
        Ok(())
    }
}

/// Parses `CLUSTER SLOTS`: `[[start, end, [host, port, id, ...], replicas...], ...]`.
fn parse_slots(value: &Value, asked_host: &str) -> Result<Vec<SlotRange>, SlotsError> {
    let Value::Array(entries) = value else {
        return Err(SlotsError::NotAnArray);
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(fields) = entry else {
            return Err(SlotsError::Entry);
        };
        let num = |v: Option<&Value>| {
            v.and_then(Value::as_i64)
                .and_then(|n| u16::try_from(n).ok())
        };
        let (Some(start), Some(end)) = (num(fields.first()), num(fields.get(1))) else {
            return Err(SlotsError::Range);
        };
        let Some(Value::Array(master)) = fields.get(2) else {
            return Err(SlotsError::NoMaster);
        };
        let host = master
            .first()
            .and_then(|v| v.as_string())
            .filter(|h| !h.is_empty() && h != "?")
            .unwrap_or_else(|| asked_host.to_owned());
        let Some(port) = num(master.get(1)) else {
            return Err(SlotsError::NoPort);
        };
        ranges.push(SlotRange {
            start,
            end,
            host,
            port,
        });
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_map_is_read_into_ranges_and_a_bad_one_says_what_is_wrong() {
        let node = |host: &str, port: i64| Value::Array(vec![Value::from(host), Value::from(port)]);
        let map = Value::Array(vec![
            Value::Array(vec![
                Value::from(0),
                Value::from(8191),
                node("10.0.0.1", 7000),
            ]),
            // A master that does not know its own address: the node asked.
            Value::Array(vec![Value::from(8192), Value::from(16383), node("?", 7001)]),
        ]);
        let ranges = parse_slots(&map, "10.0.0.9").unwrap();
        let got: Vec<_> = ranges
            .iter()
            .map(|r| (r.start, r.end, r.host.as_str(), r.port))
            .collect();
        assert_eq!(
            got,
            [(0, 8191, "10.0.0.1", 7000), (8192, 16383, "10.0.0.9", 7001)]
        );
        let bad = |v: Value| parse_slots(&v, "h").err().map(|e| e.to_string());
        assert_eq!(
            bad(Value::from("x")).as_deref(),
            Some("CLUSTER SLOTS did not answer an array")
        );
        let no_port = Value::Array(vec![Value::Array(vec![
            Value::from(0),
            Value::from(1),
            Value::Array(vec![Value::from("h")]),
        ])]);
        assert_eq!(bad(no_port).as_deref(), Some("master without a port"));
        let asked = TopologyError::Asked("h".into(), 7000, SlotsError::TimedOut);
        assert_eq!(asked.to_string(), "h:7000: CLUSTER SLOTS timed out");
    }
}
