//! Several instances of one region on one region store (`docs/regions.md`, "Several instances
//! in a region"), against real `redis-server`s: an instance that cannot use the floor yet
//! leaves the bucket of one that can as it is, and with 1, 2 and 3 instances in a region the
//! union of what every region admits stays in the limit's envelope while the global store is
//! killed, hung or cut off, and when the region's own store restarts empty.

use super::shares::{allowed, limits, prefix};
use super::*;
use crate::backend::redis::regions::RegionalSettings;
use crate::time::ManualClock;
use std::sync::Arc;

use crate::{BucketKey, Id, Limiter};

const T0: u64 = 1_700_000_000_000_000;

/// An instance of region `eu` whose store is `url` under `prefix`, its global store `global`
/// under `<prefix>g:`, on `clock` (caller time) when given, else on the stores' clocks.
async fn instance(
    url: &str,
    global: &str,
    prefix: &str,
    clock: Option<&ManualClock>,
    settings: RegionalSettings,
) -> RedisBackend {
    let global = RedisBackend::from_url(global)
        .prefix(format!("{prefix}g:"))
        .connect()
        .await
        .unwrap();
    let mut builder = RedisBackend::from_url(url).prefix(prefix).deny_cache(false);
    if let Some(clock) = clock {
        builder = builder.caller_time(clock.clone());
    }
    builder
        .regional_with("eu", global, settings)
        .connect()
        .await
        .unwrap()
}

/// Two instances of a region on one store at a deployment's start: one already decides on its
/// floor (10 at once, 10 a second), the other is still closed (its registration not yet
/// confirmed where it looks). The closed one's refusals leave the bucket as the other keeps
/// it: drained stays drained, and the floor refills at its rate only. Before, each wrote the
/// bucket under its own limit: the closed one's write removed the record, which the other
/// then read as a bucket full under its floor: 10 more at every turn (measured with two
/// `axum_redis` in a region: one admitted all 140 of its requests in 0.35 s).
#[tokio::test]
async fn a_closed_instance_leaves_the_bucket_of_one_on_its_floor() {
    let server = redis();
    let prefix = prefix("closed-beside-open");
    let clock = ManualClock::new(T0);
    let hour = RegionalSettings {
        period_us: 3_600_000_000,
        ..RegionalSettings::default()
    };
    let open = instance(&server.url, &server.url, &prefix, Some(&clock), hour).await;
    open.regional_mode().unwrap().confirm_for_tests();
    let closed = instance(&server.url, &server.url, &prefix, Some(&clock), hour).await;
    assert!(open.floors() && !closed.floors());
    let (a, b) = (Limiter::new(limits(), open), Limiter::new(limits(), closed));
    let key = a.key("Api", Id::from(7u64)).unwrap();
    assert_eq!(allowed(&a, &key, 12).await, 10, "the floor's burst");
    for turn in 0..5 {
        assert_eq!(allowed(&b, &key, 3).await, 0, "closed: turn {turn}");
        assert_eq!(allowed(&a, &key, 3).await, 0, "still drained: turn {turn}");
    }
    clock.advance(Duration::from_millis(500));
    assert_eq!(allowed(&b, &key, 3).await, 0);
    assert_eq!(
        allowed(&a, &key, 12).await,
        5,
        "half a second of the floor's rate"
    );
}

/// A TCP proxy to a server, which can be cut: its connections dropped and every new one
/// closed at once (a region cut off from the global store while the others reach it).
struct Proxy {
    url: String,
    cut: Arc<std::sync::atomic::AtomicBool>,
    links: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Proxy {
    async fn to(upstream: &str) -> Proxy {
        let upstream = upstream.trim_start_matches("redis://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let links = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c, l) = (Arc::clone(&cut), Arc::clone(&links));
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if c.load(std::sync::atomic::Ordering::Acquire) {
                    continue;
                }
                let upstream = upstream.clone();
                let link = tokio::spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
                l.lock().unwrap().push(link.abort_handle());
            }
        });
        Proxy { url, cut, links }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Release);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
}

