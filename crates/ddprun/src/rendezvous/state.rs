//! The whole rendezvous in one value ([`State`]) under one store key, and every change to it
//! as a pure function: read the state, apply one change, write it back with one
//! compare-and-set ([`Shared::change`]). A launcher that dies at any point leaves the old
//! state or the new one, never half of one (torchrun's dynamic rendezvous keeps its
//! `_RendezvousState` the same way).

use serde::{Deserialize, Serialize};

use super::messages::{After, Cause, EndKind, NodeSpec, RoundEnd, RoundInfo, after, is_failure};

/// How many round ends the state remembers, so that a launcher slow to look still learns how
/// its round ended after the next rounds moved on.
const ENDS_KEPT: usize = 16;
/// How many refusal lines the state keeps for the host to log.
const REFUSALS_KEPT: usize = 8;

/// A launcher waiting to take part in the next round that closes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Joiner {
    /// Its [`NodeSpec::id`].
    pub id: String,
    /// Its [`NodeSpec::label`].
    pub label: String,
    /// `--node-rank` as given: rounds order their nodes by it, then by arrival.
    pub requested_node_rank: usize,
    /// The state's `seq` when it joined (its place in the arrival order).
    pub arrival: u64,
    /// Where its rank 0 serves the ranks' store if it is node 0 of the round: its own
    /// address, as the host sees it.
    pub master_addr: String,
    /// A port free on that address when it joined.
    pub master_port: u16,
    /// How long it takes to stop its ranks (its grace period and output drain), in ms.
    pub stop_within_ms: u64,
}

/// A rank failure a launcher wrote the moment it saw it, before it is settled as the round's
/// cause: from then on nothing but a failure can end the round (see [`State::note_failure`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NotedFailure {
    /// The launcher whose rank failed.
    pub node: String,
    /// The end that failure would write.
    pub end: RoundEnd,
    /// How likely it is the root cause.
    pub cause: Cause,
}

/// What the job is doing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Phase {
    /// Gathering launchers for round [`State::round`] (those in [`State::waiting`]).
    Gathering,
    /// Round [`State::round`] runs.
    Running {
        /// The round as it was closed.
        info: RoundInfo,
        /// The ids of its launchers whose ranks all exited 0.
        done: Vec<String>,
        /// Rank failures noted in this round, in the order they were written (one per node).
        failed: Vec<NotedFailure>,
    },
    /// The job is over: every launcher exits with `end.exit_code` after printing `end.line`.
    Finished {
        /// How it ended.
        end: RoundEnd,
        /// The launchers that must read it before the host closes the store.
        members: Vec<String>,
        /// Those that have.
        acked: Vec<String>,
    },
}

/// The launchers' rendezvous, whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    /// Bumped by every change.
    pub seq: u64,
    /// The job's configuration: the rendezvous host's. A launcher that differs is refused.
    pub job: NodeSpec,
    /// The round gathered or running now.
    pub round: u64,
    /// Rounds that ended in a failure (a rank failed, a node was lost or left) and spent the
    /// budget: `TORCHELASTIC_RESTART_COUNT`.
    pub failures: usize,
    /// Lost ranks replaced live (`--recover live`), on any node: with `failures`, what
    /// `--max-restarts` counts ([`State::budget_spent`]).
    #[serde(default)]
    pub replacements: usize,
    /// The global ranks replaced live in the round running now (a failure that ends it only
    /// relaying one of their losses restarts the group paid for, see [`RoundEnd::paid`]).
    #[serde(default)]
    pub round_replaced: Vec<usize>,
    /// The global ranks of the running round that another node's rank waited for past its
    /// collective timeout (a hung rank): the launcher whose rank it is kills it, so that it is
    /// replaced live (see [`State::report_hung`]).
    #[serde(default)]
    pub hung: Vec<usize>,
    /// What the job is doing.
    pub phase: Phase,
    /// Launchers waiting for the next round to close, in arrival order.
    pub waiting: Vec<Joiner>,
    /// The latest rounds and how they ended, oldest first (the last [`ENDS_KEPT`]).
    pub ends: Vec<(RoundInfo, RoundEnd)>,
    /// Launchers refused at the door (`seq`, line), for the host to log.
    pub refusals: Vec<(u64, String)>,
}

impl State {
    /// The state the rendezvous host starts with: gathering round 0, nobody there yet.
    pub fn new(job: NodeSpec) -> Self {
        State {
            seq: 0,
            job,
            round: 0,
            failures: 0,
            replacements: 0,
            round_replaced: Vec::new(),
            hung: Vec::new(),
            phase: Phase::Gathering,
            waiting: Vec::new(),
            ends: Vec::new(),
            refusals: Vec::new(),
        }
    }

