//! Time as a judge of liveness counts it: only while the judge itself was running. A launcher
//! that was stopped (SIGSTOP, a frozen VM) or starved saw nothing meanwhile, so the gap must not
//! count against the launchers it judges; a gap longer than the heartbeat timeout means the
//! others have judged *it* lost.

use std::time::{Duration, Instant};

/// A clock that advances by the time between two looks at it, each at most a cap: the
/// longest a look may legitimately take (a sleep and its slack, a request and its timeout).
#[derive(Debug)]
pub(crate) struct RunningClock {
    last: Instant,
    running: Duration,
}

impl RunningClock {
    /// A clock at zero, now.
    pub fn start() -> Self {
        RunningClock {
            last: Instant::now(),
            running: Duration::ZERO,
        }
    }

    /// Advances by the time since the last look, at most `cap`; returns that whole gap (a
    /// gap above the cap is time this process was not running, as far as its judgement goes).
    pub fn advance(&mut self, cap: Duration) -> Duration {
        let now = Instant::now();
        let gap = now - self.last;
        self.last = now;
        self.running += gap.min(cap);
        gap
    }

    /// The running time so far.
    pub fn now(&self) -> Duration {
        self.running
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_longer_than_the_cap_counts_only_the_cap() {
        let mut clock = RunningClock::start();
        std::thread::sleep(Duration::from_millis(30));
        let gap = clock.advance(Duration::from_millis(5));
        assert!(gap >= Duration::from_millis(30), "{gap:?}");
        assert_eq!(clock.now(), Duration::from_millis(5));
        std::thread::sleep(Duration::from_millis(10));
        clock.advance(Duration::from_secs(1));
        assert!(
            clock.now() >= Duration::from_millis(15),
            "{:?}",
            clock.now()
        );
    }
}
