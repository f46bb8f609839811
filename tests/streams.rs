//! Limits inside a stream ([`StreamMeter`], [`LimitedStream`]): every message one batch on the
//! limiter's road, asserted as counts on tokio's paused clock (push back, ending, hostile
//! messages) and, on every store, as the limit's envelope over any window for many streams of
//! one key.

#[path = "support/outside.rs"]
mod outside;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use support::clock::TokioClock;
use tower_ratelimits::{
    AtLimit, Clock, Id, LimitedStream, Limiter, Limits, ManualClock, MemoryBackend, StreamError,
    StreamLimited, StreamMeter,
};

const LIMITS: &str = "\
Messages: {kind: account, burst: 2, count: 10, period: 1s}
Bytes: {kind: account, burst: 1000, count: 1000, period: 1s}
Slots: {kind: account, concurrency: 2, lease: 1m}
";

fn limiter() -> Limiter {
    let backend = MemoryBackend::builder().clock(TokioClock::now()).build();
    Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend)
}

fn meter(limiter: &Limiter, account: u64, at_limit: AtLimit) -> StreamMeter {
    StreamMeter::builder(limiter)
        .per_message(limiter.key("Messages", Id::from(account)).unwrap())
        .per_unit(limiter.key("Bytes", Id::from(account)).unwrap())
        .at_limit(at_limit)
        .build()
        .unwrap()
}

fn push_back(up_to_s: u64) -> AtLimit {
    AtLimit::PushBack {
        up_to: Duration::from_secs(up_to_s),
    }
}

/// A stream of `n` one-byte messages that counts how many the wrapper took from it.
fn counted(n: u32, taken: &Arc<AtomicU64>) -> impl futures_util::Stream<Item = u32> + use<> {
    let taken = taken.clone();
    futures_util::stream::iter(0..n).inspect(move |_| {
        taken.fetch_add(1, Ordering::Relaxed);
    })
}

/// A client flooding 50 messages is held to its rule's rate within one message: after each
/// message it has had at most the burst (2) plus 10 a second of the time gone by, it is never
/// refused (push back is flow control), the wrapper never takes more than one message beyond
/// those admitted from the stream it wraps (the sender stalls), and the 50th passes exactly
/// when its token comes: (50 - 2) tokens at 100 ms.
#[tokio::test(start_paused = true)]
async fn push_back_holds_a_flood_to_the_rate_within_one_message() {
    let limiter = limiter();
    let taken = Arc::new(AtomicU64::new(0));
    let start = tokio::time::Instant::now();
    let mut stream = LimitedStream::new(counted(50, &taken), meter(&limiter, 7, push_back(60)));
    let mut admitted = 0u64;
    while let Some(m) = stream.next().await {
        assert_eq!(u64::from(m), admitted, "in order, none lost");
        admitted += 1;
        let earned = 2 + start.elapsed().as_millis() as u64 / 100;
        assert!(
            admitted <= earned,
            "{admitted} admitted by {:?}",
            start.elapsed()
        );
        assert!(taken.load(Ordering::Relaxed) <= admitted + 1);
    }
    assert_eq!(admitted, 50);
    assert_eq!(start.elapsed(), Duration::from_millis(4800));
    assert_eq!(
        (stream.meter().messages(), stream.meter().units()),
        (50, 50)
    );
}

/// Ending: the stream yields the first two messages, then what `on_end` makes of the reason
/// (the limit and its exact wait), then nothing, and the wrapped stream is not read further.
#[tokio::test(start_paused = true)]
async fn ending_yields_the_reason_once_and_nothing_after() {
    let limiter = limiter();
    let taken = Arc::new(AtomicU64::new(0));
    let ok = counted(10, &taken).map(Ok::<u32, StreamLimited>);
    let mut stream =
        LimitedStream::new(ok, meter(&limiter, 7, AtLimit::End)).on_end(|e| Some(Err(e)));
    assert_eq!(stream.next().await.unwrap().unwrap(), 0);
    assert_eq!(stream.next().await.unwrap().unwrap(), 1);
    match stream.next().await.unwrap().unwrap_err() {
        StreamLimited::Limited {
            limit,
            retry_after,
            banned,
        } => {
            assert_eq!(limit.as_str(), "Messages");
            assert_eq!(retry_after, Duration::from_millis(100));
            assert!(!banned);
        }
        e => panic!("{e:#?}"),
    }
    assert!(stream.next().await.is_none());
    assert!(stream.next().await.is_none());
    assert_eq!(
        taken.load(Ordering::Relaxed),
        3,
        "the refused message, no more"
    );
}

