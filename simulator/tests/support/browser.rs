//! A real headless Chromium, driven over the DevTools protocol on a pipe
//! (`--remote-debugging-pipe`: commands on the browser's fd 3, replies and events on its fd 4,
//! each message JSON ended by a NUL byte). No port, no WebSocket, no driver binary.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// How long any one browser step may take (a bound against a hung browser, not a timing
/// assertion: a busy machine only makes it slower).
const STEP: Duration = Duration::from_secs(120);

/// The browser binary: `$TRL_CHROMIUM`, else the first of Debian's and Google's names on the
/// `PATH`.
pub fn find() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TRL_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for name in [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    None
}

/// A browser with one page attached.
pub struct Browser {
    child: Child,
    commands: std::io::PipeWriter,
    messages: Receiver<Value>,
    session: String,
    next_id: u64,
    /// Every event received so far (with a `method`), in order.
    pub events: Vec<Value>,
}

impl Browser {
    /// Starts `binary` headless with its profile in `profile` (an empty directory the caller
    /// removes) and opens a blank page.
    pub fn start(binary: &Path, profile: &Path) -> Browser {
        let (browser_reads, commands) = std::io::pipe().unwrap();
        let (replies, browser_writes) = std::io::pipe().unwrap();
        let (r, w) = (browser_reads.as_raw_fd(), browser_writes.as_raw_fd());
        let mut command = Command::new(binary);
        command
            .args([
                "--headless",
                "--remote-debugging-pipe",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--hide-scrollbars",
                "--mute-audio",
                "--window-size=1440,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: between fork and exec only async-signal-safe calls (fcntl, dup2). Both
        // descriptors are first copied above 10, so placing them at 3 and 4 cannot overwrite
        // one with the other; the copies made by dup2 do not close on exec.
        unsafe {
            command.pre_exec(move || {
                let r2 = libc::fcntl(r, libc::F_DUPFD, 10);
                let w2 = libc::fcntl(w, libc::F_DUPFD, 10);
                if r2 < 0 || w2 < 0 || libc::dup2(r2, 3) < 0 || libc::dup2(w2, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().unwrap();
        drop(browser_reads);
        drop(browser_writes);
        let (tx, messages) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(replies);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.read_until(0, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                if buf.last() == Some(&0) {
                    buf.pop();
                }
                let Ok(v) = serde_json::from_slice::<Value>(&buf) else {
                    continue;
                };
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        let mut browser = Browser {
            child,
            commands,
            messages,
            session: String::new(),
            next_id: 0,
            events: Vec::new(),
        };
        let target = browser.call_browser("Target.createTarget", json!({"url": "about:blank"}));
        let target_id = target["targetId"].as_str().unwrap().to_owned();
        let attached = browser.call_browser(
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
        );
        browser.session = attached["sessionId"].as_str().unwrap().to_owned();
        for domain in ["Page", "Runtime", "Log", "Network"] {
            browser.call(&format!("{domain}.enable"), json!({}));
        }
        browser
    }

    fn send(&mut self, method: &str, params: Value, session: bool) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if session {
            message["sessionId"] = json!(self.session);
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.commands.write_all(&bytes).unwrap();
        let deadline = Instant::now() + STEP;
        loop {
            let m = self.receive(deadline, method);
            if m["id"] == json!(id) {
                if let Some(e) = m.get("error") {
                    panic!("{method}: {e}");
                }
                return m["result"].clone();
            }
        }
    }

    fn receive(&mut self, deadline: Instant, waiting_for: &str) -> Value {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.messages.recv_timeout(left) {
            Ok(m) => {
                if m.get("method").is_some() {
                    self.events.push(m.clone());
                }
                m
            }
            Err(RecvTimeoutError::Timeout) => panic!("the browser did not answer {waiting_for}"),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("the browser exited while waiting for {waiting_for}")
            }
        }
    }

    fn call_browser(&mut self, method: &str, params: Value) -> Value {
        self.send(method, params, false)
    }

    /// A command to the page; its result.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.send(method, params, true)
    }

    /// Opens `url` and waits for its `load` event.
    pub fn open(&mut self, url: &str) {
        let before = self.events.len();
        self.call("Page.navigate", json!({"url": url}));
        let loaded = |events: &[Value]| {
            events[before..]
                .iter()
                .any(|e| e["method"] == "Page.loadEventFired")
        };
        let deadline = Instant::now() + STEP;
        while !loaded(&self.events) {
            self.receive(deadline, "the page's load event");
        }
    }

    /// Evaluates a JavaScript expression in the page; its value (JSON-serializable values).
    pub fn eval(&mut self, expression: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true}),
        );
        if let Some(e) = r.get("exceptionDetails") {
            panic!("{expression}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// A PNG screenshot of the page.
    pub fn screenshot(&mut self) -> Vec<u8> {
        use base64::Engine;
        let r = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true}),
        );
        base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .unwrap()
    }

    /// The requests the page made (their URLs), from the Network domain's events.
    /// The requests the page made outside itself (not `file:`, `about:` or `data:`).
    pub fn outside_requests(&self) -> Vec<String> {
        self.requests()
            .into_iter()
            .filter(|u| {
                !u.starts_with("file://") && !u.starts_with("about:") && !u.starts_with("data:")
            })
            .collect()
    }

    pub fn requests(&self) -> Vec<String> {
        self.events
            .iter()
            .filter(|e| e["method"] == "Network.requestWillBeSent")
            .map(|e| {
                e["params"]["request"]["url"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned()
            })
            .collect()
    }

    /// Console errors, uncaught exceptions and error log entries, as text.
    pub fn errors(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| {
                let p = &e["params"];
                match e["method"].as_str()? {
                    "Runtime.exceptionThrown" => {
                        Some(format!("exception: {}", p["exceptionDetails"]))
                    }
                    "Runtime.consoleAPICalled"
                        if matches!(p["type"].as_str(), Some("error" | "assert" | "warning")) =>
                    {
                        Some(format!("console.{}: {}", p["type"], p["args"]))
                    }
                    "Log.entryAdded"
                        if matches!(p["entry"]["level"].as_str(), Some("error" | "warning")) =>
                    {
                        Some(format!("log: {}", p["entry"]))
                    }
                    _ => None,
                }
            })
            .collect()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
