//! gRPC end to end: a tonic server behind the layer on an ephemeral port, a real tonic client.
//! Needs feature `tonic` (for the peer address from `TcpConnectInfo`).

use std::time::Duration;

use tonic::Code;
use tonic::transport::{Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower_ratelimits::{ClientIp, CountWhen, Header, Id, RateLimitLayer, Rule};
use tower_ratelimits::{Limiter, Limits, ManualClock, MemoryBackend};

/// tonic's health service (the server itself `SERVING`) behind `layer` on an ephemeral port,
/// and a real tonic client of it.
async fn serve_health(
    layer: RateLimitLayer,
) -> (
    HealthClient<tonic::transport::Channel>,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (HealthClient::new(channel), server)
}

#[tokio::test]
async fn a_limited_grpc_client_sees_resource_exhausted_with_a_retry_hint() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits =
        Limits::from_yaml_str("Calls: {kind: ip, burst: 2, count: 1, period: 4s}\n", None).unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let layer = RateLimitLayer::new(limiter, [Rule::new("Calls", ClientIp::new())]).unwrap();
    let (mut client, server) = serve_health(layer).await;
    let check = || HealthCheckRequest {
        service: String::new(),
    };

    for _ in 0..2 {
        let r = client.check(check()).await.unwrap();
        assert_eq!(
            r.metadata().get("ratelimit-policy").unwrap(),
            "\"Calls\";q=2;w=8"
        );
    }
    // 2.4997 s to wait: every field and text gives the same wait, rounded up to the
    // millisecond (2.5 s) or the second (3 s). RetryInfo said 2.4997 s.
    clock.advance(Duration::from_micros(1_500_300));
    let status = client.check(check()).await.unwrap_err();
    assert_eq!(
        status.code(),
        Code::ResourceExhausted,
        "not Unavailable: clients must not retry at once"
    );
    assert_eq!(
        status.message(),
        "rate limit Calls exceeded; retry after 2.5 s"
    );
    assert_eq!(
        status.metadata().get("retry-after").unwrap(),
        "3",
        "2.5s rounded up"
    );
    // gRPC's retry pushback: the wait in whole milliseconds, so a client whose retry
    // policy lists RESOURCE_EXHAUSTED backs off by itself.
    assert_eq!(
        status.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "2500"
    );
    // Draft-11: `t` is the wait before one call passes (2.5 s, rounded up), not the time until
    // the bucket is full; never later than `retry-after`.
    assert_eq!(
        status.metadata().get("ratelimit").unwrap(),
        "\"Calls\";r=0;t=3"
    );
    // The standard error details, read the way any client reads them: the exact delay, and
    // the limit that refused.
    {
        use tonic_types::StatusExt;
        let details = status.get_error_details();
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_millis(2500))
        );
        let violations = &details.quota_failure().unwrap().violations;
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].subject, "Calls");
        assert!(
            violations[0].description.ends_with("retry after 2.5 s"),
            "{}",
            violations[0].description
        );
    }
    // One emission interval after the burst, one call fits again; the channel still works.
    clock.advance(Duration::from_micros(2_499_700));
    client.check(check()).await.unwrap();
    assert_eq!(
        client.check(check()).await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    server.abort();
}

