//! Limits inside gRPC streams, end to end: the `tonic_streams` example's service on an
//! ephemeral port, its handlers metering every message with `LimitedStream` (feature
//! `stream`), called by a real tonic client for each stream kind (bidirectional, client and
//! server streaming). Asserted as counts on a manual clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status, Streaming};
use tonic_types::StatusExt;
use tower_ratelimits::{Id, Limiter, Limits, ManualClock, MemoryBackend};

/// The example's service, its codec and its layer.
#[path = "../tonic_streams.rs"]
#[allow(dead_code)]
mod example;
use example::{LIMITS, Raw, Streams, StreamsServer};

/// A server of `StreamsServer` on an ephemeral port, behind a layer holding one stream at once
/// per account (its slot held for the stream's whole life), on a manual clock.
struct Served {
    clock: ManualClock,
    limiter: Limiter,
    taken: Arc<AtomicU64>,
    grpc: tonic::client::Grpc<Channel>,
}

async fn serve() -> Served {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::from_yaml_str(LIMITS, None).unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let layer = example::layer(&limiter);
    let taken = Arc::new(AtomicU64::new(0));
    let service = StreamsServer(Streams {
        limiter: limiter.clone(),
        taken: taken.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    Served {
        clock,
        limiter,
        taken,
        grpc: tonic::client::Grpc::new(channel),
    }
}

/// A call as `account`, its messages `body`; a meter taking grants of 10 messages ahead for an
/// account above 100.
fn call<T>(account: u64, push_back: bool, body: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(body);
    let meta = request.metadata_mut();
    meta.insert("x-account", account.to_string().parse().unwrap());
    if push_back {
        meta.insert("x-at-limit", "push-back".parse().unwrap());
    }
    if account > 100 {
        meta.insert("x-ahead", "10".parse().unwrap());
    }
    request
}

impl Served {
    async fn echo(
        &mut self,
        account: u64,
        push_back: bool,
        messages: impl Stream<Item = Bytes> + Send + 'static,
    ) -> Result<Streaming<Bytes>, Status> {
        self.grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static("/test.Streams/Echo");
        let request = call(account, push_back, messages);
        Ok(self.grpc.streaming(request, path, Raw).await?.into_inner())
    }
}

/// A flood of 100 messages on a stopped clock is echoed exactly the burst (5), then the stream
/// ends with `RESOURCE_EXHAUSTED` in its trailers, whose `RetryInfo` is the exact wait for the
/// next token (100 ms) and whose `QuotaFailure` names the limit; the server read one message
/// past those it admitted, no more.
#[tokio::test]
async fn a_flooding_bidirectional_stream_ends_at_the_limit_with_retry_info_in_its_trailers() {
    let mut served = serve().await;
    let flood = tokio_stream::iter((0..100u32).map(|i| Bytes::from(i.to_string())));
    let mut replies = served.echo(1, false, flood).await.unwrap();
    for i in 0..5 {
        assert_eq!(replies.next().await.unwrap().unwrap(), i.to_string());
    }
    let status = replies.next().await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    let details = status.get_error_details();
    assert_eq!(
        details.retry_info().unwrap().retry_delay,
        Some(Duration::from_millis(100))
    );
    let violations = &details.quota_failure().unwrap().violations;
    assert_eq!(violations[0].subject, "MessagesPerAccount");
    assert!(replies.next().await.is_none());
    assert_eq!(served.taken.load(Ordering::Relaxed), 6);
}

/// Push back is flow control: on a stopped clock the server echoes the burst and then holds
/// the next message without an error (it reads one message past those it admitted); each
/// token the clock brings lets exactly one more through, and the stream ends with `OK` when
/// the client ends it.
#[tokio::test]
async fn push_back_stalls_the_sender_without_an_error() {
    let mut served = serve().await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(100);
    let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut replies = served.echo(2, true, outbound).await.unwrap();
    for i in 0..10u32 {
        tx.send(Bytes::from(i.to_string())).await.unwrap();
    }
    for i in 0..5u32 {
        assert_eq!(replies.next().await.unwrap().unwrap(), i.to_string());
    }
    // The sixth is held: the server took it and no more, and answered nothing.
    wait_for(|| served.taken.load(Ordering::Relaxed) == 6).await;
    for i in 5..8u32 {
        served.clock.advance(Duration::from_millis(100));
        assert_eq!(replies.next().await.unwrap().unwrap(), i.to_string());
        assert!(served.taken.load(Ordering::Relaxed) <= u64::from(i) + 2);
    }
    served.clock.advance(Duration::from_secs(1));
    drop(tx);
    let rest: Vec<_> = replies.collect().await;
    assert_eq!(rest.len(), 2);
    assert!(rest.iter().all(|r| r.is_ok()), "{rest:?}");
}

/// A quiet stream of another account on the same server gets every message it sends while a
/// flood is held back beside it.
#[tokio::test]
async fn a_quiet_stream_beside_a_flood_gets_every_message() {
    let mut served = serve().await;
    let (flood_tx, flood_rx) = tokio::sync::mpsc::channel::<Bytes>(1000);
    let _flood = served
        .echo(
            3,
            true,
            tokio_stream::wrappers::ReceiverStream::new(flood_rx),
        )
        .await
        .unwrap();
    for _ in 0..200 {
        if flood_tx.try_send(Bytes::from_static(b"x")).is_err() {
            break;
        }
    }
    let quiet = tokio_stream::iter((0..5u32).map(|i| Bytes::from(i.to_string())));
    let replies: Vec<_> = served.echo(4, true, quiet).await.unwrap().collect().await;
    assert_eq!(replies.len(), 5);
    assert!(replies.iter().all(|r| r.is_ok()), "{replies:?}");
}

/// Client streaming: the handler reads `RESOURCE_EXHAUSTED` at the sixth message and returns
/// it: the client's call fails with it. Server streaming: the server's sixth message finds no
/// room, and the client reads five, then the status.
#[tokio::test]
async fn client_and_server_streams_end_at_the_limit() {
    let mut served = serve().await;
    served.grpc.ready().await.unwrap();
    let messages = tokio_stream::iter((0..20u32).map(|i| Bytes::from(i.to_string())));
    let path = http::uri::PathAndQuery::from_static("/test.Streams/Count");
    let counted = served
        .grpc
        .client_streaming(call(5, false, messages), path, Raw)
        .await;
    assert_eq!(counted.unwrap_err().code(), Code::ResourceExhausted);

    served.grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/test.Streams/Emit");
    let mut emitted = served
        .grpc
        .server_streaming(call(6, false, Bytes::from_static(b"20")), path, Raw)
        .await
        .unwrap()
        .into_inner();
    for i in 0..5u32 {
        assert_eq!(emitted.next().await.unwrap().unwrap(), i.to_string());
    }
    let status = emitted.next().await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);

    // Within the limit, a count comes back.
    served.clock.advance(Duration::from_secs(1));
    served.grpc.ready().await.unwrap();
    let messages = tokio_stream::iter((0..3u32).map(|i| Bytes::from(i.to_string())));
    let path = http::uri::PathAndQuery::from_static("/test.Streams/Count");
    let counted = served
        .grpc
        .client_streaming(call(5, false, messages), path, Raw)
        .await
        .unwrap();
    assert_eq!(counted.into_inner(), "3");
}

/// A stream holds its account's one slot for its whole life: a second stream of the account is
/// refused by the layer while the first is open; when the first's client goes away (its
/// stream dropped mid-call), the slot comes back and a new stream is admitted. Its meter took
/// the whole burst ahead at its first message (5 units, grants of 10 messages ahead); the 4 it
/// did not use come back too.
#[tokio::test]
async fn a_stream_whose_client_vanishes_gives_back_its_grant_and_its_slot() {
    let mut served = serve().await;
    let account = 107;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(10);
    let mut first = served
        .echo(
            account,
            true,
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )
        .await
        .unwrap();
    tx.send(Bytes::from_static(b"hello")).await.unwrap();
    assert_eq!(first.next().await.unwrap().unwrap(), "hello");
    assert_eq!(messages_left(&served.limiter, account).await, 0);
    let second = served
        .echo(account, true, tokio_stream::iter(Vec::<Bytes>::new()))
        .await;
    assert_eq!(second.unwrap_err().code(), Code::ResourceExhausted);
    // The client vanishes: its request stream and its replies are dropped.
    drop(first);
    drop(tx);
    let limiter = served.limiter.clone();
    wait_for_async(|| {
        let limiter = limiter.clone();
        async move { messages_left(&limiter, account).await == 4 }
    })
    .await;
    let mut admitted = false;
    for _ in 0..200 {
        let one = tokio_stream::iter(vec![Bytes::from_static(b"x")]);
        if let Ok(replies) = served.echo(account, true, one).await {
            let replies: Vec<_> = replies.collect().await;
            assert_eq!(replies.len(), 1);
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(admitted, "the slot came back");
}

/// The messages `account` has left of its burst (a check's `remaining` is what would remain
/// after one more: one more than it, unless none is left).
async fn messages_left(limiter: &Limiter, account: u64) -> u64 {
    let key = limiter
        .key("MessagesPerAccount", Id::from(account))
        .unwrap();
    let checked = limiter
        .check(&[tower_ratelimits::Transaction::new(key)])
        .await
        .unwrap();
    if checked.allowed() {
        checked.decisions()[0].remaining() + 1
    } else {
        0
    }
}

/// Waits (bounded, 5 s) until `done` holds: a condition, not a time.
async fn wait_for_async<F: Future<Output = bool>>(done: impl Fn() -> F) {
    for _ in 0..500 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the condition never held");
}

/// Waits (bounded, 5 s) until `done` holds: a condition, not a time.
async fn wait_for(done: impl Fn() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the condition never held");
}

/// The example's own demo (no `ADDR`): a flood of 20 messages is echoed 5 times, then the
/// stream ends with `RESOURCE_EXHAUSTED` and the exact wait in `RetryInfo`.
#[test]
fn the_example_demo_ends_a_flood_at_the_burst() {
    let exe = std::env::current_exe().unwrap();
    let binary = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("tonic_streams");
    let out = std::process::Command::new(&binary)
        .env_remove("ADDR")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (built by `cargo test`)", binary.display()));
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.matches("echoed: ").count(), 5, "{stdout}");
    assert!(
        stdout.contains("ended: ResourceExhausted") && stdout.contains("retry in Some(100ms)"),
        "{stdout}"
    );
}

/// The meter's keys come from the layer (a rule per message): a call without `x-account` is
/// refused by the layer before any handler runs (`INVALID_ARGUMENT`, nothing taken from its
/// stream), and the account's messages are one limit across its calls: a second stream of
/// the account, after the first spent the burst and ended, ends at its first message.
#[tokio::test]
async fn the_layers_rule_per_message_keys_every_stream_of_an_account() {
    let mut served = serve().await;
    served.grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/test.Streams/Echo");
    let anonymous = tonic::Request::new(tokio_stream::iter([Bytes::from_static(b"x")]));
    let refused = served
        .grpc
        .streaming(anonymous, path, Raw)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(served.taken.load(Ordering::Relaxed), 0);
    let five = tokio_stream::iter((0..5u32).map(|i| Bytes::from(i.to_string())));
    let replies = served.echo(7, false, five).await.unwrap();
    assert_eq!(replies.collect::<Vec<_>>().await.len(), 5);
    // The first stream's slot comes back when its call ends on the server: retried until then.
    for _ in 0..200 {
        let one = tokio_stream::iter([Bytes::from_static(b"late")]);
        if let Ok(mut replies) = served.echo(7, false, one).await {
            let status = replies.next().await.unwrap().unwrap_err();
            assert_eq!(status.code(), Code::ResourceExhausted);
            let details = status.get_error_details();
            let violations = &details.quota_failure().unwrap().violations;
            assert_eq!(violations[0].subject, "MessagesPerAccount");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the first stream's slot never came back");
}
