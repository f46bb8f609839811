//! Reloading limits from their YAML files when they change, and on SIGHUP.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use notify::Watcher as _;
use tokio::sync::mpsc;

use crate::config::Limits;
use crate::config::LimitsChange;
use crate::limiter::{Limiter, ReloadError};

/// What one reload attempt gave: what changed, or why the files were refused (the previous
/// limits then stay in force).
pub type ReloadReport = Result<LimitsChange, ReloadError>;

/// Why a [`LimitsWatcher`] could not start.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum WatchError {
    /// The system's file watcher cannot be started.
    #[error("cannot start a file watcher: {0}")]
    Watcher(std::io::Error),
    /// A file's directory cannot be watched.
    #[error("cannot watch {path}: {source}")]
    Watch {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// SIGHUP cannot be listened for.
    #[error("cannot listen for SIGHUP: {0}")]
    Signal(std::io::Error),
    /// Not inside a tokio runtime.
    #[error("a LimitsWatcher must be started inside a tokio runtime")]
    NoRuntime,
}

readable_debug!(WatchError { Watcher(error), Watch { path, source }, Signal(error), NoRuntime });

/// How long to wait after a change for the rest of it (an editor writes in several steps).
const SETTLE: Duration = Duration::from_millis(150);

/// How long changed files must stay unchanged before they are read: a file written in place
/// with a pause (a slow writer, a copy over a network) is not applied half-written, as long as
/// the pause is shorter than this. Write-then-rename is never seen half-written at all.
const STABLE: Duration = Duration::from_millis(500);

/// The files' signatures once they stopped changing: read, then read again [`STABLE`] later,
/// until two reads agree.
async fn stable_signatures(mut read: impl FnMut() -> Vec<Signature>) -> Vec<Signature> {
    let mut last = read();
    loop {
        tokio::time::sleep(STABLE).await;
        let now = read();
        if now == last {
            return now;
        }
        last = now;
    }
}