/// What happens in a run of [`the_union_stays_in_the_envelope`].
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// The global store killed, not restarted.
    Killed,
    /// The global store stopped (`SIGSTOP`): every call to it hangs.
    Hung,
    /// `eu` cut off from the global store; `us` still reaches it.
    EuCutOff,
    /// `eu`'s own store restarted empty (on the same port).
    EuStoreRestarted,
}

/// 20 a second, burst 20, marked with a floor of 10%: 2 a second and 2 at once a region.
fn twenty() -> crate::config::Limits {
    let limit = crate::algo::gcra::Limit::from_micros(20, 20, 1_000_000).unwrap();
    crate::config::Limits::builder()
        .limit("Api", limit)
        .across_regions("Api", crate::config::RegionFloor::default())
        .build()
        .unwrap()
}

/// A limiter's admitted requests of `key`, each as when it was sent and answered.
async fn admit(
    limiter: &Limiter,
    key: &BucketKey,
    log: &mut Vec<(std::time::Instant, std::time::Instant)>,
) -> bool {
    let sent = std::time::Instant::now();
    let tx = crate::limiter::Transaction::new(key.clone());
    // An error (the region's store restarting) admits nothing: no failure policy here.
    let allowed = limiter.spend(&[tx]).await.is_ok_and(|d| d.allowed());
    if allowed {
        log.push((sent, std::time::Instant::now()));
    }
    allowed
}

/// The most requests of `log` inside one window less the envelope of `burst` and `rate` a
/// second over it (a request counts in a window when it was sent and answered inside it),
/// with the window: at most 0 when every window holds.
fn worst_window(
    log: &[(std::time::Instant, std::time::Instant)],
    burst: f64,
    rate: f64,
) -> (f64, usize, f64) {
    let mut worst = (f64::MIN, 0, 0.0);
    for &(start, _) in log {
        for &(_, end) in log.iter().filter(|(_, e)| *e >= start) {
            let inside = log.iter().filter(|(s, e)| *s >= start && *e <= end).count();
            let seconds = (end - start).as_secs_f64();
            let over = inside as f64 - (burst + rate * seconds);
            if over > worst.0 {
                worst = (over, inside, seconds);
            }
        }
    }
    worst
}

/// The servers and instances of a run: `eu`'s instances first, then `us`'s one.
struct Regions {
    global: Option<Server>,
    eu_store: Option<Server>,
    eu_port: u16,
    _us_store: Server,
    proxy: Proxy,
    eu: Vec<RedisBackend>,
    us: RedisBackend,
    limiters: Vec<Limiter>,
}