/// A wait beyond push back's bound ends the stream as `End` would, without waiting.
#[tokio::test(start_paused = true)]
async fn a_wait_beyond_the_bound_ends_the_stream_at_once() {
    let limiter = limiter();
    let mut meter = meter(
        &limiter,
        7,
        AtLimit::PushBack {
            up_to: Duration::from_millis(50),
        },
    );
    let start = tokio::time::Instant::now();
    meter.admit(1).await.unwrap();
    meter.admit(1).await.unwrap();
    let e = meter.admit(1).await.unwrap_err();
    assert_eq!(e.retry_after(), Some(Duration::from_millis(100)));
    assert_eq!(start.elapsed(), Duration::ZERO);
    // Ended: every next message is refused, without a decision.
    assert!(matches!(meter.admit(1).await, Err(StreamLimited::Ended)));
    assert_eq!(meter.messages(), 2);
}

/// Push back's bound counts per message, from its own first refusal: ten messages that each
/// wait 100 ms all pass under a bound of 150 ms.
#[tokio::test(start_paused = true)]
async fn the_bound_counts_per_message() {
    let limiter = limiter();
    let up_to = Duration::from_millis(150);
    let mut meter = meter(&limiter, 7, AtLimit::PushBack { up_to });
    for _ in 0..12 {
        meter.admit(1).await.unwrap();
    }
    assert_eq!(meter.messages(), 12);
}

