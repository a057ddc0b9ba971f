//! The verdicts: a hang (no rank finished a collective for a while and some wait in one) and a
//! straggler (a rank whose own work per step is a multiple of the others'), each one line that
//! names the rank, where it is and what the others wait in.

use std::fmt;
use std::time::Duration;

use crate::phase::Phase;
use crate::snapshot::{CollectiveRecord, RankSnapshot};

/// When a verdict is due.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// A hang: no rank finished a collective for this long, and ranks wait in one as long.
    pub hang_after: Duration,
    /// A rank whose last report was older than this when its launcher read it went silent
    /// (frozen, or gone); one its launcher saw stopped is silent at once.
    pub silent_after: Duration,
    /// A straggler: its own work per step over this many times the others' median.
    pub straggler_factor: f64,
}

/// Steps a rank must have completed before it can be called a straggler.
pub const STRAGGLER_MIN_STEPS: usize = 4;
/// The steps a straggler verdict looks at (the last ones).
pub const STRAGGLER_WINDOW: usize = 8;
/// A straggler's excess must also exceed this (milliseconds per step): timer noise on steps of
/// a few milliseconds is no straggler.
pub const STRAGGLER_MIN_EXCESS_MS: f64 = 5.0;

/// Where a rank that does not wait in the hung collective is.
#[derive(Debug, Clone, PartialEq)]
pub enum Whereabouts {
    /// Working (not in a collective) in `phase` of `step` for `for_s` seconds.
    Working {
        /// The phase.
        phase: Phase,
        /// The step.
        step: u64,
        /// Seconds in that phase.
        for_s: f64,
        /// Its stack, innermost first, as the launcher took it (may be empty).
        stack: Vec<String>,
        /// Why no stack, when the launcher tried.
        stack_error: Option<String>,
    },
    /// In another collective than the one the others wait in.
    Elsewhere(CollectiveRecord),
    /// Its reports stopped `age_s` seconds ago.
    Silent {
        /// Seconds since its last report.
        age_s: f64,
        /// The process's state as the launcher saw it (`stopped` …), if it did.
        process: Option<String>,
        /// Where its last report put it.
        last: String,
    },
    /// No report from it at all.
    NoReport,
}

/// A hang: ranks wait in one collective and nobody finished one for a while.
#[derive(Debug, Clone, PartialEq)]
pub struct Hang {
    /// The collective they wait in (as the first of them recorded it).
    pub collective: CollectiveRecord,
    /// The ranks waiting in it.
    pub waiting: Vec<usize>,
    /// How long they have waited (the longest of them), in seconds.
    pub waited_s: f64,
    /// The other ranks, and where they are.
    pub others: Vec<(usize, Whereabouts)>,
}

impl Hang {
    /// The ranks the verdict blames: those not in the collective, or, when only a minority
    /// waits in it (a collective the others never call), the waiting ones.
    pub fn culprits(&self) -> Vec<usize> {
        let working = self
            .others
            .iter()
            .filter(|(_, w)| matches!(w, Whereabouts::Working { .. }))
            .count();
        if self.waiting.len() < working && working == self.others.len() {
            self.waiting.clone()
        } else {
            self.others.iter().map(|(r, _)| *r).collect()
        }
    }
}

/// The newest end of a collective in `snapshots` (Unix milliseconds), if any: the job's last
/// progress. A hang verdict stands until it moves.
pub fn last_progress(snapshots: &[RankSnapshot]) -> Option<f64> {
    snapshots
        .iter()
        .filter_map(RankSnapshot::last_finished_ms)
        .reduce(f64::max)
}

