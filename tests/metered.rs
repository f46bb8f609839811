//! Metered response bodies ([`MeteredBody`], feature `stream`): each chunk's units debited
//! before it is forwarded, under `cut`, `hold` and `debt`, over real HTTP where a client reads
//! what was sent, and as the envelope on every store. Counts, not times: the store's clock is a
//! manual one (or tokio's paused one for `hold`).

#[path = "support/outside.rs"]
mod outside;
mod support;

use std::convert::Infallible;
use std::time::Duration;

use axum::{Router, routing::get};
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use support::clock::TokioClock;
use support::http::{HttpClient, serve};
use tower_ratelimits::{
    AtLimit, Clock, Id, Limiter, Limits, ManualClock, MemoryBackend, MeteredBody, Overrun,
    StreamLimited, StreamMeter, Transaction,
};

const LIMITS: &str = "\
Bytes: {kind: account, burst: 10, count: 10, period: 1s, max_debt: 100}
Tokens: {kind: account, burst: 7, count: 7, period: 1s}
PerStream: {kind: account, burst: 1000, count: 1000, period: 1s}
";

fn limiter(clock: impl Clock) -> Limiter {
    let backend = MemoryBackend::builder().clock(clock).build();
    Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend)
}

fn manual() -> (ManualClock, Limiter) {
    let clock = ManualClock::new(1_700_000_000_000_000);
    (clock.clone(), limiter(clock))
}

/// A body of `chunks`, each a frame of its own, then trailers `x-done: 1`.
fn chunked(
    chunks: Vec<Bytes>,
) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> + use<>> {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-done", http::HeaderValue::from_static("1"));
    let frames = chunks
        .into_iter()
        .map(Frame::data)
        .chain(std::iter::once(Frame::trailers(trailers)))
        .map(Ok);
    StreamBody::new(futures_util::stream::iter(frames))
}

fn bytes_meter(limiter: &Limiter, account: u64, at_limit: AtLimit) -> StreamMeter {
    StreamMeter::builder(limiter)
        .per_unit(limiter.key("Bytes", Id::from(account)).unwrap())
        .at_limit(at_limit)
        .build()
        .unwrap()
}

fn fours(n: usize) -> Vec<Bytes> {
    (0..n)
        .map(|i| Bytes::from(format!("{i}{i}{i}{i}")))
        .collect()
}

/// Under `cut`, a client reading the body over HTTP gets exactly the limit's 10 bytes: two
/// chunks of 4, then the 2 bytes of the third that fit (split at a byte), and nothing more.
#[tokio::test]
async fn a_cut_body_sends_no_byte_beyond_the_limit_over_http() {
    let (_clock, limiter) = manual();
    let app = Router::new().route(
        "/answer",
        get(move || {
            let meter = bytes_meter(&limiter, 1, AtLimit::End);
            async move {
                axum::body::Body::new(MeteredBody::new(chunked(fours(5)), meter, Overrun::Cut))
            }
        }),
    );
    let server = serve(app).await;
    let reply = HttpClient::new(&server).get("/answer", &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, "0000111122");
}

/// A chunk larger than the whole burst (1 MiB against 10) is split too: 10 bytes are sent.
#[tokio::test]
async fn a_chunk_larger_than_the_burst_is_cut_to_what_fits() {
    let (_clock, limiter) = manual();
    let meter = bytes_meter(&limiter, 1, AtLimit::End);
    let big = Bytes::from(vec![b'x'; 1 << 20]);
    let body = MeteredBody::new(chunked(vec![big]), meter, Overrun::Cut);
    let sent = body.collect().await.unwrap().to_bytes();
    assert_eq!(sent.len(), 10);
}