/// The example with `ADDR` set serves until stopped; a real tonic client calling it reads the
/// standard `RetryInfo` and `QuotaFailure` details of the fourth call.
#[tokio::test]
async fn the_example_serves_on_addr_until_stopped() {
    use tonic_types::StatusExt;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let exe = std::env::current_exe().unwrap();
    let binary = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("tonic_grpc");
    let mut child = std::process::Command::new(&binary)
        .env("ADDR", format!("127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e} (built by `cargo test`)", binary.display()));
    let url = format!("http://127.0.0.1:{port}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let channel = loop {
        match Endpoint::from_shared(url.clone()).unwrap().connect().await {
            Ok(c) => break c,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    let mut client = HealthClient::new(channel);
    let check = || HealthCheckRequest {
        service: String::new(),
    };
    for _ in 0..3 {
        client.check(check()).await.unwrap();
    }
    let status = client.check(check()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    let details = status.get_error_details();
    let delay = details.retry_info().unwrap().retry_delay.unwrap();
    assert!(
        delay > Duration::ZERO && delay <= Duration::from_secs(1),
        "{delay:?}"
    );
    assert_eq!(
        details.quota_failure().unwrap().violations[0].subject,
        "GrpcCallsPerIPAddress"
    );
    // Still serving: it does not exit on its own.
    assert!(child.try_wait().unwrap().is_none());
    let _ = child.kill();
    let _ = child.wait();
}

/// A health service that answers every `Watch` with one message and then, in the trailers,
/// the status the request's `x-outcome` names (`14`: UNAVAILABLE): a streamed gRPC answer
/// whose failure comes after its head.
#[derive(Clone)]
struct StreamThenStatus;

impl tonic::server::NamedService for StreamThenStatus {
    const NAME: &'static str = "grpc.health.v1.Health";
}

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for StreamThenStatus {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let status = request
            .headers()
            .get("x-outcome")
            .cloned()
            .unwrap_or(http::HeaderValue::from_static("0"));
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", status);
        // An empty HealthCheckResponse: uncompressed, length 0.
        let message = bytes::Bytes::from_static(&[0, 0, 0, 0, 0]);
        let frames = [
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(message)),
            Ok(http_body::Frame::trailers(trailers)),
        ];
        let body =
            tonic::body::Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)));
        let response = http::Response::builder()
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap();
        std::future::ready(Ok(response))
    }
}

