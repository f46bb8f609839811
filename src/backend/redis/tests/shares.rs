//! A region's share buckets in the script (`docs/regions.md`), against a real `redis-server`:
//! the floor alone before any grant, a grant's part arriving empty and leaving with its lease,
//! the script's reading of a stored record held to the Rust rule it mirrors
//! (`RegionKey::bucket`, `RegionKey::changed_at`, `gcra::keep_tokens`, `gcra::check`) over many
//! random records, and the rebalancer's calls on the region's store.

use super::*;
use crate::algo::gcra::Limit;
use crate::algo::regions::Share;
use crate::backend::redis::regions::RegionalSettings;
use crate::backend::regions::cases::{Rng, ShareCase};
use crate::time::ManualClock;
use crate::{Id, Limiter, Limits, RegionFloor, Transaction};

const SECOND: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * SECOND;

/// 100 a second, burst 100, marked with a floor of 10%: 10 a second and 10 at once.
pub(super) fn limits() -> Limits {
    let limit = Limit::from_micros(100, 100, SECOND).unwrap();
    Limits::builder()
        .limit("Api", limit)
        .across_regions("Api", RegionFloor::default())
        .limit("Other", limit)
        .build()
        .unwrap()
}

async fn backend(url: &str, prefix: &str, clock: &ManualClock, shares: bool) -> RedisBackend {
    let builder = RedisBackend::from_url(url)
        .prefix(prefix)
        .deny_cache(false)
        .caller_time(clock.clone());
    if !shares {
        return builder.connect().await.unwrap();
    }
    let global = RedisBackend::from_url(url)
        .prefix(format!("{prefix}g:"))
        .connect()
        .await
        .unwrap();
    // No rebalance within a test: the share buckets alone.
    let settings = RegionalSettings {
        period_us: 3_600_000_000,
        ..RegionalSettings::default()
    };
    let backend = builder
        .regional_with("eu", global, settings)
        .connect()
        .await
        .unwrap();
    backend.regional_mode().unwrap().confirm_for_tests();
    backend
}

/// Region `name`'s backend on the real clocks of `url`'s server (its store under
/// `<prefix><name>:`, the global store under `<prefix>g:`), moving shares by `settings`.
pub(super) async fn region(
    url: &str,
    prefix: &str,
    name: &str,
    settings: RegionalSettings,
) -> RedisBackend {
    let global = RedisBackend::from_url(url)
        .prefix(format!("{prefix}g:"))
        .connect()
        .await
        .unwrap();
    RedisBackend::from_url(url)
        .prefix(format!("{prefix}{name}:"))
        .deny_cache(false)
        .regional_with(name, global, settings)
        .connect()
        .await
        .unwrap()
}

pub(super) fn prefix(test: &str) -> String {
    format!("t:shares:{test}:{}:{}:", std::process::id(), T0)
}

/// How many of `n` single requests of `key` are allowed, one after another.
pub(super) async fn allowed(limiter: &Limiter, key: &BucketKey, n: usize) -> usize {
    let mut count = 0;
    for _ in 0..n {
        let tx = Transaction::new(key.clone());
        count += usize::from(limiter.spend(&[tx]).await.unwrap().allowed());
    }
    count
}

/// Writes a share bucket's record as the script keeps it.
async fn write_record(backend: &RedisBackend, key: &str, fields: [u64; 9]) {
    use fred::prelude::KeysInterface;
    let text = std::iter::once("1".to_owned())
        .chain(fields.iter().map(u64::to_string))
        .collect::<Vec<_>>()
        .join(" ");
    let () = backend
        .client()
        .set(key, text, None, None, false)
        .await
        .unwrap();
}

async fn read_record(backend: &RedisBackend, key: &str) -> Option<String> {
    use fred::prelude::KeysInterface;
    backend.client().get(key).await.unwrap()
}