/// A 1 GiB message under a byte limit of 1,000 can never pass: it ends the stream at once,
/// even when the meter pushes back (waiting would never end), and spends nothing.
#[tokio::test(start_paused = true)]
async fn a_message_larger_than_the_burst_ends_the_stream_even_when_pushing_back() {
    let limiter = limiter();
    let mut meter = meter(&limiter, 7, push_back(3600));
    let start = tokio::time::Instant::now();
    match meter.admit(1 << 30).await.unwrap_err() {
        StreamLimited::TooLarge { limit, units, max } => {
            assert_eq!((limit.as_str(), units, max), ("Bytes", 1 << 30, 1000));
        }
        e => panic!("{e:#?}"),
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
    let mut next = self::meter(&limiter, 7, AtLimit::End);
    next.admit(1000).await.expect("nothing was spent");
}

/// An empty message costs no byte but still counts as a message: a flood of empty frames is
/// held by the per-message limit.
#[tokio::test(start_paused = true)]
async fn an_empty_message_still_counts_as_a_message() {
    let limiter = limiter();
    let mut meter = meter(&limiter, 7, AtLimit::End);
    meter.admit(0).await.unwrap();
    meter.admit(0).await.unwrap();
    let e = meter.admit(0).await.unwrap_err();
    assert!(matches!(e, StreamLimited::Limited { ref limit, .. } if limit.as_str() == "Messages"));
    assert_eq!((meter.messages(), meter.units()), (2, 0));
}

/// A quiet stream of another key on the same limiter gets every message it sends, at once,
/// while a flood of one key is pushed back beside it.
#[tokio::test(start_paused = true)]
async fn a_quiet_stream_beside_a_flood_gets_every_message_at_once() {
    let limiter = limiter();
    let flood = LimitedStream::new(
        counted(1000, &Arc::default()),
        meter(&limiter, 1, push_back(600)),
    );
    let flooding = tokio::spawn(flood.count());
    let mut quiet = meter(&limiter, 2, push_back(600));
    for _ in 0..20 {
        let before = tokio::time::Instant::now();
        quiet.admit(10).await.unwrap();
        assert_eq!(before.elapsed(), Duration::ZERO, "never held");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(quiet.messages(), 20);
    flooding.abort();
}

/// What cannot be a stream's meter is refused when it is built, with the reason.
#[tokio::test]
async fn a_meter_with_no_key_a_key_twice_or_a_limit_holding_slots_is_refused() {
    let limiter = limiter();
    let key = |name| limiter.key(name, Id::from(7u64)).unwrap();
    assert!(matches!(
        StreamMeter::builder(&limiter).build(),
        Err(StreamError::NoKeys)
    ));
    match StreamMeter::builder(&limiter)
        .per_message(key("Slots"))
        .build()
    {
        Err(StreamError::HoldsSlots(name)) => assert_eq!(name.as_str(), "Slots"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        StreamMeter::builder(&limiter)
            .per_message(key("Messages"))
            .per_unit(key("Messages"))
            .build(),
        Err(StreamError::Limiter(_))
    ));
}

/// The reasons a stream ends, as a WebSocket close and an SSE event carry them: the close
/// code by kind, the reason within a close frame's 123 bytes at a character boundary.
#[tokio::test(start_paused = true)]
async fn the_reason_reads_as_a_websocket_close_and_an_sse_event() {
    let limiter = limiter();
    let mut meter = meter(&limiter, 7, AtLimit::End);
    meter.admit(1).await.unwrap();
    meter.admit(1).await.unwrap();
    let e = meter.admit(1).await.unwrap_err();
    assert_eq!(e.close_code(), 1013);
    assert_eq!(
        e.close_reason(),
        "rate limit Messages exceeded; retry after 100 ms"
    );
    let json: serde_json::Value = serde_json::from_str(&e.json()).unwrap();
    assert_eq!(json["limiter"], "Messages");
    assert_eq!(json["retry_after_ms"], 100);
    let mut big = self::meter(&limiter, 8, AtLimit::End);
    let e = big.admit(5000).await.unwrap_err();
    assert_eq!(e.close_code(), 1009);
    assert!(e.json().contains("\"limiter\":\"Bytes\""));
    assert!(!e.json().contains("retry_after_ms"));
    // The longest name and the largest message: the reason is cut to the 123 bytes of a
    // close frame.
    let name = "N".repeat(64);
    let yaml = format!("{name}: {{kind: account, burst: 1, count: 1, period: 1h}}\n");
    let limiter = Limiter::new(
        Limits::from_yaml_str(&yaml, None).unwrap(),
        MemoryBackend::new(),
    );
    let mut meter = StreamMeter::builder(&limiter)
        .per_unit(limiter.key(&name, Id::from(1u64)).unwrap())
        .build()
        .unwrap();
    let e = meter.admit(u64::MAX).await.unwrap_err();
    assert!(e.to_string().len() > 123);
    assert_eq!(e.close_reason(), e.to_string()[..123]);
}

/// Over any window, the units admitted for one key across all its streams stay within the
/// limit's envelope: at most the burst plus the rate times the window. Four streams of one
/// key send messages of random sizes at random times on a manual clock; a stream that ends
/// is replaced by a new one (its unused grant given back). With grants ahead or without,
/// every store decides alike.
async fn envelope_holds(limiter: &Limiter, clock: &ManualClock, seed: u64) {
    let mut next = support::xorshift(seed);
    // Half the seeds take grants ahead (units the store spent before the messages came).
    let new_meter = || {
        StreamMeter::builder(limiter)
            .per_unit(limiter.key("Bytes", Id::from(seed)).unwrap())
            .at_limit(AtLimit::End)
            .ahead(seed % 2 * 3)
            .build()
            .unwrap()
    };
    let mut streams: Vec<StreamMeter> = (0..4).map(|_| new_meter()).collect();
    let mut admitted: Vec<(u64, u64)> = Vec::new();
    for _ in 0..150 {
        clock.advance(Duration::from_millis(next(60)));
        let s = next(4) as usize;
        let units = 1 + next(300);
        match streams[s].admit(units).await {
            Ok(()) => admitted.push((clock.now_us(), units)),
            Err(StreamLimited::Limited { .. }) => streams[s] = new_meter(),
            Err(e) => panic!("{e:#?}"),
        }
    }
    // 1,000 a second: a unit every 1,000 us.
    for (i, &(t0, _)) in admitted.iter().enumerate() {
        let mut sum = 0;
        for &(t1, units) in &admitted[i..] {
            sum += units;
            let allowed = 1000 + (t1 - t0) / 1000;
            assert!(sum <= allowed, "seed {seed}: {sum} units in {} us", t1 - t0);
        }
    }
    assert!(
        admitted.len() > 20,
        "seed {seed}: the test exercised the limit"
    );
}

#[tokio::test]
async fn the_envelope_holds_for_many_streams_of_one_key_in_memory() {
    for seed in 1..=40 {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = MemoryBackend::builder().clock(clock.clone()).build();
        let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
        envelope_holds(&limiter, &clock, seed).await;
    }
}

/// The same on a backend written outside the crate with the public batch kit (the
/// conformance tests' store), grants given back included.
#[tokio::test]
async fn the_envelope_holds_and_grants_come_back_on_a_backend_outside_the_crate() {
    for seed in 1..=20 {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = outside::Outside::new(clock.clone());
        let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
        envelope_holds(&limiter, &clock, seed).await;
    }
    let clock = ManualClock::new(1_700_000_000_000_000);
    let backend = outside::Outside::new(clock);
    let limiter = Limiter::new(Limits::from_yaml_str(WIDE, None).unwrap(), backend);
    a_grant_is_taken_ahead_and_given_back(&limiter).await;
}

/// The units a key has left, as a check of one unit sees them (what would remain after it).
async fn remaining(limiter: &Limiter, name: &str, id: u64) -> u64 {
    let one = tower_ratelimits::Transaction::new(limiter.key(name, Id::from(id)).unwrap());
    let checked = limiter.check(&[one]).await.unwrap();
    checked.decisions()[0].remaining()
}

/// Waits (bounded) until a key has `want` units left: a dropped meter gives its grant back in
/// a task.
async fn until_remaining(limiter: &Limiter, name: &str, id: u64, want: u64) {
    for _ in 0..500 {
        if remaining(limiter, name, id).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{name}:{id} never had {want} left: {}",
        remaining(limiter, name, id).await
    );
}

/// Grants ahead: the first message takes itself and 4 messages' worth more (the store spends
/// 5), the next four pass on what is held, and the meter, dropped after six messages, gives
/// back the 4 units it held unused.
async fn a_grant_is_taken_ahead_and_given_back(limiter: &Limiter) {
    let remaining_now = remaining(limiter, "Wide", 1).await;
    let mut meter = StreamMeter::builder(limiter)
        .per_message(limiter.key("Wide", Id::from(1u64)).unwrap())
        .ahead(4)
        .build()
        .unwrap();
    meter.admit(1).await.unwrap();
    assert_eq!(remaining(limiter, "Wide", 1).await, remaining_now - 5);
    for _ in 0..5 {
        meter.admit(1).await.unwrap();
    }
    assert_eq!(remaining(limiter, "Wide", 1).await, remaining_now - 10);
    assert_eq!(meter.messages(), 6);
    drop(meter);
    until_remaining(limiter, "Wide", 1, remaining_now - 6).await;
}

const MONEY: &str = "\
Tokens: {kind: account, burst: 100000, count: 100000, period: 1h}
Spend: {kind: account, burst: 1000000, count: 1000000, period: 1h}
";

/// Money beside tokens: a stream of 200 messages of 1 to 9 tokens, priced at 3 micro-units
/// per 7 tokens (no message's price a whole number), spends on the clock that does not move
/// exactly its tokens of `Tokens` and their price of `Spend`, rounded up once for the whole
/// stream (not once a message: that would be about 100 micro-units more), with grants ahead
/// (what the meter held given back when it is dropped) and without.
async fn a_priced_stream_is_charged_exactly_its_units_price(limiter: &Limiter) {
    let price = tower_ratelimits::UnitPrice::new(3, 7);
    for (account, ahead) in [(1u64, 0u64), (2, 3)] {
        let (tokens_full, spend_full) = (
            remaining(limiter, "Tokens", account).await,
            remaining(limiter, "Spend", account).await,
        );
        let mut meter = StreamMeter::builder(limiter)
            .per_unit(limiter.key("Tokens", Id::from(account)).unwrap())
            .per_unit_at(limiter.key("Spend", Id::from(account)).unwrap(), price)
            .ahead(ahead)
            .build()
            .unwrap();
        let mut next = support::xorshift(account);
        let mut total = 0;
        for _ in 0..200 {
            let units = 1 + next(9);
            meter.admit(units).await.unwrap();
            total += units;
        }
        assert_eq!(meter.units(), total);
        drop(meter);
        until_remaining(limiter, "Tokens", account, tokens_full - total).await;
        until_remaining(limiter, "Spend", account, spend_full - price.cost(total)).await;
    }
}

#[tokio::test]
async fn a_priced_stream_is_charged_exactly_in_memory_and_outside_the_crate() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(Limits::from_yaml_str(MONEY, None).unwrap(), backend);
    a_priced_stream_is_charged_exactly_its_units_price(&limiter).await;
    let backend = outside::Outside::new(clock);
    let limiter = Limiter::new(Limits::from_yaml_str(MONEY, None).unwrap(), backend);
    a_priced_stream_is_charged_exactly_its_units_price(&limiter).await;
}

const WIDE: &str = "Wide: {kind: account, burst: 1000, count: 1000, period: 1s}\n";

#[tokio::test]
async fn a_grant_is_taken_ahead_and_given_back_in_memory() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock).build();
    let limiter = Limiter::new(Limits::from_yaml_str(WIDE, None).unwrap(), backend);
    a_grant_is_taken_ahead_and_given_back(&limiter).await;
}