/// An adaptive concurrency limit behind tonic, called by a real tonic client: a server stream
/// that fails in its trailers (`UNAVAILABLE` after a message) is a failure to the limit, as a
/// failure in the head is, and backs the key off; one that ends with `OK` does not.
#[tokio::test]
async fn a_stream_failing_in_its_trailers_backs_an_adaptive_key_off() {
    let limits = Limits::from_yaml_str(
        "Streams: {kind: account, concurrency: {adaptive: {min: 1, initial: 4, max: 8, algorithm: aimd, backoff: 50, completions: 2}}}\n",
        None,
    )
    .unwrap();
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(limits, backend.clone());
    let layer = RateLimitLayer::new(
        limiter.clone(),
        [Rule::new("Streams", Header::new("x-account"))],
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(StreamThenStatus)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let key = limiter.key("Streams", Id::from(7u64)).unwrap();
    let state = || backend.adaptive_state(&key).unwrap();
    for (outcome, code, number) in [("0", Code::Ok, 4_000), ("14", Code::Unavailable, 2_000)] {
        for n in 1..=2 {
            let mut request = tonic::Request::new(HealthCheckRequest {
                service: String::new(),
            });
            request
                .metadata_mut()
                .insert("x-account", "7".parse().unwrap());
            request
                .metadata_mut()
                .insert("x-outcome", outcome.parse().unwrap());
            let mut stream = client.watch(request).await.unwrap().into_inner();
            assert!(stream.message().await.unwrap().is_some(), "the message");
            // What the client reads after the message: the status in the trailers.
            let end = stream.message().await;
            match code {
                Code::Ok => assert!(end.unwrap().is_none()),
                code => assert_eq!(end.unwrap_err().code(), code),
            }
            drop(stream);
            // The slot is given back when the server has sent the trailers.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while state().window.completions != n % 2 || !state().leases.is_empty() {
                assert!(std::time::Instant::now() < deadline, "never given back");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert_eq!(
            state().controller.limit_milli,
            number,
            "after x-outcome {outcome}"
        );
    }
    server.abort();
}

/// Failed calls counted by their gRPC status, called by a real tonic client: a call refused at
/// once carries its status in its head (`NOT_FOUND`, an unknown service), an answered one in
/// its trailers after its message (`OK`). Only the failures count, two units each; once they
/// fill the limit, the next call is refused before it reaches the service.
#[tokio::test]
async fn failed_calls_count_by_their_grpc_status_in_the_head_or_the_trailers() {
    let limits = Limits::from_yaml_str(
        "Misses: {kind: account, burst: 4, count: 4, period: 1h}\n",
        None,
    )
    .unwrap();
    let limiter = Limiter::new(limits, MemoryBackend::new());
    let rule = Rule::new("Misses", Header::new("x-account"))
        .count_when(CountWhen::new().grpc_status(0, 0).grpc_status(5, 2));
    let layer = RateLimitLayer::new(limiter.clone(), [rule]).unwrap();
    let (mut client, server) = serve_health(layer).await;
    let key = limiter.key("Misses", Id::from(7u64)).unwrap();
    // The settle runs when the body ends, after the client has its answer: wait for it.
    let settles_to = |remaining: u64| {
        let (limiter, key) = (limiter.clone(), key.clone());
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let probe = tower_ratelimits::Transaction::new(key.clone()).cost(0);
                let now = limiter.check(&[probe]).await.unwrap().decisions()[0].remaining();
                if now == remaining {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{now} left, not {remaining}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    for _ in 0..3 {
        client.check(as_account_7("")).await.unwrap();
        settles_to(4).await;
    }
    for left in [2, 0] {
        let status = client.check(as_account_7("unknown")).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
        settles_to(left).await;
    }
    let status = client.check(as_account_7("")).await.unwrap_err();
    assert_eq!(
        status.code(),
        Code::ResourceExhausted,
        "refused before the service"
    );
    server.abort();
}

/// A penalty ladder on a gRPC limit: failed calls (`NOT_FOUND`) count, the second bans the
/// account for 30 s, and the banned call is told so, with the ban's end in `RetryInfo`.
#[tokio::test]
async fn a_banned_caller_reads_the_ban_and_its_end_in_the_standard_details() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::from_yaml_str(
        "Misses: {kind: account, burst: 100, count: 100, period: 1h, penalty: {after: 2, within: 1m, base: 30s, factor: 2, max: 1h}}\n",
        None,
    )
    .unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let rule = Rule::new("Misses", Header::new("x-account"))
        .count_when(CountWhen::new().grpc_status(5, 1));
    let layer = RateLimitLayer::new(limiter.clone(), [rule]).unwrap();
    let (mut client, server) = serve_health(layer).await;
    let key = limiter.key("Misses", Id::from(7u64)).unwrap();
    // The settle runs when the body ends, after the client has its answer: wait for the ban.
    let banned = || {
        let (limiter, key) = (limiter.clone(), key.clone());
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let probe = tower_ratelimits::Transaction::new(key.clone()).cost(0);
                if !limiter.check(&[probe]).await.unwrap().allowed() {
                    return;
                }
                assert!(std::time::Instant::now() < deadline, "never banned");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    for _ in 0..2 {
        let status = client.check(as_account_7("unknown")).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
    }
    banned().await;
    let status = client.check(as_account_7("")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(
        status.message(),
        "rate limit Misses: banned by its penalty; retry after 30 s"
    );
    assert_eq!(status.metadata().get("retry-after").unwrap(), "30");
    {
        use tonic_types::StatusExt;
        let details = status.get_error_details();
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(30))
        );
    }
    clock.advance(Duration::from_secs(30));
    client.check(as_account_7("")).await.unwrap();
    server.abort();
}

/// A health check of `service` sent for the account `7` (its `x-account` metadata).
fn as_account_7(service: &str) -> tonic::Request<HealthCheckRequest> {
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: service.to_owned(),
    });
    request
        .metadata_mut()
        .insert("x-account", "7".parse().unwrap());
    request
}