/// Before any grant a marked limit decides on the region's floor alone (10 of 100), in its
/// own key (`:r`), apart from an unmarked limit of the same numbers; an instance not in
/// regional mode decides the same name as a limit per region, in the plain key, and neither
/// reads the other's state.
#[tokio::test]
async fn a_marked_limit_decides_on_its_floor_until_a_grant() {
    let server = redis();
    let clock = ManualClock::new(T0);
    let prefix = prefix("floor");
    let regional = backend(&server.url, &prefix, &clock, true).await;
    let limiter = Limiter::new(limits(), regional.clone());
    let key = limiter.key("Api", Id::from(7u64)).unwrap();
    assert_eq!(
        allowed(&limiter, &key, 20).await,
        10,
        "the floor: 10 at once"
    );
    let denied = limiter
        .spend(&[Transaction::new(key.clone())])
        .await
        .unwrap();
    assert_eq!(
        denied.strictest().unwrap().retry_after(),
        Duration::from_millis(100),
        "refilled at the floor's rate, 10 a second"
    );
    let other = limiter.key("Other", Id::from(7u64)).unwrap();
    assert_eq!(allowed(&limiter, &other, 120).await, 100);
    let record = read_record(&regional, &format!("{}:r", regional.redis_key(&key))).await;
    let record = record.expect("the share bucket's record");
    assert!(
        record == format!("1 {} 100000 10 {T0} 0 0 0 0 0", T0 + SECOND),
        "{record}"
    );
    // Not in regional mode: the whole limit, in the plain key.
    let per_region = Limiter::new(limits(), backend(&server.url, &prefix, &clock, false).await);
    assert_eq!(allowed(&per_region, &key, 120).await, 100);
    // And the share bucket did not move.
    clock.advance(Duration::from_millis(100));
    assert_eq!(allowed(&limiter, &key, 5).await, 1);
}

/// A refund on a share bucket gives back units of the share's limit in force (the floor's 10
/// a second), as memory's (`regions/memory/tests.rs`): the unit refunded is spent again, once.
#[tokio::test]
async fn a_refund_on_a_share_bucket_gives_back_units_of_the_share() {
    let server = redis();
    let clock = ManualClock::new(T0);
    let prefix = prefix("refund");
    let regional = backend(&server.url, &prefix, &clock, true).await;
    let limiter = Limiter::new(limits(), regional.clone());
    let key = limiter.key("Api", Id::from(7u64)).unwrap();
    assert_eq!(allowed(&limiter, &key, 11).await, 10, "the floor's burst");
    limiter
        .refund(&[Transaction::new(key.clone()).cost(1)])
        .await
        .unwrap();
    assert_eq!(
        allowed(&limiter, &key, 2).await,
        1,
        "the unit refunded, once"
    );
}

/// A grant of 40 more (rate and burst) while its lease runs: the bucket's limit is 50 a
/// second, but the part's burst arrives empty (10 tokens kept, not 50); it refills at 50 a
/// second; when the lease ends the bucket goes back to the floor keeping at most 10 tokens,
/// refilling at 10 a second.
#[tokio::test]
async fn a_grants_part_arrives_empty_and_leaves_with_its_lease() {
    let server = redis();
    let clock = ManualClock::new(T0);
    let prefix = prefix("grant");
    let regional = backend(&server.url, &prefix, &clock, true).await;
    let limiter = Limiter::new(limits(), regional.clone());
    let key = limiter.key("Api", Id::from(9u64)).unwrap();
    let record = format!("{}:r", regional.redis_key(&key));
    let lease_end = T0 + 5 * SECOND;
    write_record(
        &regional,
        &record,
        [0, 100_000, 10, T0, 40, 40, 3, lease_end, 3],
    )
    .await;
    assert_eq!(
        allowed(&limiter, &key, 60).await,
        10,
        "the part arrives empty"
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        allowed(&limiter, &key, 60).await,
        50,
        "refilled at 50 a second"
    );
    let kept = read_record(&regional, &record).await.unwrap();
    assert!(kept.ends_with(&format!(" 40 40 3 {lease_end} 3")), "{kept}");
    clock.set(lease_end + 10 * SECOND);
    assert_eq!(allowed(&limiter, &key, 60).await, 10, "back to the floor");
    clock.advance(Duration::from_millis(500));
    assert_eq!(allowed(&limiter, &key, 60).await, 5, "at the floor's rate");
}