    /// Whether the job completed: it is over, and its last round ended with every node's
    /// ranks exiting 0 (as [`Self::mark_done`] ends one). A job's end written any other way —
    /// before any round ran, or by a failure — is not a completion, whatever its exit code
    /// says.
    pub fn completed(&self) -> bool {
        let Phase::Finished { end, .. } = &self.phase else {
            return false;
        };
        end.kind == EndKind::Done
            && self.ends.last().is_some_and(|(info, e)| {
                info.round == self.round && e.kind == EndKind::Done && e.exit_code == 0
            })
    }

    /// How round `round` ended, if it has.
    pub fn end_of(&self, round: u64) -> Option<&RoundEnd> {
        if let Phase::Finished { end, .. } = &self.phase
            && self.round == round
        {
            return Some(end);
        }
        self.ends
            .iter()
            .find(|(i, _)| i.round == round)
            .map(|(_, e)| e)
    }

    /// The first round from `round` on that had `id` in it and has ended, with its end: a
    /// launcher slow to look may miss a whole round that ended at once.
    pub fn ended_with(&self, id: &str, round: u64) -> Option<(&RoundInfo, &RoundEnd)> {
        self.ends
            .iter()
            .find(|(i, _)| i.round >= round && i.node_rank(id).is_some())
            .map(|(i, e)| (i, e))
    }

    /// The running round, if one runs.
    pub fn running(&self) -> Option<&RoundInfo> {
        match &self.phase {
            Phase::Running { info, .. } => Some(info),
            _ => None,
        }
    }

    /// Whether `id` waits for a round.
    pub fn is_waiting(&self, id: &str) -> bool {
        self.waiting.iter().any(|j| j.id == id)
    }

    /// `joiner` waits for the next round (again, if it was already waiting: its new address
    /// and port replace the old). `false` once the job is over, and for a launcher that the
    /// running round already has (a join tried again after its first try landed unanswered:
    /// queued again, it would look like a newcomer and end its own round as a scale-up).
    pub fn join(&mut self, mut joiner: Joiner) -> bool {
        if matches!(self.phase, Phase::Finished { .. })
            || self
                .running()
                .is_some_and(|info| info.node_rank(&joiner.id).is_some())
        {
            return false;
        }
        joiner.arrival = self.seq;
        match self.waiting.iter_mut().find(|j| j.id == joiner.id) {
            Some(j) => {
                joiner.arrival = j.arrival;
                *j = joiner;
            }
            None => self.waiting.push(joiner),
        }
        true
    }