/// The hang verdict for `snapshots` (a world of `world_size` ranks) at `now_ms` (Unix
/// milliseconds), if one is due.
pub fn hang(
    snapshots: &[RankSnapshot],
    world_size: usize,
    now_ms: f64,
    limits: &Thresholds,
) -> Option<Hang> {
    let hang_ms = limits.hang_after.as_secs_f64() * 1e3;
    let silent_ms = limits.silent_after.as_secs_f64() * 1e3;
    // A report's age as its own launcher saw it (one host's clock), else as judged now; a
    // process its launcher saw stopped is silent whatever its last report's age.
    let age_ms = |s: &RankSnapshot| match &s.observed {
        Some(o) => o.seen_ms - s.written_ms,
        None => now_ms - s.written_ms,
    };
    let fresh = |s: &RankSnapshot| {
        age_ms(s) <= silent_ms
            && !s
                .observed
                .as_ref()
                .is_some_and(|o| matches!(o.process.as_str(), "stopped" | "traced"))
    };
    if last_progress(snapshots).is_some_and(|t| now_ms - t < hang_ms) {
        return None;
    }
    let waiters: Vec<&RankSnapshot> = snapshots
        .iter()
        .filter(|s| fresh(s) && s.waiting_in().is_some())
        .collect();
    // The call most ranks wait in (the latest issued among equals).
    let in_call = |c: &CollectiveRecord| {
        waiters
            .iter()
            .filter(|s| s.waiting_in().is_some_and(|w| w.same_call(c)))
            .count()
    };
    let target = waiters
        .iter()
        .filter_map(|s| s.waiting_in())
        .max_by(|a, b| {
            in_call(a)
                .cmp(&in_call(b))
                .then(a.issued_ms.total_cmp(&b.issued_ms))
        })?
        .clone();
    let waiting: Vec<&RankSnapshot> = waiters
        .iter()
        .copied()
        .filter(|s| s.waiting_in().is_some_and(|c| c.same_call(&target)))
        .collect();
    let first_issued = waiting
        .iter()
        .filter_map(|s| s.waiting_in().map(|c| c.issued_ms))
        .reduce(f64::min)?;
    if now_ms - first_issued < hang_ms {
        return None;
    }
    let mut others = Vec::new();
    for rank in 0..world_size {
        if waiting.iter().any(|s| s.rank == rank) {
            continue;
        }
        let Some(s) = snapshots.iter().find(|s| s.rank == rank) else {
            others.push((rank, Whereabouts::NoReport));
            continue;
        };
        let whereabouts = if !fresh(s) {
            Whereabouts::Silent {
                age_s: age_ms(s).max(0.0) / 1e3,
                process: s.observed.as_ref().map(|o| o.process.clone()),
                last: match s.waiting_in() {
                    Some(c) => format!("in {}", c.describe()),
                    None => format!("in phase {} of step {}", s.phase, s.step),
                },
            }
        } else if let Some(c) = s.waiting_in() {
            Whereabouts::Elsewhere(c.clone())
        } else {
            Whereabouts::Working {
                phase: s.phase,
                step: s.step,
                for_s: ((now_ms - s.phase_since_ms) / 1e3).max(0.0),
                stack: s
                    .observed
                    .as_ref()
                    .map(|o| o.stack.clone())
                    .unwrap_or_default(),
                stack_error: s.observed.as_ref().and_then(|o| o.stack_error.clone()),
            }
        };
        others.push((rank, whereabouts));
    }
    Some(Hang {
        collective: target,
        waiting: waiting.iter().map(|s| s.rank).collect(),
        waited_s: (now_ms - first_issued) / 1e3,
        others,
    })
}

fn ranks(list: &[usize]) -> String {
    let word = if list.len() == 1 { "rank" } else { "ranks" };
    let numbers: Vec<String> = list.iter().map(usize::to_string).collect();
    format!("{word} {}", numbers.join(","))
}

/// The frames worth naming: the program's own, past the standard library's, the registry
/// crates' and the C library's (a sleep is `nanosleep` inside `std::thread::sleep` inside the
/// caller). Frames as `ddprun` writes them: `function (file:line)`, toolchain files under
/// `<rust>/`, registry crates' under `<cargo>/`.
pub fn own_frames(stack: &[String]) -> Vec<&str> {
    stack
        .iter()
        .map(String::as_str)
        .filter(|f| {
            let name = f.trim_start_matches('<');
            !(f.contains("(<rust>/")
                || f.contains("(<cargo>/")
                || name.starts_with("std::")
                || name.starts_with("core::")
                || name.starts_with("alloc::")
                || name.starts_with("__")
                || name.starts_with("_start")
                || name.starts_with("ddp_doctor::")
                || name.starts_with("?")
                || !f.contains("::") && !f.contains(".rs:"))
        })
        .take(3)
        .collect()
}

impl fmt::Display for Whereabouts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Whereabouts::Working {
                phase,
                step,
                for_s,
                stack,
                stack_error,
            } => {
                write!(f, "in phase {phase} of step {step} for {for_s:.0} s")?;
                let frames = own_frames(stack);
                if !frames.is_empty() {
                    write!(f, ", at {}", frames.join(" ← "))?;
                } else if let Some(e) = stack_error {
                    write!(f, " (no stack: {e})")?;
                }
                Ok(())
            }
            Whereabouts::Elsewhere(c) => write!(f, "waits in {} instead", c.describe()),
            Whereabouts::Silent {
                age_s,
                process,
                last,
            } => {
                write!(f, "silent: its last report is {age_s:.0} s old ({last})")?;
                match process.as_deref() {
                    Some("stopped") => write!(f, "; its process is stopped (SIGSTOP, a debugger)"),
                    Some(p) => write!(f, "; its process is {p}"),
                    None => Ok(()),
                }
            }
            Whereabouts::NoReport => f.write_str("no report from it"),
        }
    }
}

