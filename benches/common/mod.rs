//! Helpers shared by the benches.
#![allow(dead_code)]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

/// Polls a future that completes without waiting (the in-memory backend's futures do) without
/// the cost of a runtime. Panics if it would wait: a bench set-up error, not a request path.
/// Always inlined: the future is built in place and polled there, as an `.await` in the
/// caller's own future would, not moved into this frame first (a move of the limiter's
/// spend future is two copies of some 300 bytes, the harness's cost, not the limiter's).
#[inline(always)]
pub fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the benchmarked future waited"),
    }
}

/// One transaction spent on a backend that answers at once (the in-memory one): its one
/// `spend`, with a batch of one. Panics if it would wait (a bench set-up error).
pub fn spend_one(
    backend: &impl tower_ratelimits::Backend,
    tx: &tower_ratelimits::BucketTx<'_>,
) -> Result<tower_ratelimits::Outcomes, tower_ratelimits::BackendError> {
    match backend.spend(std::slice::from_ref(tx)) {
        tower_ratelimits::Spend::Ready(r) => r,
        tower_ratelimits::Spend::Pending(_) => panic!("the benchmarked spend waited"),
    }
}

pub mod apps;
pub mod handwritten;
pub mod redis_ops;

/// The value after `flag` on the command line.
pub fn arg(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|p| args.get(p + 1))
        .cloned()
}

/// A proxy on a free loopback port in front of `upstream` (`host:port`) that holds every chunk
/// read `delay` plus up to `jitter` (a deterministic sequence) before writing it on, in each
/// direction, in order (a remote store's latency). Blocking threads, two per direction of a
/// connection, sleeping to the microsecond (a tokio timer rounds up to the next millisecond).
pub fn delaying_proxy(
    upstream: String,
    delay: std::time::Duration,
    jitter: std::time::Duration,
) -> u16 {
    delaying_proxy_with_cut(upstream, delay, jitter, std::sync::Arc::default())
}

/// [`delaying_proxy`], cut off while `cut` is set (a network partition): every connection
/// through it is closed within 50 ms, what it held dropped, and new ones are closed at once.
pub fn delaying_proxy_with_cut(
    upstream: String,
    delay: std::time::Duration,
    jitter: std::time::Duration,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> u16 {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::atomic::Ordering;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { continue };
            if cut.load(Ordering::Relaxed) {
                continue;
            }
            let Ok(server) = TcpStream::connect(&upstream) else {
                continue;
            };
            let _ = (client.set_nodelay(true), server.set_nodelay(true));
            let pipes = [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ];
            for (mut from, mut to) in pipes {
                let (tx, rx) = std::sync::mpsc::channel::<(std::time::Instant, Vec<u8>)>();
                let _ = from.set_read_timeout(Some(std::time::Duration::from_millis(50)));
                let (cut_r, cut_w) = (cut.clone(), cut.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
                    loop {
                        if cut_r.load(Ordering::Relaxed) {
                            let _ = from.shutdown(Shutdown::Both);
                            break;
                        }
                        let n = match from.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => n,
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) =>
                            {
                                continue;
                            }
                            Err(_) => break,
                        };
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        let extra = jitter.as_micros() as u64;
                        let held = delay + std::time::Duration::from_micros(seed % (extra + 1));
                        if tx
                            .send((std::time::Instant::now() + held, buf[..n].to_vec()))
                            .is_err()
                        {
                            break;
                        }
                    }
                });
                std::thread::spawn(move || {
                    while let Ok((at, chunk)) = rx.recv() {
                        let now = std::time::Instant::now();
                        if at > now {
                            std::thread::sleep(at - now);
                        }
                        if cut_w.load(Ordering::Relaxed) {
                            let _ = to.shutdown(Shutdown::Both);
                            break;
                        }
                        if to.write_all(&chunk).is_err() {
                            break;
                        }
                    }
                });
            }
        }
    });
    port
}