/// Reloads a [`Limiter`]'s limits from YAML files when they change and on SIGHUP (Unix), until
/// dropped.
///
/// It watches the files' directories (so a file replaced by rename, as editors and
/// Kubernetes ConfigMaps do, is seen), waits 150 ms for a change to settle, and reloads when a
/// file's size, modification time or inode changed and then stayed unchanged for 500 ms (a
/// file written in place with a pause is not applied half-written); SIGHUP always reloads, at
/// once. Edit by writing a new file beside the old one and renaming it over it: a rename is
/// atomic, so no reader ever sees half a file. Each attempt goes through [`Limiter::reload`]:
/// validated completely first, applied atomically, and a refused file (its error names the
/// file, line and limit) leaves the previous limits in force.
/// [`spawn`](Self::spawn) logs every attempt (`info` with what changed, `error` with why a
/// file was refused, on the target `tower_ratelimits::reload`);
/// [`spawn_with`](Self::spawn_with) hands each to a function instead.
///
/// ```no_run
/// use tower_ratelimits::{Limiter, Limits, LimitsWatcher, MemoryBackend};
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let limits = Limits::from_yaml_files("ratelimits.yaml", Some("overrides.yaml"))?;
/// let limiter = Limiter::new(limits, MemoryBackend::new());
/// let _watcher = LimitsWatcher::spawn(limiter.clone(), "ratelimits.yaml", Some("overrides.yaml"))?;
/// // ... build the layer on `limiter` and serve; keep `_watcher` alive.
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct LimitsWatcher {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for LimitsWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A file's identity as far as changes go: size, modification time and (Unix) inode.
type Signature = Option<(u64, Option<SystemTime>, u64)>;

fn signature(path: &Path) -> Signature {
    let m = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let inode = 0;
    Some((m.len(), m.modified().ok(), inode))
}

fn log_report(files: &str, report: &ReloadReport) {
    match report {
        Ok(change) => {
            tracing::info!(target: crate::telemetry::target::RELOAD, "rate limits reloaded from {files}: {change}")
        }
        Err(e) => {
            tracing::error!(target: crate::telemetry::target::RELOAD, "rate limits not reloaded, the previous limits stay in force: {e}")
        }
    }
}

impl LimitsWatcher {
    /// Watches `defaults` and `overrides` and reloads `limiter` from them, logging each
    /// attempt.
    pub fn spawn(
        limiter: Limiter,
        defaults: impl Into<PathBuf>,
        overrides: Option<impl Into<PathBuf>>,
    ) -> Result<Self, WatchError> {
        let defaults = defaults.into();
        let overrides = overrides.map(Into::into);
        let files = match &overrides {
            Some(o) => format!("{} and {}", defaults.display(), o.display()),
            None => defaults.display().to_string(),
        };
        Self::spawn_with(limiter, defaults, overrides, move |report| {
            log_report(&files, report)
        })
    }

    /// Watches `defaults` and `overrides`, reloads `limiter` from them, and calls `on_reload`
    /// with each attempt's report (instead of logging it).
    pub fn spawn_with(
        limiter: Limiter,
        defaults: impl Into<PathBuf>,
        overrides: Option<impl Into<PathBuf>>,
        on_reload: impl Fn(&ReloadReport) + Send + Sync + 'static,
    ) -> Result<Self, WatchError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| WatchError::NoRuntime)?;
        let defaults: PathBuf = defaults.into();
        let overrides: Option<PathBuf> = overrides.map(Into::into);
        let files: Vec<PathBuf> = std::iter::once(defaults.clone())
            .chain(overrides.clone())
            .collect();

        // Any event in a file's directory wakes the task; it then compares signatures.
        let (wake, mut woken) = mpsc::channel::<()>(1);
        let watcher = watch_dirs(&files, wake)?;
        #[cfg(unix)]
        let mut hangup = {
            let _guard = runtime.enter();
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .map_err(WatchError::Signal)?
        };

        // The files as they are now: what the limiter was (presumably) just loaded from.
        let signatures = |files: &[PathBuf]| files.iter().map(|f| signature(f)).collect();
        let mut seen: Vec<Signature> = signatures(&files);
        let task = runtime.spawn(async move {
            let _watcher = watcher;
            loop {
                #[cfg(unix)]
                let forced = tokio::select! {
                    w = woken.recv() => { if w.is_none() { return; } false }
                    s = hangup.recv() => { if s.is_none() { return; } true }
                };
                #[cfg(not(unix))]
                let forced = {
                    if woken.recv().await.is_none() {
                        return;
                    }
                    false
                };
                if !forced {
                    // Let the change settle, then take what else came meanwhile.
                    tokio::time::sleep(SETTLE).await;
                    while woken.try_recv().is_ok() {}
                }
                let now: Vec<Signature> = signatures(&files);
                if !forced && now == seen {
                    continue;
                }
                // Changed: read it only once it stays unchanged (SIGHUP reads at once).
                let now = if forced {
                    now
                } else {
                    let now = stable_signatures(|| signatures(&files)).await;
                    while woken.try_recv().is_ok() {}
                    now
                };
                seen = now;
                let (limiter, defaults, overrides) =
                    (limiter.clone(), defaults.clone(), overrides.clone());
                let report = tokio::task::spawn_blocking(move || {
                    let limits = Limits::from_yaml_files(&defaults, overrides.as_ref())?;
                    limiter.reload(limits)
                })
                .await;
                match report {
                    Ok(report) => on_reload(&report),
                    Err(e) => tracing::error!(target: crate::telemetry::target::RELOAD, "rate limits reload failed: {e}"),
                }
            }
        });
        Ok(Self { task })
    }
}

/// A watcher of the directories of `files` (each once), waking `wake` on any event in them.
fn watch_dirs(
    files: &[PathBuf],
    wake: mpsc::Sender<()>,
) -> Result<notify::RecommendedWatcher, WatchError> {
    let mut watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| {
        let _ = wake.try_send(());
    })
    .map_err(|e| WatchError::Watcher(std::io::Error::other(e)))?;
    let mut dirs: Vec<PathBuf> = Vec::new();
    for file in files {
        let dir = match file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dirs.contains(&dir) {
            watcher
                .watch(&dir, notify::RecursiveMode::NonRecursive)
                .map_err(|e| WatchError::Watch {
                    path: dir.clone(),
                    source: std::io::Error::other(e),
                })?;
            dirs.push(dir);
        }
    }
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file written in place in two halves with a pause shorter than `STABLE` is read only
    /// once whole; one that stays put is read after one `STABLE`.
    #[tokio::test(start_paused = true)]
    async fn a_file_is_read_only_once_it_stops_changing() {
        let start = tokio::time::Instant::now();
        let half = Some((10, None, 1));
        let whole = Some((20, None, 1));
        // The second half lands 400 ms after the first read.
        let read = || {
            let at = start.elapsed();
            vec![if at < Duration::from_millis(400) {
                half
            } else {
                whole
            }]
        };
        assert_eq!(stable_signatures(read).await, vec![whole]);
        assert_eq!(
            start.elapsed(),
            2 * STABLE,
            "read at 0, 500 (changed), 1000 (same)"
        );

        let start = tokio::time::Instant::now();
        assert_eq!(stable_signatures(|| vec![whole]).await, vec![whole]);
        assert_eq!(start.elapsed(), STABLE);
    }
}