impl fmt::Display for Hang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.waiting.len() == 1 {
            "waits"
        } else {
            "wait"
        };
        write!(
            f,
            "hang at step {}: {} {verb} in {} for {:.0} s",
            self.collective.step,
            ranks(&self.waiting),
            self.collective.describe(),
            self.waited_s
        )?;
        for (rank, w) in &self.others {
            match w {
                Whereabouts::Working { .. } | Whereabouts::NoReport => {
                    write!(f, "; rank {rank} never called it: {w}")?
                }
                _ => write!(f, "; rank {rank} {w}")?,
            }
        }
        let culprits = self.culprits();
        if culprits == self.waiting {
            write!(
                f,
                " ({} called a collective the others did not)",
                ranks(&culprits)
            )?;
        }
        Ok(())
    }
}

/// A rank whose own work per step is a multiple of the others'.
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// Its step (at its last report).
    pub step: u64,
    /// Its own work per step (median of the window), milliseconds.
    pub busy_ms: f64,
    /// The others' median, milliseconds.
    pub others_ms: f64,
    /// The steps measured.
    pub steps: usize,
    /// The phase with most of the excess, and the excess in milliseconds per step.
    pub phase: Option<(Phase, f64)>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

fn window(s: &RankSnapshot) -> &[crate::snapshot::StepRecord] {
    let n = s.steps.len();
    &s.steps[n.saturating_sub(STRAGGLER_WINDOW)..]
}

fn busy(s: &RankSnapshot) -> Option<f64> {
    median(window(s).iter().map(|st| st.busy_ms()).collect())
}

fn phase_busy(s: &RankSnapshot, p: Phase) -> f64 {
    median(
        window(s)
            .iter()
            .map(|st| st.busy_by_phase_ms.get(&p).copied().unwrap_or(0.0))
            .collect(),
    )
    .unwrap_or(0.0)
}

/// The stragglers among `snapshots` (ranks with at least [`STRAGGLER_MIN_STEPS`] steps).
pub fn stragglers(snapshots: &[RankSnapshot], limits: &Thresholds) -> Vec<Straggler> {
    let measured: Vec<(&RankSnapshot, f64)> = snapshots
        .iter()
        .filter(|s| s.steps.len() >= STRAGGLER_MIN_STEPS)
        .filter_map(|s| busy(s).map(|b| (s, b)))
        .collect();
    if measured.len() < 2 {
        return Vec::new();
    }
    let mut found = Vec::new();
    for (s, b) in &measured {
        let others: Vec<&RankSnapshot> = measured
            .iter()
            .filter(|(o, _)| o.rank != s.rank)
            .map(|(o, _)| *o)
            .collect();
        let Some(m) = median(
            measured
                .iter()
                .filter(|(o, _)| o.rank != s.rank)
                .map(|(_, b)| *b)
                .collect(),
        ) else {
            continue;
        };
        if *b <= limits.straggler_factor * m || b - m < STRAGGLER_MIN_EXCESS_MS {
            continue;
        }
        let phase = Phase::ALL
            .iter()
            .map(|&p| {
                let theirs =
                    median(others.iter().map(|o| phase_busy(o, p)).collect()).unwrap_or(0.0);
                (p, phase_busy(s, p) - theirs)
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .filter(|(_, excess)| *excess > 0.0);
        found.push(Straggler {
            rank: s.rank,
            step: s.step,
            busy_ms: *b,
            others_ms: m,
            steps: window(s).len(),
            phase,
        });
    }
    found
}

impl fmt::Display for Straggler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "straggler at step {}: rank {}'s own work takes {:.1}× the others' ({:.0} ms per step \
             against their median of {:.0} ms, last {} steps)",
            self.step,
            self.rank,
            self.busy_ms / self.others_ms.max(1e-9),
            self.busy_ms,
            self.others_ms,
            self.steps
        )?;
        if let Some((p, excess)) = self.phase {
            write!(f, ", most of it in phase {p} (+{excess:.0} ms)")?;
        }
        f.write_str("; the others wait for it in their collectives")
    }
}
