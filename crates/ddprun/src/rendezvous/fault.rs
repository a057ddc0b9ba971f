//! A test-only fault knob: `DDP_RDZV_FAULT=exit-after:STEP[:N]` SIGKILLs this launcher right
//! after the `N`-th (default first) rendezvous change named `STEP` was written, so that tests
//! can kill a launcher between any two steps of the rendezvous and check that no half state is
//! left. The steps: `start` (the host wrote the first state), `join`, `leave`, `close` (the
//! coordinator closed a round), `note` (a rank's failure was noted), `claim` (an end of a round
//! was written), `done`, `lost` (the
//! coordinator ended a round for a lost node), `scale-up`, `drop` (the coordinator removed a
//! dead waiting launcher), `refuse`, `finish` (the job's end written outside a round), `ack`.
//!
//! `DDP_RDZV_FAULT=settle-ms:N` instead holds a rank's failure back for `N` ms before it is
//! written as its round's end (0.5 s otherwise), so that a test can make another event (a
//! scale-up, a joiner) come inside that window every time.
//!
//! Unset, it costs one environment look-up per process. It is not a user setting: the variable
//! is documented here only.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The variable.
pub(crate) const FAULT_VAR: &str = "DDP_RDZV_FAULT";

/// The step to die after and on which of its occurrences (from 1).
fn planned() -> Option<&'static (String, u64)> {
    static PLAN: OnceLock<Option<(String, u64)>> = OnceLock::new();
    PLAN.get_or_init(|| parse(&std::env::var(FAULT_VAR).ok()?))
        .as_ref()
}

fn parse(value: &str) -> Option<(String, u64)> {
    let rest = value.strip_prefix("exit-after:")?;
    match rest.split_once(':') {
        Some((step, n)) => Some((step.to_string(), n.parse().ok().filter(|n| *n > 0)?)),
        None => Some((rest.to_string(), 1)),
    }
}

/// How long a rank's failure is held back before it is written as its round's end:
/// `default`, unless the knob says `settle-ms:N`.
pub(crate) fn settle(default: std::time::Duration) -> std::time::Duration {
    static SETTLE: OnceLock<Option<u64>> = OnceLock::new();
    SETTLE
        .get_or_init(|| {
            std::env::var(FAULT_VAR)
                .ok()?
                .strip_prefix("settle-ms:")?
                .parse()
                .ok()
        })
        .map_or(default, std::time::Duration::from_millis)
}

/// Called after every rendezvous change named `step` was written: kills this process when the
/// knob says so.
pub(crate) fn after(step: &str) {
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let Some((planned, nth)) = planned() else {
        return;
    };
    if planned != step {
        return;
    }
    if SEEN.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
        eprintln!("ddprun: {FAULT_VAR}: killing this launcher after the rendezvous step {step:?}");
        // SAFETY: kill and getpid have no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn the_knob_names_a_step_and_optionally_its_occurrence() {
        assert_eq!(parse("exit-after:join"), Some(("join".into(), 1)));
        assert_eq!(parse("exit-after:claim:3"), Some(("claim".into(), 3)));
        assert_eq!(parse("exit-after:claim:0"), None);
        assert_eq!(parse("crash"), None);
    }
}