    /// `id` no longer waits (it left, or it was lost). `false` if it was not waiting.
    pub fn leave(&mut self, id: &str) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|j| j.id != id);
        self.waiting.len() != before
    }

    /// Records a launcher refused at the door, for the host to log.
    pub fn refuse(&mut self, line: String) {
        self.refusals.push((self.seq, line));
        let extra = self.refusals.len().saturating_sub(REFUSALS_KEPT);
        self.refusals.drain(..extra);
    }

    /// The waiting launchers in the order a round ranks them: by `--node-rank`, then by
    /// arrival.
    pub fn ordered_waiting(&self) -> Vec<Joiner> {
        let mut w = self.waiting.clone();
        w.sort_by_key(|j| (j.requested_node_rank, j.arrival));
        w
    }

    /// Closes the round being gathered with the first `max` waiting launchers (in
    /// [`Self::ordered_waiting`] order); the first of them is the round's node 0 and its
    /// rank 0 serves the ranks' store. `None` unless gathering with someone waiting.
    pub fn close(&mut self) -> Option<RoundInfo> {
        if self.phase != Phase::Gathering || self.waiting.is_empty() {
            return None;
        }
        let nodes: Vec<Joiner> = self
            .ordered_waiting()
            .into_iter()
            .take(self.job.max_nodes)
            .collect();
        let master = &nodes[0];
        let info = RoundInfo {
            round: self.round,
            nodes: nodes.iter().map(|j| j.id.clone()).collect(),
            labels: nodes.iter().map(|j| j.label.clone()).collect(),
            nproc_per_node: self.job.nproc_per_node,
            master_addr: master.master_addr.clone(),
            master_port: master.master_port,
            stop_within_ms: nodes.iter().map(|j| j.stop_within_ms).max().unwrap_or(0),
            failures_before: self.failures,
            adopted: Vec::new(),
        };
        self.waiting.retain(|j| !info.nodes.contains(&j.id));
        self.round_replaced.clear();
        self.hung.clear();
        self.phase = Phase::Running {
            info: info.clone(),
            done: Vec::new(),
            failed: Vec::new(),
        };
        Some(info)
    }

    /// Ends round `round` with `end` if it is still running (the first end wins): the job
    /// finishes, or the next round starts gathering, by the one rule of
    /// [`messages::after`](super::messages::after). `false` if the round had already ended.
    /// A scale-up proposed while a rank failure is noted becomes that failure: a failure is
    /// never lost to whatever else ends the round at the same moment.
    pub fn end_round(&mut self, round: u64, end: RoundEnd) -> bool {
        let Phase::Running { info, failed, .. } = &self.phase else {
            return false;
        };
        if info.round != round {
            return false;
        }
        let end = match best_failure(failed) {
            Some(noted) if end.kind == EndKind::ScaleUp => noted.end.clone(),
            _ => end,
        };
        // Paid: every failure noted relays the loss of a rank replaced live in this round.
        let relays_a_replaced = best_failure(failed).is_some_and(|f| {
            f.cause == Cause::Relayed
                && f.end
                    .relayed_from
                    .is_some_and(|p| self.round_replaced.contains(&p))
        });
        let end = RoundEnd {
            budget_spent: self.budget_spent(),
            paid: is_failure(&end) && relays_a_replaced,
            ..end
        };
        let info = info.clone();
        self.ends.push((info.clone(), end.clone()));
        let extra = self.ends.len().saturating_sub(ENDS_KEPT);
        self.ends.drain(..extra);
        match after(&end, &info, self.job.max_restarts) {
            After::Finish(code) => self.finish_after(&info, end, code),
            After::NextRound => {
                self.failures += usize::from(is_failure(&end) && !end.paid);
                self.round += 1;
                self.phase = Phase::Gathering;
            }
        }
        true
    }

    /// What the job has spent of `--max-restarts`: failed rounds and live replacements.
    pub fn budget_spent(&self) -> usize {
        self.failures + self.replacements
    }

    /// Charges the live replacement of global rank `rank`, lost in round `round`, to the job's
    /// budget, if the round still runs with no failure noted in it and the budget allows: `Ok`
    /// with the budget spent after it, else `Err` with why not (the budget spent so far, or
    /// `None` when the round is ending or over).
    pub fn charge_replacement(&mut self, round: u64, rank: usize) -> Result<usize, Option<usize>> {
        match &self.phase {
            Phase::Running { info, failed, .. } if info.round == round && failed.is_empty() => {}
            _ => return Err(None),
        }
        let spent = self.budget_spent();
        if spent >= self.job.max_restarts {
            return Err(Some(spent));
        }
        self.replacements += 1;
        if !self.round_replaced.contains(&rank) {
            self.round_replaced.push(rank);
        }
        Ok(spent + 1)
    }

    /// Hands the node of launcher `lost` in the running round `round` over to the first
    /// waiting launcher (a spare, `--recover live`): the spare takes the lost launcher's node
    /// rank and starts its ranks as replacements in the running group, each charged to the
    /// budget as a live replacement. `Some((node rank, the spare's label, budget spent))`;
    /// `None` — the round then ends as for any lost launcher — when live recovery is off, the
    /// round is not running or a failure is noted in it, a node's ranks already all exited 0
    /// (a group whose ranks have finished cannot re-form), the lost node is the round's node 0
    /// (its launcher serves the ranks' store, which went with it), nobody waits, or the budget
    /// has no room for all of the node's ranks.
    pub fn hand_over(&mut self, round: u64, lost: &str) -> Option<(usize, String, usize)> {
        let Phase::Running { info, failed, done } = &mut self.phase else {
            return None;
        };
        let node = info.node_rank(lost)?;
        let nproc = info.nproc_per_node;
        let spent = self.failures + self.replacements;
        if !self.job.live_recovery
            || info.round != round
            || !failed.is_empty()
            || !done.is_empty()
            || node == 0
            || spent + nproc > self.job.max_restarts
        {
            return None;
        }
        let mut waiting = self.waiting.clone();
        waiting.sort_by_key(|j| (j.requested_node_rank, j.arrival));
        let spare = waiting.into_iter().next()?;
        info.nodes[node] = spare.id.clone();
        info.labels[node] = spare.label.clone();
        info.adopted.push(node);
        info.stop_within_ms = info.stop_within_ms.max(spare.stop_within_ms);
        self.waiting.retain(|j| j.id != spare.id);
        self.replacements += nproc;
        let ranks = node * nproc..(node + 1) * nproc;
        // The lost ranks' replacements are not the hung processes reported before.
        self.hung.retain(|r| !ranks.contains(r));
        for rank in ranks {
            if !self.round_replaced.contains(&rank) {
                self.round_replaced.push(rank);
            }
        }
        Some((node, spare.label, spent + nproc))
    }

    /// Reports global rank `rank` of round `round` as hung (a rank of another node waited for
    /// it past its collective timeout), for its own launcher to kill. `false` if the round is
    /// not running, the rank is not one of its ranks, or it is reported already.
    pub fn report_hung(&mut self, round: u64, rank: usize) -> bool {
        let Phase::Running { info, .. } = &self.phase else {
            return false;
        };
        if info.round != round || rank >= info.world_size() || self.hung.contains(&rank) {
            return false;
        }
        self.hung.push(rank);
        true
    }

    /// Counts `id`'s ranks of round `round` as all exited 0; the last node of the round to do
    /// so ends it as done. `false` if the round is not running (it ended first).
    pub fn mark_done(&mut self, round: u64, id: &str) -> bool {
        let Phase::Running { info, done, .. } = &mut self.phase else {
            return false;
        };
        if info.round != round {
            return false;
        }
        if !done.iter().any(|d| d == id) {
            done.push(id.to_string());
        }
        if info.nodes.iter().all(|n| done.contains(n)) {
            let nodes = info.nodes.len();
            return self.end_round(
                round,
                RoundEnd::new(
                    EndKind::Done,
                    format!("ddprun: every rank of all {nodes} nodes exited 0"),
                    0,
                ),
            );
        }
        true
    }

    /// Notes that a rank of `id` failed in `round` (`end` says how), the moment its launcher
    /// saw it, so that no scale-up or joiner can end the round as anything but a failure.
    /// If a scale-up ended the round first (the two at the same moment), the failure still
    /// counts if its launcher vouches that it came first (`before_the_end`: the rank exited
    /// before that launcher last read the round as still running): it takes the scale-up's
    /// place while the next round gathers (a restart, or the job's end when none is left), or
    /// ends the next round if it already runs. A failure that may have followed the end (the
    /// round's stop on another node can make a rank here fail) or that only relayed a peer's
    /// does not. `false` when there was nothing to note (the round had ended otherwise, or
    /// the job is over).
    pub fn note_failure(
        &mut self,
        round: u64,
        id: &str,
        end: RoundEnd,
        cause: Cause,
        before_the_end: bool,
    ) -> bool {
        if let Phase::Running { info, failed, .. } = &mut self.phase
            && info.round == round
        {
            let noted = NotedFailure {
                node: id.to_string(),
                end,
                cause,
            };
            return match failed.iter_mut().find(|f| f.node == id) {
                // A rank's own error replaces a relay noted before it.
                Some(f) if cause < f.cause => {
                    *f = noted;
                    true
                }
                Some(_) => false,
                None => {
                    failed.push(noted);
                    true
                }
            };
        }
        if cause == Cause::Relayed || !before_the_end {
            // The round had ended when the failure was noted, and nothing says the failure
            // came first: the round's stop (another node's ranks stopped for the scale-up) may
            // have caused it. A rank that only relayed a peer's failure is one such.
            return false;
        }
        let Some(at) = self
            .ends
            .iter()
            .position(|(i, e)| i.round == round && e.kind == EndKind::ScaleUp)
        else {
            return false;
        };
        if self.round != round + 1 {
            return false;
        }
        match &self.phase {
            Phase::Gathering => {
                let info = self.ends[at].0.clone();
                let end = RoundEnd {
                    budget_spent: self.budget_spent(),
                    ..end
                };
                self.ends[at].1 = end.clone();
                match after(&end, &info, self.job.max_restarts) {
                    After::NextRound => self.failures += 1,
                    After::Finish(code) => self.finish_after(&info, end, code),
                }
                true
            }
            Phase::Running { .. } => self.end_round(round + 1, end),
            Phase::Finished { .. } => false,
        }
    }

    /// The job is over after round `info` ended with `end`: every launcher exits with `code`;
    /// the round's nodes and those waiting must read it.
    fn finish_after(&mut self, info: &RoundInfo, end: RoundEnd, code: i32) {
        let mut members = info.nodes.clone();
        for j in &self.waiting {
            if !members.contains(&j.id) {
                members.push(j.id.clone());
            }
        }
        self.phase = Phase::Finished {
            end: RoundEnd {
                exit_code: code,
                ..end
            },
            members,
            acked: Vec::new(),
        };
    }

    /// Ends `round` with its most likely cause among the failures noted in it (`mine`, this
    /// launcher's, when none is noted): a rank killed by a signal, then a rank's own error,
    /// then a rank that only relayed a peer's failure; the earliest first among equals.
    /// `false` if the round had already ended.
    pub fn end_with_failure(&mut self, round: u64, mine: RoundEnd) -> bool {
        let end = match &self.phase {
            Phase::Running { info, failed, .. } if info.round == round => {
                best_failure(failed).map_or(mine, |f| f.end.clone())
            }
            _ => return false,
        };
        self.end_round(round, end)
    }

    /// Ends the job whatever it is doing (the gathering failed, the host was interrupted or
    /// broke). `false` if it was already over.
    pub fn finish(&mut self, end: RoundEnd) -> bool {
        if matches!(self.phase, Phase::Finished { .. }) {
            return false;
        }
        // The running round's nodes; while gathering, the last round's too (some may still be
        // stopping their ranks); and those waiting.
        let mut members: Vec<String> = match (&self.phase, self.ends.last()) {
            (Phase::Running { info, .. }, _) => info.nodes.clone(),
            (Phase::Gathering, Some((info, _))) => info.nodes.clone(),
            _ => Vec::new(),
        };
        for j in &self.waiting {
            if !members.contains(&j.id) {
                members.push(j.id.clone());
            }
        }
        self.phase = Phase::Finished {
            end,
            members,
            acked: Vec::new(),
        };
        true
    }

    /// `id` has read the job's end. `false` if there was nothing to acknowledge.
    pub fn ack(&mut self, id: &str) -> bool {
        match &mut self.phase {
            Phase::Finished { acked, .. } if !acked.iter().any(|a| a == id) => {
                acked.push(id.to_string());
                true
            }
            _ => false,
        }
    }

    /// How long the launchers of the latest round take to stop their ranks.
    pub fn stop_within(&self) -> std::time::Duration {
        let ms = match &self.phase {
            Phase::Running { info, .. } => info.stop_within_ms,
            _ => self.ends.last().map_or(0, |(i, _)| i.stop_within_ms),
        };
        std::time::Duration::from_millis(ms)
    }

    /// The launchers that have not read the job's end yet (empty unless the job is over): its
    /// members and every launcher still waiting to join, also when the end names no member (a
    /// state written by another launchers'-key holder): the host must not close the rendezvous
    /// under a live launcher that has not read how the job ended.
    pub fn unacked(&self) -> Vec<String> {
        match &self.phase {
            Phase::Finished { members, acked, .. } => {
                let mut owed: Vec<String> = Vec::new();
                for id in members.iter().chain(self.waiting.iter().map(|j| &j.id)) {
                    if !acked.contains(id) && !owed.contains(id) {
                        owed.push(id.clone());
                    }
                }
                owed
            }
            _ => Vec::new(),
        }
    }
}