/// Regions `eu` (`n` instances on its own store) and `us` (one, on another), their global
/// store reached by `eu` through a proxy, on the stores' clocks (periods of 50 ms, leases of
/// 150 ms, margins of 50 ms), every instance's floor confirmed.
async fn regions(n: usize, label: &str) -> Regions {
    let regions = deployed(n, label).await;
    let all: Vec<&RedisBackend> = regions.backends().collect();
    for _ in 0..500 {
        if all.iter().all(|b| b.floors()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(all.iter().all(|b| b.floors()), "all confirmed");
    regions
}

/// The regions of [`regions`] as deployed: every instance just started, none confirmed yet.
async fn deployed(n: usize, label: &str) -> Regions {
    let global = own_redis(free_port());
    let eu_port = free_port();
    let eu_store = own_redis(eu_port);
    let us_store = redis();
    let proxy = Proxy::to(&global.url).await;
    let prefix = prefix(label);
    let settings = RegionalSettings {
        period_us: 50_000,
        lease_us: 150_000,
        margin_us: 50_000,
        max_keys: 100,
    };
    let region = |name: &'static str, store: &str, global: &str| {
        let (store, global) = (store.to_owned(), global.to_owned());
        // One global store under one prefix for every region (a region's own under its name).
        let global_prefix = format!("{prefix}g:");
        let prefix = format!("{prefix}{name}:");
        async move {
            let global = RedisBackend::from_url(&global)
                .prefix(global_prefix)
                .connect()
                .await
                .unwrap();
            // The deny cache on, as deployed (it never answers for a marked key).
            RedisBackend::from_url(&store)
                .prefix(prefix)
                .regional_with(name, global, settings)
                .connect()
                .await
                .unwrap()
        }
    };
    let mut eu = Vec::new();
    for _ in 0..n {
        eu.push(region("eu", &eu_store.url, &proxy.url).await);
    }
    let us = region("us", &us_store.url, &global.url).await;
    let all: Vec<RedisBackend> = eu.iter().cloned().chain([us]).collect();
    // The limits registered first: a region registers the floors of the limits it decides.
    let limiters: Vec<Limiter> = all
        .iter()
        .map(|b| Limiter::new(twenty(), b.clone()))
        .collect();
    Regions {
        us: all[n].clone(),
        global: Some(global),
        eu_store: Some(eu_store),
        eu_port,
        _us_store: us_store,
        proxy,
        eu,
        limiters,
    }
}

impl Regions {
    /// Every instance's backend, `eu`'s then `us`'s.
    fn backends(&self) -> impl Iterator<Item = &RedisBackend> {
        self.eu.iter().chain([&self.us])
    }

    /// Brings `fault` about.
    fn fault(&mut self, fault: Fault) {
        let signal = |server: &Server, sig: &str| {
            let pid = server.child.as_ref().unwrap().id().to_string();
            std::process::Command::new("kill")
                .args([sig, &pid])
                .status()
                .unwrap();
        };
        match fault {
            Fault::Killed => self.global = None,
            Fault::Hung => signal(self.global.as_ref().unwrap(), "-STOP"),
            Fault::EuCutOff => self.proxy.cut(),
            Fault::EuStoreRestarted => {
                self.eu_store = None;
                self.eu_store = Some(own_redis(self.eu_port));
            }
        }
    }

    /// Ends `fault` where it would outlive the test (a stopped server).
    fn mend(&self, fault: Fault) {
        if let (Fault::Hung, Some(global)) = (fault, &self.global) {
            let pid = global.child.as_ref().unwrap().id().to_string();
            std::process::Command::new("kill")
                .args(["-CONT", &pid])
                .status()
                .unwrap();
        }
    }
}

/// Regions `eu` (`n` instances on one store) and `us` (one), one key of 20 a second asked on
/// every instance: `eu` first alone for half a second (it is granted a part), then `fault`,
/// then every instance at once for 1.5 s. What the instances admit together stays in the
/// limit's envelope in every window; `eu`'s instances keep their floors (confirmed, never
/// closed), and serve requests on the floor once the part has lapsed. Before, the
/// confirmation the instance that rebalances writes for the others expired with the global
/// store's answers, so the other `eu` instances went closed, and their writes refilled the
/// first one's bucket over and over (measured with two `axum_redis` in `eu`: 369 a second
/// against a worldwide 20).
async fn the_union_stays_in_the_envelope(fault: Fault, n: usize) {
    let mut regions = regions(n, &format!("{fault:?}{n}")).await;
    let key = regions.limiters[0].key("Api", Id::from(9u64)).unwrap();
    let mut log = Vec::new();
    let alone = std::time::Instant::now();
    while alone.elapsed() < Duration::from_millis(500) {
        for limiter in &regions.limiters[..n] {
            admit(limiter, &key, &mut log).await;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    regions.fault(fault);
    let fault_at = std::time::Instant::now();
    let mut eu_after_lapse = 0;
    while fault_at.elapsed() < Duration::from_millis(1_500) {
        for (i, limiter) in regions.limiters.iter().enumerate() {
            let lapsed = fault_at.elapsed() > Duration::from_millis(400);
            if admit(limiter, &key, &mut log).await && i < n && lapsed {
                eu_after_lapse += 1;
            }
        }
    }
    regions.mend(fault);
    let (over, inside, seconds) = worst_window(&log, 20.0, 20.0);
    eprintln!(
        "{fault:?}, {n} in eu: {} admitted, the worst window {inside} in {seconds:.3} s \
         ({over:.1} from the envelope), eu {eu_after_lapse} once its part lapsed",
        log.len()
    );
    assert!(
        over <= 0.0,
        "{fault:?}, {n} in eu: {inside} admitted in {seconds:.3} s, {over:.1} above the envelope"
    );
    assert!(
        regions.eu.iter().all(RedisBackend::floors),
        "{fault:?}, {n} in eu: eu kept its floors"
    );
    if !matches!(fault, Fault::EuStoreRestarted) {
        assert!(
            eu_after_lapse >= 1,
            "{fault:?}, {n} in eu: eu served its floor: {eu_after_lapse}"
        );
    }
}

#[tokio::test]
async fn the_global_store_killed_keeps_every_region_in_the_envelope() {
    for n in 1..=3 {
        the_union_stays_in_the_envelope(Fault::Killed, n).await;
    }
}

#[tokio::test]
async fn the_global_store_hung_keeps_every_region_in_the_envelope() {
    for n in 1..=3 {
        the_union_stays_in_the_envelope(Fault::Hung, n).await;
    }
}

#[tokio::test]
async fn a_region_cut_off_from_the_global_store_keeps_the_union_in_the_envelope() {
    for n in 1..=3 {
        the_union_stays_in_the_envelope(Fault::EuCutOff, n).await;
    }
}

#[tokio::test]
async fn a_region_store_restarted_empty_keeps_the_union_in_the_envelope() {
    for n in 1..=3 {
        the_union_stays_in_the_envelope(Fault::EuStoreRestarted, n).await;
    }
}

/// The first seconds of a deployment: every instance of `eu` (1, 2 or 3) and `us` asked from
/// the moment it starts, before any knows its registration confirmed. What they admit together
/// stays in the limit's envelope in every window; each region is on its floor within 2 s
/// (confirmed one lease and the margin after it registers: 200 ms here) and `eu` serves
/// requests. Before, an instance still closed wrote the bucket of one already on its floor: two
/// `axum_redis` in a region admitted 138 in 0.35 s where 27 were allowed.
#[tokio::test]
async fn a_deployment_s_first_seconds_keep_the_union_in_the_envelope() {
    for n in 1..=3 {
        let regions = deployed(n, &format!("deployed{n}")).await;
        let key = regions.limiters[0].key("Api", Id::from(9u64)).unwrap();
        let mut log = Vec::new();
        let mut eu_admitted = 0;
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_millis(2_000) {
            for (i, limiter) in regions.limiters.iter().enumerate() {
                if admit(limiter, &key, &mut log).await && i < n {
                    eu_admitted += 1;
                }
            }
        }
        let (over, inside, seconds) = worst_window(&log, 20.0, 20.0);
        eprintln!(
            "deployment, {n} in eu: {} admitted ({eu_admitted} in eu), the worst window \
             {inside} in {seconds:.3} s ({over:.1} from the envelope)",
            log.len()
        );
        assert!(
            over <= 0.0,
            "deployment, {n} in eu: {inside} admitted in {seconds:.3} s, {over:.1} above"
        );
        assert!(
            regions.backends().all(RedisBackend::floors),
            "{n}: all on their floors"
        );
        assert!(eu_admitted >= 1, "{n}: eu served requests");
    }
}

/// Two instances of a region deciding a key under different floors (a rolling deploy that
/// changes `region_floor`: 20% on one, 10% on the other): what one leaves is read by the other
/// capped at its own burst, never refilled. Before, the instance of the smaller floor removed a
/// bucket it read as full under its floor (10 of the other's 20 left), and the other then
/// read no record: full under its floor, 10 more each time.
#[tokio::test]
async fn instances_on_different_floors_never_refill_each_other() {
    let server = redis();
    let prefix = prefix("two-floors");
    let clock = ManualClock::new(T0);
    let hour = RegionalSettings {
        period_us: 3_600_000_000,
        ..RegionalSettings::default()
    };
    let new = instance(&server.url, &server.url, &prefix, Some(&clock), hour).await;
    let old = instance(&server.url, &server.url, &prefix, Some(&clock), hour).await;
    new.regional_mode().unwrap().confirm_for_tests();
    old.regional_mode().unwrap().confirm_for_tests();
    let limit = crate::algo::gcra::Limit::from_micros(100, 100, 1_000_000).unwrap();
    let twenty = crate::config::Limits::builder()
        .limit("Api", limit)
        .across_regions(
            "Api",
            crate::config::RegionFloor::from_basis_points(2_000).unwrap(),
        )
        .build()
        .unwrap();
    let (a, b) = (Limiter::new(twenty, new), Limiter::new(limits(), old));
    let key = a.key("Api", Id::from(3u64)).unwrap();
    assert_eq!(allowed(&a, &key, 10).await, 10, "10 of the 20");
    for turn in 0..3 {
        // More than the smaller floor's burst: refused, the bucket read and written back.
        let too_much = crate::limiter::Transaction::new(key.clone()).cost(11);
        assert!(!b.spend(&[too_much]).await.unwrap().allowed());
        assert_eq!(
            allowed(&a, &key, 20).await,
            if turn == 0 { 10 } else { 0 },
            "turn {turn}: what was left, then nothing"
        );
    }
}

/// The global store loses its registry while `eu`'s lock passes to an instance that never held
/// it (it never read the registry): that instance makes the registry again with every region
/// the region's earlier holder saw, which it reads from the region's store, each at its time.
/// Before, it made it again from its own view, empty: `us`, cut off from the global store and
/// on its floor, was left out, and its floor went to the others' parts once the quiet period
/// ended (the overshoot `regions::model` finds with that rule); `eu`, registered again from
/// then, lost its own floor for a lease and the margin.
#[tokio::test]
async fn a_lost_registry_is_made_again_with_every_region_an_earlier_holder_saw() {
    use crate::backend::regions::global::RegistryRecord;
    use fred::prelude::KeysInterface;
    let server = redis();
    let prefix = prefix("registry-made-again");
    let settings = RegionalSettings::default();
    let first = super::shares::region(&server.url, &prefix, "eu", settings).await;
    let us = super::shares::region(&server.url, &prefix, "us", settings).await;
    let later = super::shares::region(&server.url, &prefix, "eu", settings).await;
    let registry_key = format!("{prefix}g:{{regions}}");
    let client = first.client();
    let read = || async {
        let text: String = client.get(&registry_key).await.unwrap();
        RegistryRecord::parse(&text).unwrap()
    };
    let (eu, later_eu) = (
        first.regional_mode().unwrap(),
        later.regional_mode().unwrap(),
    );
    eu.register(1_000).await.unwrap();
    us.regional_mode().unwrap().register(1_000).await.unwrap();
    // `first` holds the lock: it registers again (reading `us`) and keeps what it read.
    eu.register(1_000).await.unwrap();
    first.keep_registration(eu, &client).await.unwrap();
    let before = read().await;
    assert!(before.registered_at("us").is_some());
    // The global store's records are lost; the lock passes to `later`.
    let _: i64 = client.del(&registry_key).await.unwrap();
    later
        .merge_kept_registry(later_eu, &later.client())
        .await
        .unwrap();
    later_eu.register(1_000).await.unwrap();
    let made = read().await;
    assert_ne!(made.epoch, before.epoch, "made again");
    assert_eq!(made.registered_at("us"), before.registered_at("us"));
    assert_eq!(made.registered_at("eu"), before.registered_at("eu"));
}