/// Ten thousand streams of one key, each taking grants of 5 messages ahead, on a stopped clock:
/// never more messages admitted than the burst (1,000), whatever the streams hold, and once
/// every stream is gone the key holds exactly what the admitted messages spent.
#[tokio::test]
async fn ten_thousand_streams_of_one_key_never_pass_the_limit_and_give_back_their_grants() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock).build();
    let limiter = Limiter::new(Limits::from_yaml_str(WIDE, None).unwrap(), backend);
    let full = remaining(&limiter, "Wide", 1).await;
    let mut meters = Vec::new();
    let mut admitted = 0;
    for _ in 0..10_000 {
        let mut meter = StreamMeter::builder(&limiter)
            .per_message(limiter.key("Wide", Id::from(1u64)).unwrap())
            .at_limit(AtLimit::End)
            .ahead(5)
            .build()
            .unwrap();
        if meter.admit(1).await.is_ok() {
            admitted += 1;
        }
        meters.push(meter);
    }
    assert!((150..=1000).contains(&admitted), "{admitted}");
    drop(meters);
    until_remaining(&limiter, "Wide", 1, full - admitted).await;
}

/// A stream's key is a plain key: `Limiter::inspect` (and so the admin API) shows what its
/// messages spent, as for any key.
#[tokio::test]
async fn a_streams_key_is_inspected_like_any_key() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock).build();
    let limiter = Limiter::new(Limits::from_yaml_str(WIDE, None).unwrap(), backend);
    let key = limiter.key("Wide", Id::from(9u64)).unwrap();
    let mut meter = StreamMeter::builder(&limiter)
        .per_message(key.clone())
        .build()
        .unwrap();
    for _ in 0..30 {
        meter.admit(1).await.unwrap();
    }
    let seen = limiter.inspect(&key).await.unwrap();
    assert_eq!(seen.remaining, 970);
    assert_eq!(seen.reset_after, Duration::from_millis(30));
}

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use support::redis::{RedisServer, TestRedis, unique_prefix};
    use support::redis_backend::{caller_time_backend, commandstat};
    use tower_ratelimits::RedisBackend;

    #[tokio::test]
    async fn the_envelope_holds_for_many_streams_of_one_key_on_redis_and_the_cluster() {
        for redis in TestRedis::each() {
            for seed in 1..=6 {
                let clock = ManualClock::new(1_700_000_000_000_000);
                let prefix = unique_prefix("streams");
                let backend = caller_time_backend(&redis.url, &prefix, &clock, true).await;
                let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
                envelope_holds(&limiter, &clock, seed).await;
            }
        }
    }

    /// What a message costs the store, counted by the server itself: one script call per
    /// message without grants; with grants of 99 messages ahead, one per 100 messages while
    /// the key has room, and one more to give the unused grant back. The figures BENCHMARKS
    /// gives per 1,000 messages.
    #[tokio::test]
    async fn round_trips_per_thousand_messages_with_and_without_grants() {
        let server = RedisServer::start();
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = caller_time_backend(&server.url(), &unique_prefix("rt"), &clock, true).await;
        let yaml = "Messages: {kind: account, burst: 5000, count: 5000, period: 1s}\n";
        let limiter = Limiter::new(Limits::from_yaml_str(yaml, None).unwrap(), backend);
        let mut calls = Vec::new();
        for (id, ahead) in [(1u64, 0), (2, 99)] {
            let mut meter = StreamMeter::builder(&limiter)
                .per_message(limiter.key("Messages", Id::from(id)).unwrap())
                .ahead(ahead)
                .build()
                .unwrap();
            let before = commandstat(server.port, "evalsha");
            for _ in 0..1000 {
                meter.admit(1).await.unwrap();
            }
            drop(meter); // 1,000 messages used every unit granted: nothing to give back
            calls.push(commandstat(server.port, "evalsha") - before);
        }
        eprintln!(
            "Redis round trips per 1,000 messages: {} without grants, {} with grants of 99 ahead",
            calls[0], calls[1]
        );
        // The first call of all may load the script (NOSCRIPT, then EVALSHA again).
        assert!(calls[0] == 1000 || calls[0] == 1001, "{calls:?}");
        assert!(calls[1] <= 11, "{calls:?}");
    }

    /// When the store cannot decide (its server killed), a meter that fails closed ends the
    /// stream with `Failed` (gRPC `UNAVAILABLE`, WebSocket 1011), and one that fails open lets
    /// the message pass; a message the stream held on a grant passes either way.
    #[tokio::test]
    async fn a_store_that_cannot_decide_ends_the_stream_unless_it_fails_open() {
        let mut server = RedisServer::start();
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = RedisBackend::from_url(server.url())
            .prefix(unique_prefix("down"))
            .caller_time(clock)
            .command_timeout(Duration::from_millis(300))
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::new(Limits::from_yaml_str(WIDE, None).unwrap(), backend);
        let meter = |open: bool, ahead: u64| {
            StreamMeter::builder(&limiter)
                .per_message(limiter.key("Wide", Id::from(1u64)).unwrap())
                .fail_open(open)
                .ahead(ahead)
                .build()
                .unwrap()
        };
        let (mut closed, mut open, mut held) = (meter(false, 0), meter(true, 0), meter(false, 5));
        closed.admit(1).await.unwrap();
        held.admit(1).await.unwrap();
        server.kill();
        let e = closed.admit(1).await.unwrap_err();
        assert!(matches!(e, StreamLimited::Failed(_)), "{e:#?}");
        assert_eq!(e.close_code(), 1011);
        open.admit(1).await.unwrap();
        assert_eq!(open.messages(), 1);
        for _ in 0..5 {
            held.admit(1).await.unwrap();
        }
        assert!(matches!(held.admit(1).await, Err(StreamLimited::Failed(_))));
    }

    #[tokio::test]
    async fn a_priced_stream_is_charged_exactly_on_redis_and_the_cluster() {
        for redis in TestRedis::each() {
            let clock = ManualClock::new(1_700_000_000_000_000);
            let prefix = unique_prefix("priced");
            let backend = caller_time_backend(&redis.url, &prefix, &clock, true).await;
            let limiter = Limiter::new(Limits::from_yaml_str(MONEY, None).unwrap(), backend);
            a_priced_stream_is_charged_exactly_its_units_price(&limiter).await;
        }
    }

    /// A stream's key is a plain key to a snapshot of the store (what `plan snapshot` reads):
    /// after a stream of account 7 sent 2 messages, the snapshot holds its `Messages` key, the
    /// only key the stream spent (its `Bytes` key was not in its meter).
    #[tokio::test]
    async fn a_snapshot_holds_a_streams_key_on_redis_and_the_cluster() {
        for redis in TestRedis::each() {
            let clock = ManualClock::new(1_700_000_000_000_000);
            let prefix = unique_prefix("snap");
            let backend = caller_time_backend(&redis.url, &prefix, &clock, true).await;
            let limits = Limits::from_yaml_str(LIMITS, None).unwrap();
            let limiter = Limiter::new(limits.clone(), backend);
            let mut meter = StreamMeter::builder(&limiter)
                .per_message(limiter.key("Messages", Id::from(7u64)).unwrap())
                .build()
                .unwrap();
            for _ in 0..2 {
                meter.admit(1).await.unwrap();
            }
            let builder = RedisBackend::from_url(&redis.url).prefix(&prefix);
            let snapshot = tower_ratelimits::Snapshot::from_redis(builder, &limits, 1_000)
                .await
                .unwrap();
            let keys: Vec<_> = snapshot
                .keys()
                .iter()
                .map(|k| (k.limit.clone(), k.id.clone()))
                .collect();
            assert_eq!(keys, [("Messages".to_owned(), "7".to_owned())]);
        }
    }

    #[tokio::test]
    async fn a_grant_is_taken_ahead_and_given_back_on_redis_and_the_cluster() {
        for redis in TestRedis::each() {
            let clock = ManualClock::new(1_700_000_000_000_000);
            let prefix = unique_prefix("grants");
            let backend = caller_time_backend(&redis.url, &prefix, &clock, true).await;
            let limiter = Limiter::new(Limits::from_yaml_str(WIDE, None).unwrap(), backend);
            a_grant_is_taken_ahead_and_given_back(&limiter).await;
        }
    }
}

