//! A Redis for the simulator's `--redis` tests: the one `.ci/run` started
//! (`TRL_TEST_REDIS_URL`), or a `redis-server` of the test's own, killed when dropped.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::process::Command;

pub struct Server(Option<std::process::Child>, pub String);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Server {
    /// The shared server when `.ci/run` started one, else a new one.
    pub fn shared_or_own() -> Server {
        match std::env::var("TRL_TEST_REDIS_URL") {
            Ok(url) => Server(None, url),
            Err(_) => Server::own(),
        }
    }

    /// A new server on a free loopback port.
    pub fn own() -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (bash scripts/test installs it)");
        for _ in 0..500 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Server(Some(child), format!("redis://127.0.0.1:{port}"))
    }

    /// Sends one command (its words, none holding a space) and returns the raw reply.
    pub fn command(&self, words: &[&str]) -> String {
        let address = self.1.trim_start_matches("redis://");
        let mut s = std::net::TcpStream::connect(address).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut out = format!("*{}\r\n", words.len());
        for w in words {
            out.push_str(&format!("${}\r\n{w}\r\n", w.len()));
        }
        s.write_all(out.as_bytes()).unwrap();
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
}