/// A floor of 0% and no part: the key is closed in this region (every cost denied); a value
/// that is not a record of ours is read as no part and a drained bucket, and replaced.
#[tokio::test]
async fn no_share_is_closed_and_a_foreign_record_is_drained() {
    let server = redis();
    let clock = ManualClock::new(T0);
    let prefix = prefix("closed");
    let regional = backend(&server.url, &prefix, &clock, true).await;
    let limit = Limit::from_micros(100, 100, SECOND).unwrap();
    let closed = Limits::builder()
        .limit("Api", limit)
        .across_regions("Api", RegionFloor::from_basis_points(0).unwrap())
        .build()
        .unwrap();
    let limiter = Limiter::new(closed, regional.clone());
    let key = limiter.key("Api", Id::from(1u64)).unwrap();
    assert_eq!(allowed(&limiter, &key, 3).await, 0);
    let limiter = Limiter::new(limits(), regional.clone());
    let key = limiter.key("Api", Id::from(2u64)).unwrap();
    let record = format!("{}:r", regional.redis_key(&key));
    write_record(&regional, &record, [0, 0, 0, T0, 90, 90, 1, T0 + SECOND, 1]).await;
    assert_eq!(allowed(&limiter, &key, 3).await, 0, "drained");
    let replaced = read_record(&regional, &record).await.unwrap();
    assert!(
        replaced == format!("1 {} 100000 10 {T0} 0 0 0 0 0", T0 + SECOND),
        "{replaced}"
    );
    clock.advance(Duration::from_millis(300));
    assert_eq!(allowed(&limiter, &key, 5).await, 3);
}

/// The script reads a stored record as the Rust rule does: for random floors, parts, leases,
/// limits written under and TATs, one spend's outcome and the TAT it leaves are those of
/// `RegionKey::bucket`, then `gcra::keep_tokens` when the limit changed, then `gcra::check`
/// (`regions/cases.rs`, the memory backend's share buckets held to the same cases).
#[tokio::test]
async fn the_script_reads_a_share_bucket_as_the_rust_rule() {
    let server = redis();
    let clock = ManualClock::new(T0);
    let prefix = prefix("rule");
    let regional = backend(&server.url, &prefix, &clock, true).await;
    let period = SECOND;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut seen = [0u32; 5];
    for case in 0..1_000u64 {
        let c = ShareCase::random(&mut rng, period, T0);
        let id = Id::from(case);
        let key = BucketKey::new(limits().name("Api").unwrap(), id);
        let record = format!("{}:r", regional.redis_key(&key));
        write_record(
            &regional,
            &record,
            [
                c.tat,
                c.written.emission_interval_us(),
                c.written.burst(),
                c.written_at,
                c.region.share.rate,
                c.region.share.burst,
                1,
                c.region.lease_end,
                1,
            ],
        )
        .await;
        let quota = Quota::Gcra(c.limit);
        let tx = BucketTx::new(
            &key,
            &quota,
            c.cost..=c.cost,
            crate::backend::Mode::CheckAndSpend,
        )
        .unwrap()
        .across_regions(Some(c.floor));
        let got = regional.spend(&[tx]).outcomes().await.unwrap()[0];
        let after = read_record(&regional, &record).await;
        let stored_tat = after
            .as_deref()
            .and_then(|r| r.split(' ').nth(1))
            .map_or(0, |t| t.parse::<u64>().unwrap());
        c.check(
            period,
            T0,
            &got,
            stored_tat,
            &mut seen,
            &format!("case {case}: {c:?}"),
        );
    }
    assert!(seen.iter().all(|&n| n >= 10), "cases by kind: {seen:?}");
}