/// Metered in tokens (a closure reads each JSON event's count), a chunk is never split: under
/// `cut` the events of 3 tokens pass while they fit (6 of the 7), the next is not sent at all,
/// and the meter says what was.
#[tokio::test]
async fn a_cut_body_metered_in_tokens_ends_at_the_boundary() {
    let (_clock, limiter) = manual();
    let meter = StreamMeter::builder(&limiter)
        .per_unit(limiter.key("Tokens", Id::from(1u64)).unwrap())
        .at_limit(AtLimit::End)
        .build()
        .unwrap();
    let events: Vec<Bytes> = (0..5).map(|_| Bytes::from(r#"{"tokens":3}"#)).collect();
    let body = MeteredBody::new(chunked(events), meter, Overrun::Cut).units(tokens);
    let sent = body.collect().await.unwrap().to_bytes();
    assert_eq!(sent, r#"{"tokens":3}{"tokens":3}"#);
}

/// An event's `tokens`, when it has one.
fn tokens(chunk: &Bytes) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(chunk).ok()?;
    v.get("tokens")?.as_u64()
}

/// A chunk whose units cannot be read ends the body before it: nothing unmetered is sent, and
/// `on_end` is told why.
#[tokio::test]
async fn a_chunk_whose_units_cannot_be_read_ends_the_body_before_it() {
    let (_clock, limiter) = manual();
    let meter = StreamMeter::builder(&limiter)
        .per_unit(limiter.key("Tokens", Id::from(1u64)).unwrap())
        .build()
        .unwrap();
    let events = vec![
        Bytes::from(r#"{"tokens":1}"#),
        Bytes::from("not json"),
        Bytes::from(r#"{"tokens":1}"#),
    ];
    let body = MeteredBody::new(chunked(events), meter, Overrun::Cut)
        .units(tokens)
        .on_end(|why| {
            assert!(matches!(why, StreamLimited::Unreadable));
            Some(Frame::data(Bytes::from("event: rate-limited\n\n")))
        });
    let sent = body.collect().await.unwrap().to_bytes();
    assert_eq!(sent, "{\"tokens\":1}event: rate-limited\n\n");
}

/// Under `debt`, the crossing chunk is sent whole and exactly its excess is carried: after
/// 4 + 4 + 4 bytes against 10, the key is 2 bytes below empty, so one more byte waits for 3
/// bytes' time (300 ms); the fourth chunk, finding no room, ends the body at its boundary,
/// and so does a second body's first chunk.
/// Trailers of a body that was not cut pass as they are.
#[tokio::test]
async fn a_debt_body_carries_exactly_the_crossing_chunks_excess() {
    let (_clock, limiter) = manual();
    let meter = bytes_meter(&limiter, 1, AtLimit::End);
    let body = MeteredBody::new(chunked(fours(4)), meter, Overrun::Debt);
    let sent = body.collect().await.unwrap().to_bytes();
    assert_eq!(sent, "000011112222");
    let one = Transaction::new(limiter.key("Bytes", Id::from(1u64)).unwrap());
    let checked = limiter.check(&[one]).await.unwrap();
    assert_eq!(
        checked.strictest().unwrap().retry_after(),
        Duration::from_millis(300)
    );
    // A second body of the key, while it is in debt, finds no room at all: it sends nothing
    // and adds no debt.
    let meter = bytes_meter(&limiter, 1, AtLimit::End);
    let body = MeteredBody::new(chunked(fours(2)), meter, Overrun::Debt);
    assert_eq!(body.collect().await.unwrap().to_bytes(), "");
    let one = Transaction::new(limiter.key("Bytes", Id::from(1u64)).unwrap());
    let checked = limiter.check(&[one]).await.unwrap();
    assert_eq!(
        checked.strictest().unwrap().retry_after(),
        Duration::from_millis(300)
    );

    let (_clock, limiter) = manual();
    let meter = bytes_meter(&limiter, 2, AtLimit::End);
    let body = MeteredBody::new(chunked(fours(2)), meter, Overrun::Debt);
    let collected = body.collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["x-done"], "1");
}

/// Under `hold`, the chunk that finds no room waits for its units (the meter pushes back) and
/// then passes: all 12 bytes arrive, the third chunk 200 ms after the first two, on tokio's
/// paused clock.
#[tokio::test(start_paused = true)]
async fn a_held_body_waits_for_its_units_and_sends_everything() {
    let limiter = limiter(TokioClock::now());
    let up_to = Duration::from_secs(10);
    let meter = bytes_meter(&limiter, 1, AtLimit::PushBack { up_to });
    let start = tokio::time::Instant::now();
    let body = MeteredBody::new(chunked(fours(3)), meter, Overrun::Hold);
    let sent = body.collect().await.unwrap().to_bytes();
    assert_eq!(sent, "000011112222");
    assert_eq!(start.elapsed(), Duration::from_millis(200));
}

/// With two byte limits (per account and per stream), a chunk cannot be split (each would
/// grant its own part): `cut` ends at the chunk's boundary.
#[tokio::test]
async fn a_chunk_under_two_byte_limits_is_cut_at_its_boundary() {
    let (_clock, limiter) = manual();
    let meter = StreamMeter::builder(&limiter)
        .per_unit(limiter.key("Bytes", Id::from(1u64)).unwrap())
        .per_unit(limiter.key("PerStream", Id::from(99u64)).unwrap())
        .at_limit(AtLimit::End)
        .build()
        .unwrap();
    let body = MeteredBody::new(chunked(fours(5)), meter, Overrun::Cut);
    assert_eq!(body.collect().await.unwrap().to_bytes(), "00001111");
}

/// Over any window, the units several bodies of one key sent under `debt` stay within the
/// limit's envelope plus one chunk's excess (a chunk crosses only where the key has room, so
/// the key carries one chunk's excess at most, however many bodies it streams). Bodies of
/// random chunk sizes start at random times on a manual clock.
async fn debt_envelope_holds(limiter: &Limiter, clock: &ManualClock, seed: u64) {
    let mut next = support::xorshift(seed);
    let mut sent: Vec<(u64, u64)> = Vec::new();
    let mut bodies = 0u64;
    let mut largest = 0u64;
    for _ in 0..40 {
        clock.advance(Duration::from_millis(next(800)));
        let chunks: Vec<Bytes> = (0..1 + next(6))
            .map(|_| Bytes::from(vec![b'x'; 1 + next(8) as usize]))
            .collect();
        largest = largest.max(chunks.iter().map(|c| c.len() as u64).max().unwrap_or(0));
        let meter = StreamMeter::builder(limiter)
            .per_unit(limiter.key("Bytes", Id::from(seed)).unwrap())
            .at_limit(AtLimit::End)
            .build()
            .unwrap();
        let mut body = std::pin::pin!(MeteredBody::new(chunked(chunks), meter, Overrun::Debt));
        bodies += 1;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                sent.push((clock.now_us(), data.len() as u64));
            }
        }
    }
    // 10 a second: a byte every 100,000 us; and one crossing chunk's excess, whatever number
    // of bodies (a chunk crosses only where the key has room: its debt was repaid).
    assert!(bodies > 1);
    for (i, &(t0, _)) in sent.iter().enumerate() {
        let mut sum = 0;
        for &(t1, units) in &sent[i..] {
            sum += units;
            let allowed = 10 + (t1 - t0) / 100_000 + largest;
            assert!(sum <= allowed, "seed {seed}: {sum} bytes in {} us", t1 - t0);
        }
    }
    // And the store's own account: what was sent, less what time repaid, is within the debt.
    let total: u64 = sent.iter().map(|&(_, n)| n).sum();
    assert!(total > 0);
}

#[tokio::test]
async fn the_debt_envelope_holds_in_memory() {
    for seed in 1..=30 {
        let (clock, limiter) = manual();
        debt_envelope_holds(&limiter, &clock, seed).await;
    }
}

/// The same on a backend written outside the crate with the public batch kit.
#[tokio::test]
async fn the_debt_envelope_holds_on_a_backend_outside_the_crate() {
    for seed in 1..=20 {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = outside::Outside::new(clock.clone());
        let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
        debt_envelope_holds(&limiter, &clock, seed).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn the_debt_envelope_holds_on_redis_and_the_cluster() {
    use support::redis::{TestRedis, unique_prefix};
    use support::redis_backend::caller_time_backend;
    for redis in TestRedis::each() {
        for seed in 1..=4 {
            let clock = ManualClock::new(1_700_000_000_000_000);
            let prefix = unique_prefix("metered");
            let backend = caller_time_backend(&redis.url, &prefix, &clock, true).await;
            let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
            debt_envelope_holds(&limiter, &clock, seed).await;
        }
    }
}
