//! Live recovery (`--recover live`): a rank that dies is replaced by a new process for the same
//! rank, started with `DDP_REJOIN=1` by its own node's launcher, while the others keep running;
//! they re-form the group with it (`ProcessGroup::reform` and `ProcessGroup::rejoin` in
//! ddp-comm), on this node and on the others, whose launchers see no failure.
//!
//! **One budget.** Each replacement spends one of `--max-restarts`, counted with the group
//! restarts: by this launcher alone on one node, in the launchers' shared state on several
//! (every node prints the same count). A group restart that only follows a live recovery that
//! could not complete (every failing rank relayed the lost one's failure) is paid for by that
//! recovery's replacements and spends nothing more.
//!
//! **Only where it can help.** A rank killed from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP, or
//! a wrapper shell's 128 + one of them) is replaced; a rank that failed with an error of its own
//! (an exit code, or a crash: SIGSEGV, SIGABRT, SIGBUS …, no lost peer behind it) would start
//! from the same state and fail the same way, so the group restarts from its checkpoint instead
//! (within the budget); a rank that only relayed a peer's failure is not replaced either.
//!
//! **A hung rank.** A rank whose collective waited for a peer past `DDP_TIMEOUT_SECS` notes it
//! (`DDP_FAILURE_FILE`, [`ddp_comm::failure_note::NoteKind::Hung`]); when the peer is a rank of
//! this node that still runs and is not waiting on another itself, the launcher kills it
//! ([`hung_rank`]), and it is replaced as any killed rank.

use ddp_comm::failure_note::{Note, NoteKind};

use super::cause_of;
use super::rendezvous::messages::Cause;
use super::report::{Failure, RankExit};