/// The in-memory fallback of a regional limiter knows no share: it denies a marked limit
/// (fail-closed, retry in a second) and decides the others; the fallback of a limiter not in
/// regional mode decides a marked limit as a limit per region, as its limiter does.
#[tokio::test]
async fn the_fallback_of_a_regional_limiter_denies_a_marked_limit() {
    let fallback = Limiter::fallback(limits(), None, true).0;
    let marked = fallback.key("Api", Id::from(1u64)).unwrap();
    let denied = fallback
        .spend(&[Transaction::new(marked.clone())])
        .await
        .unwrap();
    assert!(!denied.allowed());
    assert_eq!(
        denied.strictest().unwrap().retry_after(),
        Duration::from_secs(1)
    );
    let other = fallback.key("Other", Id::from(1u64)).unwrap();
    assert_eq!(allowed(&fallback, &other, 3).await, 3);
    let per_region = Limiter::fallback(limits(), None, false).0;
    assert_eq!(allowed(&per_region, &marked, 3).await, 3);
}

/// The rebalancer's calls on a region's store: a request is numbered after the last one and
/// at least the store's now (`RegionKey::request`), and names the grant applied; a grant is
/// applied once, only for a request later than the applied one's (`RegionKey::on_grant`),
/// and the bucket keeps its tokens from the moment it is applied: 5 left of the floor's 10
/// stay 5 under 50 a second, which then refill at 50 a second.
#[tokio::test]
async fn requests_are_numbered_and_grants_applied_once() {
    let server = redis();
    let clock = ManualClock::new(T0);
    let prefix = prefix("rebalance");
    let regional = backend(&server.url, &prefix, &clock, true).await;
    let limits = limits();
    let limiter = Limiter::new(limits.clone(), regional.clone());
    let key = limiter.key("Api", Id::from(3u64)).unwrap();
    assert_eq!(allowed(&limiter, &key, 5).await, 5);
    let quota = limits.resolve(&key).unwrap().clone();
    let tx = BucketTx::new(&key, &quota, 0..=0, crate::backend::Mode::Observe)
        .unwrap()
        .across_regions(Some(RegionFloor::default()));
    let first = regional.share_requests(&[tx]).await.unwrap()[0];
    assert_eq!((first.seq, first.applied, first.sent_at), (T0, 0, T0));
    assert_eq!(first.part, Share::ZERO);
    let second = regional.share_requests(&[tx]).await.unwrap()[0];
    assert_eq!((second.seq, second.applied), (T0 + 1, 0));
    let grant = |seq| script::ShareGrant {
        seq,
        share: Share {
            rate: 40,
            burst: 40,
        },
        lease_end: T0 + 5 * SECOND,
    };
    assert_eq!(
        regional
            .share_grants(&[tx], &[grant(T0 + 1)])
            .await
            .unwrap(),
        [true]
    );
    assert_eq!(
        regional
            .share_grants(&[tx], &[grant(T0 + 1)])
            .await
            .unwrap(),
        [false],
        "repeated"
    );
    assert_eq!(
        regional.share_grants(&[tx], &[grant(T0)]).await.unwrap(),
        [false],
        "late"
    );
    let third = regional.share_requests(&[tx]).await.unwrap()[0];
    assert_eq!((third.seq, third.applied), (T0 + 2, T0 + 1));
    assert_eq!(
        third.part,
        Share {
            rate: 40,
            burst: 40
        },
        "the part in use"
    );
    assert_eq!(allowed(&limiter, &key, 60).await, 5, "the tokens kept");
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        allowed(&limiter, &key, 60).await,
        50,
        "refilled at 50 a second"
    );
    // A store that lost the record numbers on from its clock.
    clock.advance(Duration::from_secs(10));
    let record = format!("{}:r", regional.redis_key(&key));
    use fred::prelude::KeysInterface;
    let _: i64 = regional.client().del(&record).await.unwrap();
    let after_loss = regional.share_requests(&[tx]).await.unwrap()[0];
    assert_eq!((after_loss.seq, after_loss.applied), (T0 + 11 * SECOND, 0));
}

/// A region's share bucket record's part: `(rate, burst)` of the part it applies.
async fn part_of(backend: &RedisBackend, key: &BucketKey) -> (u64, u64) {
    let record = read_record(backend, &format!("{}:r", backend.redis_key(key))).await;
    let fields: Vec<u64> = record
        .as_deref()
        .unwrap_or("1 0 0 0 0 0 0 0 0 0")
        .split(' ')
        .map(|f| f.parse().unwrap())
        .collect();
    (fields[5], fields[6])
}