/// The failure most likely to be the round's root cause (see [`State::end_with_failure`]).
fn best_failure(failed: &[NotedFailure]) -> Option<&NotedFailure> {
    failed.iter().min_by_key(|f| f.cause)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(min: usize, max: usize, restarts: usize) -> NodeSpec {
        NodeSpec {
            id: "host".into(),
            host: "h0".into(),
            pid: 1,
            requested_node_rank: 0,
            nproc_per_node: 2,
            command: vec!["train".into()],
            max_restarts: restarts,
            live_recovery: false,
            min_nodes: min,
            max_nodes: max,
            heartbeat_ms: 2_000,
            join_timeout_ms: 30_000,
        }
    }

    fn joiner(id: &str, node_rank: usize, port: u16) -> Joiner {
        Joiner {
            id: id.into(),
            label: format!("node {node_rank}"),
            requested_node_rank: node_rank,
            arrival: 0,
            master_addr: format!("10.0.0.{node_rank}"),
            master_port: port,
            stop_within_ms: 0,
        }
    }

    fn scale_up() -> RoundEnd {
        RoundEnd::new(EndKind::ScaleUp, "n1 waits".into(), 1)
    }

    fn failed(code: i32) -> RoundEnd {
        RoundEnd::new(EndKind::Failed, "rank 1 failed".into(), code)
    }

    /// Under live recovery a lost launcher's node goes to the first spare waiting: it takes
    /// the node rank, its ranks are charged as replacements, and the round runs on. Not for
    /// node 0 (the ranks' store went with it), without a spare, beyond the budget, with a
    /// failure noted, or without live recovery: then the round ends as for any lost launcher.
    #[test]
    fn a_spare_takes_a_lost_node_over_under_live_recovery_only() {
        let live = |restarts| NodeSpec {
            live_recovery: true,
            ..spec(2, 3, restarts)
        };
        let running = |job: NodeSpec| {
            let mut s = State::new(job);
            s.join(joiner("host", 0, 1));
            s.join(joiner("n1", 1, 2));
            s.close().unwrap();
            s
        };
        let mut s = running(live(2));
        assert_eq!(s.hand_over(0, "n1"), None, "nobody waits");
        assert!(s.join(joiner("spare", 2, 3)));
        assert_eq!(
            s.hand_over(0, "host"),
            None,
            "node 0 serves the ranks' store"
        );
        assert_eq!(s.hand_over(1, "n1"), None, "another round");
        assert_eq!(s.hand_over(0, "n1"), Some((1, "node 2".into(), 2)));
        let info = s.running().unwrap();
        assert_eq!(info.nodes, vec!["host".to_string(), "spare".into()]);
        assert_eq!(info.adopted, vec![1]);
        assert!(s.waiting.is_empty() && s.budget_spent() == 2);
        assert_eq!(s.round_replaced, vec![2, 3]);
        // A rank of the lost node reported hung before: its replacement is not.
        let mut s = running(live(2));
        assert!(s.report_hung(0, 3) && s.report_hung(0, 1));
        s.join(joiner("spare", 2, 3));
        assert!(s.hand_over(0, "n1").is_some());
        assert_eq!(s.hung, vec![1]);
        // The budget must hold every rank of the node.
        let mut s = running(live(1));
        s.join(joiner("spare", 2, 3));
        assert_eq!(s.hand_over(0, "n1"), None);
        // Without live recovery, a lost launcher ends the round as ever.
        let mut s = running(spec(2, 3, 5));
        s.join(joiner("spare", 2, 3));
        assert_eq!(s.hand_over(0, "n1"), None);
        // Once a node's ranks have all finished, the group cannot re-form.
        let mut s = running(live(5));
        s.join(joiner("spare", 2, 3));
        assert!(s.mark_done(0, "host"));
        assert_eq!(s.hand_over(0, "n1"), None);
        // A failure noted first wins.
        let mut s = running(live(5));
        s.join(joiner("spare", 2, 3));
        assert!(s.note_failure(0, "host", failed(3), Cause::Own, true));
        assert_eq!(s.hand_over(0, "n1"), None);
    }

    /// One budget for the job: live replacements on any node and failed rounds together. A
    /// failure that only relays the loss of a rank replaced in its round restarts the group
    /// paid for (the replacement spent the budget); one that relays another rank's does not;
    /// and once the budget is spent, a replacement is refused and a failure ends the job.
    #[test]
    fn replacements_and_restarts_spend_one_budget() {
        let mut s = State::new(spec(2, 2, 2));
        s.join(joiner("host", 0, 1));
        s.join(joiner("n1", 1, 2));
        s.close().unwrap();
        assert_eq!(s.charge_replacement(0, 3), Ok(1));
        let relay = |from| RoundEnd {
            relayed_from: Some(from),
            ..failed(3)
        };
        assert!(s.note_failure(0, "host", relay(3), Cause::Relayed, true));
        assert!(s.end_with_failure(0, relay(3)));
        let end = s.end_of(0).unwrap().clone();
        assert!(end.paid && end.budget_spent == 1, "{end:?}");
        assert_eq!((s.failures, s.budget_spent()), (0, 1));
        assert_eq!(s.charge_replacement(0, 1), Err(None), "round 0 is over");

        s.join(joiner("host", 0, 3));
        s.join(joiner("n1", 1, 4));
        s.close().unwrap();
        assert_eq!(s.charge_replacement(1, 2), Ok(2));
        assert_eq!(
            s.charge_replacement(1, 0),
            Err(Some(2)),
            "the budget is spent"
        );
        // A relay of a rank not replaced in this round (rank 0) is no recovery's fallback.
        assert!(s.note_failure(1, "host", relay(0), Cause::Relayed, true));
        assert!(s.end_with_failure(1, relay(0)));
        let end = s.end_of(1).unwrap();
        assert!(!end.paid && end.budget_spent == 2, "{end:?}");
        assert!(matches!(s.phase, Phase::Finished { .. }), "past the budget");
    }

    /// A round is ranked by `--node-rank` then arrival, and its master is its own node 0 —
    /// the host's launcher when it takes part, another node when it does not.
    #[test]
    fn a_rounds_master_is_its_own_node_0() {
        let mut s = State::new(spec(1, 3, 1));
        for (seq, j) in [joiner("b", 2, 22), joiner("a", 1, 11)]
            .into_iter()
            .enumerate()
        {
            s.seq = seq as u64;
            assert!(s.join(j));
        }
        let info = s.close().unwrap();
        assert_eq!(info.nodes, ["a", "b"]);
        assert_eq!(
            (info.master_addr.as_str(), info.master_port),
            ("10.0.0.1", 11)
        );
        assert!(s.waiting.is_empty() && s.close().is_none());
        // Rejoining replaces the address but keeps the place in line.
        s.seq = 7;
        assert!(s.join(joiner("z", 0, 1)));
        assert!(s.join(joiner("z", 0, 2)));
        assert_eq!(
            (
                s.waiting.len(),
                s.waiting[0].arrival,
                s.waiting[0].master_port
            ),
            (1, 7, 2)
        );
        assert!(s.leave("z") && !s.leave("z"));
    }

    /// The first end wins; a failure restarts while the budget lasts, then finishes with its
    /// code; every member but the acked ones is owed the end.
    #[test]
    fn the_first_end_wins_and_failures_spend_the_budget() {
        let mut s = State::new(spec(2, 2, 1));
        s.join(joiner("host", 0, 1));
        s.join(joiner("n1", 1, 2));
        s.close().unwrap();
        assert!(s.end_round(0, failed(137)));
        assert!(
            !s.end_round(0, failed(1)),
            "a second end of the same round loses"
        );
        assert_eq!((s.round, s.failures, &s.phase), (1, 1, &Phase::Gathering));
        assert_eq!(s.end_of(0).unwrap().exit_code, 137);
        s.join(joiner("n1", 1, 3));
        s.join(joiner("host", 0, 4));
        let info = s.close().unwrap();
        assert_eq!(info.failures_before, 1);
        assert!(s.mark_done(1, "host"));
        assert!(s.end_round(1, failed(3)));
        assert_eq!(s.end_of(1).unwrap().exit_code, 3);
        assert!(matches!(s.phase, Phase::Finished { .. }));
        assert!(!s.join(joiner("late", 2, 5)), "nobody joins a finished job");
        assert_eq!(s.unacked(), ["host", "n1"]);
        assert!(s.ack("n1") && !s.ack("n1"));
        assert_eq!(s.unacked(), ["host"]);
        assert!(!s.finish(failed(9)), "a finished job stays finished");
    }

    /// An end that names no member (written by another launchers'-key holder while two
    /// launchers wait) is still owed to both: the host waits for them to read it.
    #[test]
    fn an_end_without_members_is_owed_to_every_waiting_launcher() {
        let mut s = State::new(spec(3, 3, 0));
        s.join(joiner("host", 0, 1));
        s.join(joiner("n1", 1, 2));
        s.phase = Phase::Finished {
            end: failed(0),
            members: Vec::new(),
            acked: Vec::new(),
        };
        assert_eq!(s.unacked(), ["host", "n1"]);
        assert!(s.ack("host"));
        assert_eq!(s.unacked(), ["n1"]);
    }

    /// Every node done ends the round as done, once; scale-ups do not spend the budget.
    #[test]
    fn the_last_node_done_ends_the_round_and_scale_ups_are_free() {
        let mut s = State::new(spec(1, 2, 0));
        s.join(joiner("host", 0, 1));
        s.close().unwrap();
        let scale_up = scale_up();
        assert!(s.end_round(0, scale_up));
        assert_eq!((s.round, s.failures), (1, 0));
        s.join(joiner("host", 0, 1));
        s.join(joiner("n1", 1, 2));
        s.close().unwrap();
        assert!(s.mark_done(1, "n1") && s.running().is_some());
        assert!(s.mark_done(1, "host"));
        let Phase::Finished { end, .. } = &s.phase else {
            panic!("{:?}", s.phase)
        };
        assert_eq!((end.kind, end.exit_code), (EndKind::Done, 0));
        assert!(!s.mark_done(1, "host"));
    }

    /// A noted failure turns a scale-up into itself; the best cause noted wins the claim;
    /// a relay is replaced by its node's own error.
    #[test]
    fn a_noted_failure_is_never_lost_and_the_likeliest_cause_wins() {
        let mut s = State::new(spec(1, 2, 0));
        s.join(joiner("host", 0, 1));
        s.close().unwrap();
        let relay = RoundEnd {
            line: "rank 0 relayed".into(),
            ..failed(1)
        };
        assert!(s.note_failure(0, "host", relay.clone(), Cause::Relayed, true));
        assert!(!s.note_failure(0, "host", relay, Cause::Relayed, true));
        assert!(
            s.note_failure(0, "host", failed(3), Cause::Own, true),
            "own replaces relay"
        );
        let scale_up = scale_up();
        assert!(s.end_round(0, scale_up));
        let Phase::Finished { end, .. } = &s.phase else {
            panic!("{:?}", s.phase)
        };
        assert_eq!((end.kind, end.exit_code), (EndKind::Failed, 3));
        assert!(!s.completed());

        // Several nodes: a signal beats an own error noted first.
        let mut s = State::new(spec(2, 2, 0));
        s.join(joiner("host", 0, 1));
        s.join(joiner("n1", 1, 2));
        s.close().unwrap();
        assert!(s.note_failure(0, "host", failed(3), Cause::Own, true));
        let killed = RoundEnd {
            line: "rank 2 killed".into(),
            ..failed(137)
        };
        assert!(s.note_failure(0, "n1", killed, Cause::Signal, true));
        assert!(s.end_with_failure(0, failed(3)));
        assert_eq!(s.end_of(0).unwrap().exit_code, 137);
    }

    /// A failure noted just after a scale-up ended its round still counts: it takes the
    /// scale-up's place (the job ends with its code when no restart is left; a restart is
    /// spent otherwise); a relayed one does not (the stop caused it).
    #[test]
    fn a_failure_noted_after_a_scale_up_takes_its_place() {
        let scale_up = scale_up();
        for (restarts, finished) in [(0, true), (1, false)] {
            let mut s = State::new(spec(1, 2, restarts));
            s.join(joiner("host", 0, 1));
            s.close().unwrap();
            s.join(joiner("n1", 1, 2));
            assert!(s.end_round(0, scale_up.clone()));
            assert!(!s.note_failure(0, "host", failed(1), Cause::Relayed, true));
            assert!(
                !s.note_failure(0, "host", failed(3), Cause::Own, false),
                "a failure that may have followed the end does not count"
            );
            assert!(s.note_failure(0, "host", failed(3), Cause::Own, true));
            assert_eq!(s.end_of(0).unwrap().kind, EndKind::Failed);
            assert_eq!(matches!(s.phase, Phase::Finished { .. }), finished);
            if finished {
                assert_eq!(s.unacked(), ["host", "n1"]);
            } else {
                assert_eq!((s.failures, s.round), (1, 1));
            }
        }
    }

    /// A join tried again after its first try landed (the round closed with it meanwhile)
    /// does not queue the launcher again; a job that ends while the next round gathers is
    /// owed to the last round's nodes too.
    #[test]
    fn a_repeated_join_is_not_a_newcomer_and_the_last_rounds_nodes_read_the_end() {
        let mut s = State::new(spec(1, 3, 1));
        assert!(s.join(joiner("host", 0, 1)));
        s.close().unwrap();
        assert!(!s.join(joiner("host", 0, 1)));
        assert!(s.waiting.is_empty());
        assert!(s.end_round(0, failed(3)));
        assert!(s.join(joiner("n1", 1, 2)));
        assert!(s.finish(failed(143)));
        assert_eq!(s.unacked(), ["host", "n1"]);
    }

    /// Only a round that every node finished with exit 0 completes a job; an end written
    /// before any round ran does not, whatever its code.
    #[test]
    fn only_a_done_round_completes_the_job() {
        let mut s = State::new(spec(2, 2, 0));
        assert!(s.finish(RoundEnd::new(EndKind::Done, "forged".into(), 0)));
        assert!(!s.completed());
        let mut s = State::new(spec(1, 1, 0));
        s.join(joiner("host", 0, 1));
        s.close().unwrap();
        assert!(s.mark_done(0, "host"));
        assert!(s.completed());
    }

    /// The state survives its encoding (what the store holds).
    #[test]
    fn the_state_round_trips_through_its_encoding() {
        let mut s = State::new(spec(1, 2, 0));
        s.join(joiner("host", 0, 1));
        s.refuse("a line".into());
        s.close();
        let bytes = super::super::messages::encode(&s);
        let back: State = super::super::messages::decode("h:1", "state", &bytes).unwrap();
        assert_eq!(back, s);
    }
}
