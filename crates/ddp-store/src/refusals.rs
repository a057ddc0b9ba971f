//! Refused connections, logged as a summary instead of a line each.
//!
//! A port scan or a flood can refuse thousands of connections a second; a line each would bury
//! the job's own log. The first refusal is logged at once; later ones are counted and logged
//! together at most every [`SUMMARY_EVERY`], with why they were refused and the addresses they
//! came from (the busiest few).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The shortest time between two summaries.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(10);
/// Addresses named in one summary.
const NAMED_SOURCES: usize = 4;
/// Addresses counted separately in one summary (more are counted as "others").
const COUNTED_SOURCES: usize = 256;

#[derive(Default)]
struct Window {
    count: u64,
    reasons: HashMap<&'static str, u64>,
    sources: HashMap<Source, u64>,
    others: u64,
    since: Option<Instant>,
    last_report: Option<Instant>,
}

/// Where a refused connection came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// A network address.
    Ip(IpAddr),
    /// A Unix socket (a process of this host, of a user allowed to open it).
    LocalSocket,
}

impl From<IpAddr> for Source {
    fn from(ip: IpAddr) -> Self {
        Source::Ip(ip)
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Ip(ip) => ip.fmt(f),
            Source::LocalSocket => f.write_str("the local socket"),
        }
    }
}

/// A summary log of refused connections for one listener (the store, a rank's mesh).
pub struct RefusalLog {
    /// What refuses ("rendezvous store at 10.0.0.1:29500", "rank 0").
    what: String,
    window: Mutex<Window>,
    total: std::sync::atomic::AtomicU64,
}

impl RefusalLog {
    /// A log for the listener `what`.
    pub fn new(what: impl Into<String>) -> Self {
        RefusalLog {
            what: what.into(),
            window: Mutex::new(Window::default()),
            total: Default::default(),
        }
    }

    /// Every refusal so far.
    pub fn total(&self) -> u64 {
        self.total.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts one refusal of a connection from `source`, because of `reason`; logs at once
    /// when no summary was logged for [`SUMMARY_EVERY`].
    pub fn note(&self, source: impl Into<Source>, reason: &'static str) {
        let source = source.into();
        self.total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        w.count += 1;
        *w.reasons.entry(reason).or_default() += 1;
        if w.sources.len() < COUNTED_SOURCES || w.sources.contains_key(&source) {
            *w.sources.entry(source).or_default() += 1;
        } else {
            w.others += 1;
        }
        w.since.get_or_insert(now);
        if w.last_report.is_none_or(|t| now - t >= SUMMARY_EVERY) {
            self.report(&mut w, now);
        }
    }

    /// Logs the refusals counted since the last summary, if [`SUMMARY_EVERY`] has passed
    /// (or at once with `force`, when the listener stops).
    pub fn flush(&self, force: bool) {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if w.count > 0 && (force || w.last_report.is_none_or(|t| now - t >= SUMMARY_EVERY)) {
            self.report(&mut w, now);
        }
    }

    fn report(&self, w: &mut Window, now: Instant) {
        let mut reasons: Vec<_> = w.reasons.iter().map(|(r, n)| (*n, *r)).collect();
        reasons.sort_unstable_by(|a, b| b.cmp(a));
        let reasons = reasons
            .iter()
            .map(|(n, r)| format!("{n} {r}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut sources: Vec<_> = w.sources.iter().map(|(a, n)| (*n, *a)).collect();
        sources.sort_unstable_by(|a, b| b.cmp(a));
        let mut named = sources
            .iter()
            .take(NAMED_SOURCES)
            .map(|(n, a)| format!("{a} ({n})"))
            .collect::<Vec<_>>();
        let rest = sources.len().saturating_sub(NAMED_SOURCES) as u64 + w.others;
        if rest > 0 {
            named.push(format!("and {rest} more"));
        }
        let secs = now.duration_since(w.since.unwrap_or(now)).as_secs_f64();
        tracing::warn!(
            "{}: refused {} connection(s) in {secs:.1} s ({reasons}) from {}",
            self.what,
            w.count,
            named.join(", ")
        );
        *w = Window {
            last_report: Some(now),
            ..Window::default()
        };
    }
}

impl Drop for RefusalLog {
    fn drop(&mut self) {
        self.flush(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_counted_and_summarised_not_logged_one_by_one() {
        let log = RefusalLog::new("test listener");
        let a: IpAddr = [127, 0, 0, 2].into();
        for _ in 0..1000 {
            log.note(a, "without a valid handshake");
        }
        assert_eq!(log.total(), 1000);
        let w = log.window.lock().unwrap();
        // The first was reported at once; the other 999 wait for the next summary.
        assert_eq!(w.count, 999);
        assert_eq!(w.sources[&Source::Ip(a)], 999);
        assert!(w.last_report.is_some());
    }
}
