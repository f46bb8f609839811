//! Limits inside gRPC streams, end to end: a tonic server on an ephemeral port whose handlers
//! meter every message with `LimitedStream` (feature `stream`), called by a real tonic client
//! for each stream kind (bidirectional, client and server streaming). Messages are raw bytes
//! (a codec of our own: no protobuf build step). Asserted as counts on a manual clock.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use tokio_stream::{Stream, StreamExt};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status, Streaming};
use tonic_types::StatusExt;
use tower_ratelimits::{AtLimit, Header, Id, LimitedStream, Limiter, Limits, ManualClock};
use tower_ratelimits::{MemoryBackend, RateLimitLayer, Rule, StreamMeter};

/// Messages as they are: raw bytes in, raw bytes out.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n)))
    }
}

type Replies = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;
type Answer<T> = Pin<Box<dyn Future<Output = Result<tonic::Response<T>, Status>> + Send>>;

/// What the server's handlers share: the limiter, and how many messages they took from the
/// client's streams (a flood held back is not read).
#[derive(Clone)]
struct Streams {
    limiter: Limiter,
    taken: Arc<AtomicU64>,
}

impl Streams {
    /// The meter of a call: per message of the caller's `x-account`, pushing back for up to an
    /// hour when the call says `x-at-limit: push-back`, ending the stream otherwise.
    fn meter<T>(&self, request: &tonic::Request<T>) -> Result<StreamMeter, Status> {
        let account = request
            .metadata()
            .get("x-account")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .ok_or_else(|| Status::invalid_argument("x-account"))?;
        let at_limit = match request.metadata().get("x-at-limit") {
            Some(v) if v == "push-back" => AtLimit::PushBack {
                up_to: Duration::from_secs(3600),
            },
            _ => AtLimit::End,
        };
        let key = self
            .limiter
            .key("MessagesPerAccount", Id::from(account))
            .map_err(|e| Status::internal(e.to_string()))?;
        let ahead = match request.metadata().get("x-ahead") {
            Some(v) => v.to_str().ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            None => 0,
        };
        StreamMeter::builder(&self.limiter)
            .per_message(key)
            .at_limit(at_limit)
            .ahead(ahead)
            .build()
            .map_err(|e| Status::internal(e.to_string()))
    }

    /// The client's messages, counted as they are taken, each admitted by `meter`.
    fn inbound(&self, messages: Streaming<Bytes>, meter: StreamMeter) -> Replies {
        let taken = self.taken.clone();
        let counted = messages.map(move |m| {
            taken.fetch_add(1, Ordering::Relaxed);
            m
        });
        Box::pin(LimitedStream::new(counted, meter).grpc())
    }
}

/// `Echo`: every message the client sends comes back (bidirectional).
struct Echo(Streams);

impl tonic::server::StreamingService<Bytes> for Echo {
    type Response = Bytes;
    type ResponseStream = Replies;
    type Future = Answer<Replies>;
    fn call(&mut self, request: tonic::Request<Streaming<Bytes>>) -> Self::Future {
        let streams = self.0.clone();
        Box::pin(async move {
            let meter = streams.meter(&request)?;
            Ok(tonic::Response::new(
                streams.inbound(request.into_inner(), meter),
            ))
        })
    }
}

/// `Count`: how many messages the client sent (client streaming); at a limit, the status.
struct Count(Streams);

impl tonic::server::ClientStreamingService<Bytes> for Count {
    type Response = Bytes;
    type Future = Answer<Bytes>;
    fn call(&mut self, request: tonic::Request<Streaming<Bytes>>) -> Self::Future {
        let streams = self.0.clone();
        Box::pin(async move {
            let meter = streams.meter(&request)?;
            let mut inbound = streams.inbound(request.into_inner(), meter);
            let mut n = 0u64;
            while let Some(m) = inbound.next().await {
                m?;
                n += 1;
            }
            Ok(tonic::Response::new(Bytes::from(n.to_string())))
        })
    }
}

/// `Emit`: as many messages as the request asks for (server streaming), each admitted before
/// it is sent.
struct Emit(Streams);

impl tonic::server::ServerStreamingService<Bytes> for Emit {
    type Response = Bytes;
    type ResponseStream = Replies;
    type Future = Answer<Replies>;
    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let streams = self.0.clone();
        Box::pin(async move {
            let meter = streams.meter(&request)?;
            let n: u64 = std::str::from_utf8(request.get_ref())
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| Status::invalid_argument("a count"))?;
            let outbound = tokio_stream::iter(0..n).map(|i| Ok(Bytes::from(i.to_string())));
            let limited: Replies = Box::pin(LimitedStream::new(outbound, meter).grpc());
            Ok(tonic::Response::new(limited))
        })
    }
}

/// The service: `/test.Streams/{Echo,Count,Emit}`.
#[derive(Clone)]
struct StreamsServer(Streams);

impl tonic::server::NamedService for StreamsServer {
    const NAME: &'static str = "test.Streams";
}

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for StreamsServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let streams = self.0.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(Raw);
            Ok(match request.uri().path() {
                "/test.Streams/Echo" => grpc.streaming(Echo(streams), request).await,
                "/test.Streams/Count" => grpc.client_streaming(Count(streams), request).await,
                "/test.Streams/Emit" => grpc.server_streaming(Emit(streams), request).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

const LIMITS: &str = "\
MessagesPerAccount: {kind: account, burst: 5, count: 10, period: 1s}
StreamsPerAccount: {kind: account, concurrency: 1, lease: 1m}
";

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
    let layer = RateLimitLayer::new(
        limiter.clone(),
        [Rule::new("StreamsPerAccount", Header::new("x-account"))],
    )
    .unwrap();
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