/// A stream's keys are plain keys to stored overrides, set while the stream is open: each
/// message is decided under the limits of its own moment. Account 7's override to a burst of
/// 5 lets its open stream's messages past the default burst of 2; a block of account 8 ends
/// its stream at the next message with the block's wait; removing the override gives account
/// 7's stream the default back at its next message.
#[tokio::test(start_paused = true)]
async fn a_stored_override_reaches_an_open_streams_next_message() {
    use tower_ratelimits::{Limit, OverrideKind};
    let limiter = limiter();
    let mut seven = StreamMeter::builder(&limiter)
        .per_message(limiter.key("Messages", Id::from(7u64)).unwrap())
        .at_limit(AtLimit::End)
        .build()
        .unwrap();
    let mut eight = StreamMeter::builder(&limiter)
        .per_message(limiter.key("Messages", Id::from(8u64)).unwrap())
        .at_limit(AtLimit::End)
        .build()
        .unwrap();
    seven.admit(1).await.unwrap();
    eight.admit(1).await.unwrap();
    let five = Limit::new(5, 10, Duration::from_secs(1)).unwrap();
    limiter
        .set_override("Messages", "7", OverrideKind::Quota(five.into()), None)
        .await
        .unwrap();
    limiter
        .set_override(
            "Messages",
            "8",
            OverrideKind::Block,
            Some(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    for _ in 0..4 {
        seven.admit(1).await.unwrap();
    }
    match seven.admit(1).await {
        Err(StreamLimited::Limited { .. }) => {}
        other => panic!("{other:?}"),
    }
    match eight.admit(1).await {
        Err(StreamLimited::Limited { retry_after, .. }) => {
            assert_eq!(retry_after, Duration::from_secs(3600));
        }
        other => panic!("{other:?}"),
    }
    assert!(limiter.remove_override("Messages", "7").await.unwrap());
    let mut again = StreamMeter::builder(&limiter)
        .per_message(limiter.key("Messages", Id::from(7u64)).unwrap())
        .at_limit(AtLimit::End)
        .build()
        .unwrap();
    tokio::time::advance(Duration::from_secs(10)).await;
    again.admit(1).await.unwrap();
    again.admit(1).await.unwrap();
    assert!(
        again.admit(1).await.is_err(),
        "the default burst of 2 again"
    );
}
