//! A tonic streaming service with limits inside its streams (feature `stream`): every message
//! a client sends on a stream is counted against its account's limit before the handler sees
//! it, and a stream holds its account's one slot for its whole life.
//!
//! ```text
//! cargo run -p tonic-example --example tonic_streams
//! ```
//!
//! Messages are raw bytes (a codec of a few lines: no protobuf compiler needed); the service
//! `test.Streams` has `Echo` (bidirectional: every message comes back), `Count` (client
//! streaming: how many were sent) and `Emit` (server streaming: as many as asked for). The
//! caller names its account in `x-account`; `x-at-limit: push-back` holds its messages at the
//! limit instead of ending the stream; `x-ahead: N` takes grants of N messages ahead.
//!
//! - Without `ADDR`: a self-contained demo. A client floods an `Echo` stream with 20
//!   messages: 5 come back (the burst), then the stream ends with `RESOURCE_EXHAUSTED` and the
//!   exact wait in `RetryInfo`, read from the trailers through `tonic-types`.
//! - With `ADDR` (e.g. `ADDR=127.0.0.1:50052`): it serves there until stopped (Ctrl-C or
//!   SIGTERM).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use tokio_stream::{Stream, StreamExt};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Endpoint, Server};
use tonic::{Status, Streaming};
use tonic_types::StatusExt as _;
use tower_ratelimits::{AtLimit, Header, LimitedStream, Limiter, Limits, MemoryBackend, Per};
use tower_ratelimits::{RateLimitLayer, Rule, StreamKeys, StreamMeter};

/// Messages as they are: raw bytes in, raw bytes out.
#[derive(Clone, Copy, Default)]
pub struct Raw;

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
pub struct Streams {
    pub limiter: Limiter,
    /// How many messages the handlers took from the clients' streams.
    pub taken: Arc<AtomicU64>,
}

impl Streams {
    /// The meter of a call: the keys the layer's per-message rule found (`MessagesPerAccount`,
    /// per message of the caller's `x-account`), pushing back for up to an hour when the call
    /// says `x-at-limit: push-back`, ending the stream otherwise (the rule's `at_limit`).
    fn meter<T>(&self, request: &tonic::Request<T>) -> Result<StreamMeter, Status> {
        // The layer refuses a call without `x-account`: every call here has its keys.
        let keys = request
            .extensions()
            .get::<StreamKeys>()
            .ok_or_else(|| Status::internal("no stream keys: is the layer in front?"))?;
        let meter = match request.metadata().get("x-at-limit") {
            Some(v) if v == "push-back" => keys.meter().at_limit(AtLimit::PushBack {
                up_to: Duration::from_secs(3600),
            }),
            _ => keys.meter(),
        };
        let ahead = match request.metadata().get("x-ahead") {
            Some(v) => v.to_str().ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            None => 0,
        };
        meter
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
pub struct StreamsServer(pub Streams);

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

/// The limits: 5 messages at once per account, then 10 a second; one stream at once.
pub const LIMITS: &str = "\
MessagesPerAccount: {kind: account, burst: 5, count: 10, period: 1s}
StreamsPerAccount: {kind: account, concurrency: 1, lease: 1m}
";

/// The layer of the service: one stream at once per account (its slot held for the stream's
/// whole life), and the account's messages (a rule per message: its key handed to the
/// handler, which meters the stream with it).
pub fn layer(limiter: &Limiter) -> RateLimitLayer {
    let streams = Rule::new("StreamsPerAccount", Header::new("x-account"));
    let messages = Rule::new("MessagesPerAccount", Header::new("x-account"))
        .per(Per::Message)
        .at_limit(AtLimit::End);
    match RateLimitLayer::new(limiter.clone(), [streams, messages]) {
        Ok(layer) => layer,
        Err(e) => panic!("the example's rule names its limit: {e}"),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let serve_only = std::env::var_os("ADDR").is_some();
    let addr: SocketAddr = match std::env::var("ADDR") {
        Ok(addr) => addr.parse().map_err(|e| format!("ADDR {addr:?}: {e}"))?,
        Err(_) => "127.0.0.1:0".parse()?,
    };
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None)?, MemoryBackend::new());
    let service = StreamsServer(Streams {
        limiter: limiter.clone(),
        taken: Arc::default(),
    });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let server = Server::builder()
        .layer(layer(&limiter))
        .add_service(service)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        );
    if serve_only {
        println!("serving test.Streams on {addr}");
        server.await?;
        return Ok(());
    }
    tokio::spawn(server);
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await?;
    let flood = tokio_stream::iter((0..20u32).map(|i| Bytes::from(format!("message {i}"))));
    let mut request = tonic::Request::new(flood);
    request.metadata_mut().insert("x-account", "7".parse()?);
    let path = http::uri::PathAndQuery::from_static("/test.Streams/Echo");
    let mut replies = grpc.streaming(request, path, Raw).await?.into_inner();
    while let Some(reply) = replies.next().await {
        match reply {
            Ok(message) => println!("echoed: {}", String::from_utf8_lossy(&message)),
            Err(status) => {
                let wait = status
                    .get_error_details()
                    .retry_info()
                    .and_then(|r| r.retry_delay);
                println!(
                    "ended: {:?}, {} (retry in {wait:?})",
                    status.code(),
                    status.message()
                );
            }
        }
    }
    Ok(())
}
