//! Live recovery (`--recover live`): a rank that dies is replaced by a new process for the same
//! rank, started with `DDP_REJOIN=1` by its own node's launcher, while the others keep running;
//! they re-form the group with it (`ProcessGroup::reform` and `ProcessGroup::rejoin` in
//! ddp-comm), on this node and on the others, whose launchers see no failure. Each
//! replacement counts against `--max-restarts`. Where a replacement cannot help, the launcher
//! falls back to stopping every rank (and to a restart of the whole group, within the budget),
//! and says why in one line.

use super::cause_of;
use super::rendezvous::messages::Cause;
use super::report::Failure;

/// Whether the failure of `failure.rank` is replaced live, else why not (`None`: live recovery
/// is off, the line would say nothing new).
pub(crate) enum Verdict {
    /// Start a replacement; the line says so.
    Replace(String),
    /// Stop every rank as without live recovery; the line says why (if live recovery is on).
    Stop(Option<String>),
}

/// What to do about `failure`: `on` is `--recover live`, `budget_left` the restarts left,
/// `quiet` whether nothing else is failing or stopping (a failure while the others stop, or a
/// second failure, is never replaced).
pub(crate) fn verdict(on: bool, failure: &Failure, budget_left: usize, quiet: bool) -> Verdict {
    if !on {
        return Verdict::Stop(None);
    }
    let rank = failure.rank;
    // Rank 0 is replaced too: under live recovery the launcher serves the ranks' store.
    let why_not = if cause_of(failure) == Cause::Relayed {
        let peer = failure
            .relayed_from
            .map_or_else(|| "a peer".to_string(), |p| format!("rank {p}"));
        Some(format!(
            "rank {rank} failed on {peer}'s failure and did not recover from it live"
        ))
    } else if !quiet {
        Some("another rank failed or the ranks are being stopped".to_string())
    } else if budget_left == 0 {
        Some("the --max-restarts budget is spent".to_string())
    } else {
        None
    };
    match why_not {
        None => Verdict::Replace(format!(
            "ddprun: {}; starting a replacement for rank {rank} while the others run (live \
             recovery; {} restart(s) left after it)",
            failure.what_happened(),
            budget_left - 1
        )),
        Some(why) => Verdict::Stop(Some(format!(
            "ddprun: {}; no live recovery ({why}): stopping every rank",
            failure.what_happened()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::RankExit;
    use std::time::Duration;

    fn killed(rank: usize) -> Failure {
        Failure {
            rank,
            exit: RankExit::Signal(libc::SIGKILL),
            elapsed: Duration::from_secs(1),
            stopped: 0,
            relayed_from: None,
        }
    }

    #[test]
    fn only_a_quiet_own_failure_within_budget_is_replaced() {
        for rank in [0, 2] {
            assert!(
                matches!(verdict(true, &killed(rank), 1, true), Verdict::Replace(l) if l.contains(&format!("rank {rank}")))
            );
        }
        assert!(matches!(
            verdict(false, &killed(2), 1, true),
            Verdict::Stop(None)
        ));
        for (f, budget, quiet, why) in [
            (killed(2), 0, true, "budget is spent"),
            (killed(2), 1, false, "another rank failed"),
            (
                Failure {
                    exit: RankExit::Code(3),
                    relayed_from: Some(1),
                    ..killed(2)
                },
                1,
                true,
                "failed on rank 1's failure",
            ),
        ] {
            match verdict(true, &f, budget, quiet) {
                Verdict::Stop(Some(line)) => assert!(line.contains(why), "{line}"),
                _ => panic!(
                    "rank {} with budget {budget}, quiet {quiet}: replaced",
                    f.rank
                ),
            }
        }
    }
}