/// Two regions (their own stores, one global store, all on real Redis clocks; leases of 3 s):
/// each registers, and decides on its floor only once its registration is confirmed. Demand in
/// one region moves the movable part (the limit less both floors: 80) there, through the
/// global store, and a shift of demand moves it to the other region in three rebalances
/// (the giver is granted nothing, confirms it, then the taker gets it), the parts never
/// summing above 80 at any step.
#[tokio::test]
async fn shares_move_to_the_demand_through_the_global_store() {
    let server = redis();
    let prefix = prefix("move");
    // The test rebalances itself: no task's period ends within it. Leases long enough that no
    // grant lapses between two steps of the test, on a busy machine too.
    let settings = RegionalSettings {
        period_us: 3_600_000_000,
        lease_us: 3_000_000,
        margin_us: 500_000,
        max_keys: 100,
    };
    let eu = region(&server.url, &prefix, "eu", settings).await;
    let us = region(&server.url, &prefix, "us", settings).await;
    let limits = limits();
    let key = BucketKey::new(limits.name("Api").unwrap(), Id::from(5u64));
    let eu_limiter = Limiter::new(limits.clone(), eu.clone());
    // Not confirmed yet: closed.
    eu.rebalance(&limits, &[]).await.unwrap();
    us.rebalance(&limits, &[]).await.unwrap();
    assert!(!eu.floors());
    assert_eq!(
        allowed(&eu_limiter, &key, 3).await,
        0,
        "closed until confirmed"
    );
    // Confirmed one lease and the margin (3.5 s of the global store's clock) later.
    for _ in 0..400 {
        if eu.floors() && us.floors() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        eu.rebalance(&limits, &[]).await.unwrap();
        us.rebalance(&limits, &[]).await.unwrap();
    }
    assert!(eu.floors() && us.floors());
    // The floor, full for a key never decided (one refused while closed too: a closed
    // instance writes nothing).
    let fresh = BucketKey::new(limits.name("Api").unwrap(), Id::from(6u64));
    assert_eq!(allowed(&eu_limiter, &fresh, 12).await, 10, "the floor");
    // The global store was new: quiet for one hold after its first call; then eu's demand
    // gets the movable part.
    let mut round = eu.rebalance(&limits, &[(key.clone(), 80)]).await.unwrap();
    for _ in 0..400 {
        if part_of(&eu, &key).await == (80, 80) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        round = eu.rebalance(&limits, &[(key.clone(), 80)]).await.unwrap();
    }
    assert_eq!(part_of(&eu, &key).await, (80, 80), "{round:?}");
    // The part arrived empty, but refills at 90 a second: the first denial says so.
    let mut denied = None;
    for _ in 0..1_000 {
        let d = eu_limiter
            .spend(&[Transaction::new(key.clone())])
            .await
            .unwrap();
        if !d.allowed() {
            denied = Some(d);
            break;
        }
    }
    let denied = denied.expect("a denial");
    assert!(denied.strictest().unwrap().retry_after() <= Duration::from_micros(11_112));
    // The demand moves to us: us first gets nothing (eu holds it all); eu is granted nothing,
    // applies it and confirms it in the same rebalance (a second request naming the grant it
    // applied); us gets it at its next: three rebalances after the shift.
    let sum = |a: (u64, u64), b: (u64, u64)| (a.0 + b.0, a.1 + b.1);
    us.rebalance(&limits, &[(key.clone(), 80)]).await.unwrap();
    assert_eq!(part_of(&us, &key).await, (0, 0));
    let round = eu.rebalance(&limits, &[(key.clone(), 0)]).await.unwrap();
    assert_eq!(part_of(&eu, &key).await, (0, 0));
    assert_eq!(round.asked, 2, "given back, then confirmed: {round:?}");
    assert!(round.asked_next.is_empty(), "{round:?}");
    us.rebalance(&limits, &[(key.clone(), 80)]).await.unwrap();
    assert_eq!(part_of(&us, &key).await, (80, 80));
    let total = sum(part_of(&eu, &key).await, part_of(&us, &key).await);
    assert!(total.0 <= 80 && total.1 <= 80, "{total:?}");
}