/// The signals a rank dies of when it is killed from outside (by a person, a scheduler, the
/// out-of-memory killer, its launcher for hanging): a replacement starting from the same state
/// can help. A crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL …) is the rank's own error.
const KILLED_FROM_OUTSIDE: [i32; 4] = [libc::SIGKILL, libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Whether `exit` is a death from outside: one of [`KILLED_FROM_OUTSIDE`], or a wrapper
/// shell's report of one (exit code 128 + the signal, `ddprun -- sh script.sh` without `exec`).
fn killed_from_outside(exit: RankExit) -> bool {
    match exit {
        RankExit::Signal(s) => KILLED_FROM_OUTSIDE.contains(&s),
        RankExit::Code(c) => KILLED_FROM_OUTSIDE.iter().any(|s| c == 128 + s),
    }
}

/// Whether the failure of `failure.rank` may be replaced live (the budget apart), else why not
/// (`None`: live recovery is off, the line would say nothing new).
pub(crate) enum Verdict {
    /// Start a replacement, if the budget allows.
    Replace,
    /// Stop every rank as without live recovery; the line says why (if live recovery is on).
    Stop(Option<String>),
}

/// What to do about `failure`: `on` is `--recover live`, `quiet` whether nothing else is
/// failing or stopping (a failure while the others stop is never replaced), `finished` the
/// ranks of this node that already exited 0 (a group whose ranks have finished cannot
/// re-form).
pub(crate) fn verdict(on: bool, failure: &Failure, quiet: bool, finished: &[usize]) -> Verdict {
    if !on {
        return Verdict::Stop(None);
    }
    let rank = failure.rank;
    let why_not = match cause_of(failure) {
        _ if !finished.is_empty() => Some(format!(
            "rank(s) {} already finished: the group cannot re-form",
            finished
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )),
        Cause::Relayed => {
            let peer = failure
                .relayed_from
                .map_or_else(|| "a peer".to_string(), |p| format!("rank {p}"));
            Some(format!(
                "rank {rank} failed on {peer}'s failure and did not recover from it live"
            ))
        }
        _ if !killed_from_outside(failure.exit) => Some(format!(
            "rank {rank} failed on an error of its own ({}), which a replacement starting from \
             the same state would meet again: the group restarts from its checkpoint",
            failure.exit
        )),
        _ if !quiet => Some("another rank failed or the ranks are being stopped".to_string()),
        _ => None,
    };
    match why_not {
        None => Verdict::Replace,
        Some(why) => Verdict::Stop(Some(stop_line(failure, &why))),
    }
}

/// The line of a failure not replaced live, and why.
pub(crate) fn stop_line(failure: &Failure, why: &str) -> String {
    format!(
        "ddprun: {}; no live recovery ({why}): stopping every rank",
        failure.what_happened()
    )
}

/// The line of a replacement started (process `pid`), with the budget spent after it (of
/// `max`).
pub(crate) fn replace_line(failure: &Failure, pid: u32, spent: usize, max: usize) -> String {
    format!(
        "ddprun: {}; started a replacement for rank {} (pid {pid}) while the others run (live \
         recovery; restart budget {spent} of {max} spent)",
        failure.what_happened(),
        failure.rank
    )
}

/// The line of a failure not replaced because the budget is spent.
pub(crate) fn spent_line(failure: &Failure, spent: usize, max: usize) -> String {
    stop_line(
        failure,
        &format!("the --max-restarts budget is spent: {spent} of {max}"),
    )
}

/// A hung rank to kill, from the notes of the ranks that still run: `notes[i]` is the note of
/// `running[i]` (a global rank). The peer a note names as hung is killed when it is one of
/// `local` (this node's ranks still running) and has no hung note of its own (a rank that
/// timed out waiting on another is not the one that hangs), and the note (its noter and peer)
/// is not one of `acted` (already killed for: the note stays until its rank re-formed the
/// group, and the killed rank's replacement is not hung). Returns the hung rank and the rank
/// that noted it.
pub(crate) fn hung_rank(
    running: &[usize],
    notes: &[Option<Note>],
    local: &[usize],
    acted: &[(usize, usize)],
) -> Option<(usize, usize)> {
    let waits_itself = |r: usize| {
        running
            .iter()
            .zip(notes)
            .any(|(&q, n)| q == r && n.is_some_and(|n| n.kind == NoteKind::Hung))
    };
    running.iter().zip(notes).find_map(|(&noter, n)| {
        let n = (*n)?;
        (n.kind == NoteKind::Hung
            && n.peer != noter
            && local.contains(&n.peer)
            && !acted.contains(&(noter, n.peer))
            && !waits_itself(n.peer))
        .then_some((n.peer, noter))
    })
}

/// The ranks of other nodes that this node's running ranks noted as hung: `(noter, hung)` for
/// each note whose peer is not one of `local` (all of this node's ranks).
pub(crate) fn hung_elsewhere(
    running: &[usize],
    notes: &[Option<Note>],
    local: impl Iterator<Item = usize> + Clone,
) -> Vec<(usize, usize)> {
    running
        .iter()
        .zip(notes)
        .filter_map(|(&noter, n)| {
            let n = (*n)?;
            (n.kind == NoteKind::Hung && !local.clone().any(|l| l == n.peer))
                .then_some((noter, n.peer))
        })
        .collect()
}

/// The first rank of `reported` (reported hung by another node's launcher) that runs here
/// (`running`, whose notes are `notes`) and waits for nobody itself.
pub(crate) fn reported_hung(
    running: &[usize],
    notes: &[Option<Note>],
    reported: &[usize],
) -> Option<usize> {
    reported.iter().copied().find(|r| {
        running
            .iter()
            .zip(notes)
            .any(|(&q, n)| q == *r && !n.is_some_and(|n| n.kind == NoteKind::Hung))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn only_a_quiet_death_by_signal_is_replaced() {
        for rank in [0, 2] {
            assert!(matches!(
                verdict(true, &killed(rank), true, &[]),
                Verdict::Replace
            ));
        }
        assert!(matches!(
            verdict(false, &killed(2), true, &[]),
            Verdict::Stop(None)
        ));
        let own = Failure {
            exit: RankExit::Code(1),
            ..killed(2)
        };
        let crashed = Failure {
            exit: RankExit::Signal(libc::SIGSEGV),
            ..killed(2)
        };
        // A wrapper shell's report of a SIGKILL, and a SIGTERM: killed from outside.
        for exit in [RankExit::Code(137), RankExit::Signal(libc::SIGTERM)] {
            let f = Failure { exit, ..killed(2) };
            assert!(matches!(verdict(true, &f, true, &[]), Verdict::Replace));
        }
        for (f, quiet, why) in [
            (killed(2), false, "another rank failed"),
            (own, true, "error of its own (exit code 1)"),
            (crashed, true, "error of its own (signal 11 (SIGSEGV))"),
            (
                Failure {
                    exit: RankExit::Code(3),
                    relayed_from: Some(1),
                    ..killed(2)
                },
                true,
                "failed on rank 1's failure",
            ),
        ] {
            match verdict(true, &f, quiet, &[]) {
                Verdict::Stop(Some(line)) => assert!(line.contains(why), "{line}"),
                _ => panic!("rank {} with quiet {quiet}: replaced", f.rank),
            }
        }
        match verdict(true, &killed(1), true, &[0, 2]) {
            Verdict::Stop(Some(line)) => {
                assert!(line.contains("rank(s) 0, 2 already finished"), "{line}")
            }
            _ => panic!("replaced after the others finished"),
        }
        assert!(spent_line(&killed(1), 2, 2).contains("budget is spent: 2 of 2"));
        assert!(replace_line(&killed(1), 42, 1, 3).contains(
            "(pid 42) while the others run (live recovery; restart budget 1 of 3 spent)"
        ));
    }

    #[test]
    fn the_hung_rank_is_the_one_waited_for_that_waits_for_nobody() {
        let hung = |peer| {
            Some(Note {
                peer,
                kind: NoteKind::Hung,
            })
        };
        let lost = |peer| {
            Some(Note {
                peer,
                kind: NoteKind::Lost,
            })
        };
        // Rank 0 timed out on rank 1, which runs on this node and waits for nobody.
        assert_eq!(
            hung_rank(&[0, 1, 2], &[hung(1), None, None], &[0, 1, 2], &[]),
            Some((1, 0))
        );
        // Killed once for that note: its replacement (rank 1 again) is not hung.
        assert_eq!(
            hung_rank(&[0, 1, 2], &[hung(1), None, None], &[0, 1, 2], &[(0, 1)]),
            None
        );
        // Rank 1 is on another node: not this launcher's to kill.
        assert_eq!(hung_rank(&[0, 2], &[hung(1), None], &[0, 2], &[]), None);
        // Rank 1 itself timed out waiting for rank 2: rank 2 is the one.
        assert_eq!(
            hung_rank(&[0, 1, 2], &[hung(1), hung(2), None], &[0, 1, 2], &[]),
            Some((2, 1))
        );
        // A closed connection says the peer is gone, not hung.
        assert_eq!(hung_rank(&[0, 1], &[lost(1), None], &[0, 1], &[]), None);
        // Rank 0 of this node (ranks 0 and 1) waited for rank 3 of another node: reported.
        assert_eq!(
            hung_elsewhere(&[0, 1], &[hung(3), lost(3)], [0, 1].into_iter()),
            vec![(0, 3)]
        );
        // Rank 3, reported by another node, runs here and waits for nobody: killed; a reported
        // rank that itself timed out on another is not the one.
        assert_eq!(reported_hung(&[2, 3], &[None, None], &[3]), Some(3));
        assert_eq!(reported_hung(&[2, 3], &[None, hung(0)], &[3]), None);
        assert_eq!(reported_hung(&[2], &[None], &[3]), None);
    }
}