/// The rebalancing task, end to end: two regional limiters (their stores and one global store
/// on real Redis clocks, periods of 50 ms) and requests in one region only. The task counts
/// the demand, registers both regions, and moves the movable part to the busy region, which
/// then admits more than its floor a second; the idle one stays on its floor.
#[tokio::test]
async fn the_task_moves_the_share_to_the_region_whose_requests_ask_for_it() {
    let server = redis();
    let prefix = prefix("task");
    let settings = RegionalSettings {
        period_us: 50_000,
        lease_us: 150_000,
        margin_us: 50_000,
        max_keys: 100,
    };
    let eu_backend = region(&server.url, &prefix, "eu", settings).await;
    let us_backend = region(&server.url, &prefix, "us", settings).await;
    let eu = Limiter::new(limits(), eu_backend.clone());
    let _us = Limiter::new(limits(), us_backend.clone());
    let key = eu.key("Api", Id::from(11u64)).unwrap();
    // Requests in eu, about 400 a second (4 times the limit), for at most 5 s of the clock.
    let mut moved = false;
    for _ in 0..250 {
        allowed(&eu, &key, 8).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if part_of(&eu_backend, &key).await.0 > 0 {
            moved = true;
            break;
        }
    }
    assert!(moved, "the busy region was granted a part");
    // Its floor too, once its own registration is confirmed (a part may come first: the
    // global store's quiet period ran from the first region's registration).
    for _ in 0..100 {
        if eu_backend.floors() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(eu_backend.floors(), "registered and confirmed");
    let (eu_part, us_part) = (
        part_of(&eu_backend, &key).await,
        part_of(&us_backend, &key).await,
    );
    assert_eq!(us_part, (0, 0));
    assert!(eu_part.0 <= 80 && eu_part.1 <= 80, "{eu_part:?}");
}

/// Overrides in regional mode: a marked limit's are kept in the global store and in force in
/// every region (set in one, seen and removed in the other); an unmarked limit's stay in the
/// region's store, as without regional mode; a marked limit's override found in a region's
/// store (set there before the limit was marked) is not in force.
#[tokio::test]
async fn overrides_of_a_marked_limit_are_kept_in_the_global_store_for_every_region() {
    use fred::prelude::HashesInterface;
    let server = redis();
    let prefix = prefix("overrides");
    let settings = RegionalSettings {
        period_us: 3_600_000_000,
        ..RegionalSettings::default()
    };
    let eu_backend = region(&server.url, &prefix, "eu", settings).await;
    let us_backend = region(&server.url, &prefix, "us", settings).await;
    let eu = Limiter::new(limits(), eu_backend.clone());
    let us = Limiter::new(limits(), us_backend.clone());
    let vip =
        crate::overrides::OverrideKind::Quota(Limit::from_micros(500, 500, SECOND).unwrap().into());
    eu.set_override("Api", "7", vip.clone(), None)
        .await
        .unwrap();
    eu.set_override("Other", "7", vip, None).await.unwrap();
    let field = |backend: &RedisBackend, prefix: String, f: &'static str| {
        let client = backend.client().clone();
        async move {
            let v: Option<String> = client
                .hget(format!("{prefix}{{overrides}}"), f)
                .await
                .unwrap();
            v.is_some()
        }
    };
    assert!(field(&eu_backend, format!("{prefix}g:"), "Api:7").await);
    assert!(!field(&eu_backend, format!("{prefix}eu:"), "Api:7").await);
    assert!(field(&eu_backend, format!("{prefix}eu:"), "Other:7").await);
    // us follows the global store: the marked limit's override is in force there.
    let api = us.parse_key("Api", "7").unwrap();
    let mut seen = false;
    for _ in 0..250 {
        if us.inspect(&api).await.unwrap().source == crate::config::LimitSource::Store {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen, "us applies the override set in eu");
    let listed: Vec<(String, String)> = us
        .stored_overrides()
        .await
        .unwrap()
        .into_iter()
        .map(|o| (o.limit, o.id))
        .collect();
    assert_eq!(listed, [("Api".to_owned(), "7".to_owned())]);
    let other = us.parse_key("Other", "7").unwrap();
    assert_ne!(
        us.inspect(&other).await.unwrap().source,
        crate::config::LimitSource::Store
    );
    // A marked limit's override in a region's own store (an instance not in regional mode
    // wrote it): not in force in regional mode.
    let plain = RedisBackend::from_url(&server.url)
        .prefix(format!("{prefix}us:"))
        .connect()
        .await
        .unwrap();
    Limiter::new(limits(), plain)
        .set_override("Api", "8", crate::overrides::OverrideKind::Block, None)
        .await
        .unwrap();
    let old = us.parse_key("Api", "8").unwrap();
    us.stored_overrides().await.unwrap();
    assert_ne!(
        us.inspect(&old).await.unwrap().source,
        crate::config::LimitSource::Store
    );
    // Removed in us: gone from the global store, and in eu.
    assert!(us.remove_override("Api", "7").await.unwrap());
    assert!(!field(&eu_backend, format!("{prefix}g:"), "Api:7").await);
    let eu_api = eu.parse_key("Api", "7").unwrap();
    let mut gone = false;
    for _ in 0..250 {
        if eu.inspect(&eu_api).await.unwrap().source != crate::config::LimitSource::Store {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gone, "eu drops the override removed in us");
}

/// A region's store restarted empty does not hand a share bucket's floor out again: a key it
/// holds no record of is empty at the store's start (read again at the reconnection) and
/// refills at the floor's rate, 10 an hour, while a store that has run for a refill answers it
/// full. Before, the key lost with the restart was full again: 10 more at once.
#[tokio::test]
async fn a_region_store_restarted_empty_starts_its_keys_empty() {
    let global = redis();
    let port = free_port();
    let store = own_redis(port);
    let clock = ManualClock::new(T0);
    let prefix = prefix("restart");
    let settings = RegionalSettings {
        period_us: 3_600_000_000,
        ..RegionalSettings::default()
    };
    let backend = RedisBackend::from_url(&store.url)
        .prefix(&prefix)
        .deny_cache(false)
        .caller_time(clock.clone())
        .regional_with(
            "eu",
            RedisBackend::from_url(&global.url)
                .prefix(format!("{prefix}g:"))
                .connect()
                .await
                .unwrap(),
            settings,
        )
        .connect()
        .await
        .unwrap();
    let regional = Arc::clone(backend.regional_mode().unwrap());
    regional.confirm_for_tests();
    // Started now on the caller's clock (its uptime: under two seconds).
    let started = backend.read_store_start().await.unwrap();
    assert!((T0 - 2 * SECOND..=T0).contains(&started), "{started}");
    // 100 an hour, floor 10%: 10 at once, one every 6 minutes.
    let hour = Limit::from_micros(100, 100, 3_600 * SECOND).unwrap();
    let limits = Limits::builder()
        .limit("Api", hour)
        .across_regions("Api", RegionFloor::default())
        .build()
        .unwrap();
    let limiter = Limiter::new(limits, backend.clone());
    let key = limiter.key("Api", Id::from(7u64)).unwrap();
    assert_eq!(allowed(&limiter, &key, 10).await, 0, "a store just started");
    // Once the store has run for a refill of the floor, a key is full.
    clock.advance(Duration::from_secs(3_602));
    assert_eq!(allowed(&limiter, &key, 20).await, 10);
    // The store restarted empty: the bucket's record is gone.
    drop(store);
    let _store = own_redis(port);
    let restarted = clock.now_us() - 2 * SECOND;
    for _ in 0..400 {
        if regional.store_start().is_some_and(|s| s >= restarted) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        regional.store_start().is_some_and(|s| s >= restarted),
        "the start read again at the reconnection: {:?}",
        regional.store_start()
    );
    assert_eq!(
        allowed(&limiter, &key, 20).await,
        0,
        "the floor not handed out again"
    );
    clock.advance(Duration::from_secs(360));
    assert_eq!(
        allowed(&limiter, &key, 5).await,
        1,
        "refilled at the floor's rate"
    );
}
