//! The parts of the launchers' rendezvous state ([`super::state::State`]): a launcher's
//! configuration ([`NodeSpec`]), a round as it was closed ([`RoundInfo`]), how a round ended
//! ([`RoundEnd`]), and the one rule every launcher applies to an end ([`after`]).

use serde::{Deserialize, Serialize};

use ddp_comm::error::{CommError, Result};

/// One launcher's configuration, published when it first joins. Every launcher of a job must
/// agree on everything but `id`, `host`, `pid` and `requested_node_rank`: the heartbeat and
/// join timeouts too. The grace period is each node's own (the host waits for the longest
/// a round's nodes announced, [`RoundInfo::stop_within_ms`]); the last call is the host's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeSpec {
    /// Random, unique for this launcher process.
    pub id: String,
    /// The host identity (hostname and boot id, or `DDP_HOST_ID`).
    pub host: String,
    /// The launcher's process id.
    pub pid: u32,
    /// `--node-rank` as given (0 hosts the rendezvous; the others sort by it).
    pub requested_node_rank: usize,
    /// `--nproc-per-node`.
    pub nproc_per_node: usize,
    /// The program and its arguments.
    pub command: Vec<String>,
    /// `--max-restarts`.
    pub max_restarts: usize,
    /// `--recover live` (every node's ranks must re-form their group for a replacement on any
    /// node to help; absent from a launcher that predates it: off).
    #[serde(default)]
    pub live_recovery: bool,
    /// `--nnodes MIN:MAX`, the MIN.
    pub min_nodes: usize,
    /// `--nnodes MIN:MAX`, the MAX.
    pub max_nodes: usize,
    /// `--rdzv-heartbeat-secs`, in ms: every launcher judges the others, and is judged, by
    /// the same timeout.
    pub heartbeat_ms: u64,
    /// `--rdzv-join-timeout`, in ms.
    pub join_timeout_ms: u64,
}

impl NodeSpec {
    /// How messages name this launcher: `node 1 (ddprun pid 4242 on host-b)`.
    pub fn label(&self) -> String {
        // The host identity is `hostname/boot-id` (or DDP_HOST_ID): the hostname says enough.
        let host = self.host.split(['/', ' ']).next().unwrap_or("?");
        format!(
            "node {} (ddprun pid {} on {host})",
            self.requested_node_rank, self.pid
        )
    }

    /// What `self` sets differently from `reference`, one phrase each, e.g.
    /// `--nproc-per-node 2 (node 0 has 1)`.
    pub fn differences(&self, reference: &NodeSpec) -> Vec<String> {
        let mut out = Vec::new();
        let mut differ = |what: &str, here: String, there: String| {
            if here != there {
                out.push(format!("{what} {here} (node 0 has {there})"));
            }
        };
        differ(
            "--nproc-per-node",
            self.nproc_per_node.to_string(),
            reference.nproc_per_node.to_string(),
        );
        differ(
            "--max-restarts",
            self.max_restarts.to_string(),
            reference.max_restarts.to_string(),
        );
        let recover = |live: bool| if live { "live" } else { "restart" }.to_string();
        differ(
            "--recover",
            recover(self.live_recovery),
            recover(reference.live_recovery),
        );
        differ(
            "--nnodes",
            format!("{}:{}", self.min_nodes, self.max_nodes),
            format!("{}:{}", reference.min_nodes, reference.max_nodes),
        );
        let secs = |ms: u64| format!("{}", ms as f64 / 1000.0);
        differ(
            "--rdzv-heartbeat-secs",
            secs(self.heartbeat_ms),
            secs(reference.heartbeat_ms),
        );
        differ(
            "--rdzv-join-timeout",
            secs(self.join_timeout_ms),
            secs(reference.join_timeout_ms),
        );
        differ(
            "the program",
            format!("{:?}", self.command),
            format!("{:?}", reference.command),
        );
        out
    }
}

/// A round as the rendezvous host closed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RoundInfo {
    /// The round number (`DDP_RESTART_COUNT` of its ranks).
    pub round: u64,
    /// The launchers taking part, by node rank (their [`NodeSpec::id`]s).
    pub nodes: Vec<String>,
    /// Their labels, in the same order.
    pub labels: Vec<String>,
    /// Ranks per node.
    pub nproc_per_node: usize,
    /// Where the round's rank 0 serves its store: the address of the round's node 0.
    pub master_addr: String,
    /// Its port, fresh for every round.
    pub master_port: u16,
    /// The longest any of its launchers takes to stop its ranks (grace period and output
    /// drain), in milliseconds: how long the host waits for them to read the job's end.
    pub stop_within_ms: u64,
    /// Rounds that ended in a failure before this one (they count against `--max-restarts`).
    pub failures_before: usize,
    /// Node ranks whose launcher was lost while the round ran and was replaced by a spare
    /// launcher (`--recover live`): that launcher starts the node's ranks as replacements of
    /// lost ones (`DDP_REJOIN=1`) in the running group.
    #[serde(default)]
    pub adopted: Vec<usize>,
}

impl RoundInfo {
    /// This launcher's node rank in the round, if it takes part.
    pub fn node_rank(&self, id: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n == id)
    }

    /// The round's world size.
    pub fn world_size(&self) -> usize {
        self.nodes.len() * self.nproc_per_node
    }
}

/// Why a round ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum EndKind {
    /// Every rank of every node exited 0: the job is done.
    Done,
    /// A rank failed (counts against `--max-restarts`).
    Failed,
    /// A launcher was lost: killed, stopped or cut off (counts against `--max-restarts`).
    Lost,
    /// A launcher got SIGINT or SIGTERM and left the job (counts against `--max-restarts`;
    /// the others go on without it while the budget and `MIN` allow).
    Left,
    /// The rendezvous host's launcher got SIGINT or SIGTERM: the job ends.
    Interrupted,
    /// A launcher is waiting to join and the round has room: the group restarts to admit it
    /// (does not count against `--max-restarts`).
    ScaleUp,
    /// The job could not go on: too few nodes within the join timeout, or the coordinator
    /// failed.
    Refused,
    /// The rendezvous host found that it had not been running for longer than the heartbeat
    /// timeout (stopped, frozen): the others have given it up, so the job ends.
    HostLost,
}

/// How likely a rank's failure is the root cause of a round's end, most likely first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum Cause {
    /// The rank was killed by a signal (its peers then fail on the closed connection).
    Signal,
    /// The rank exited non-zero on an error of its own.
    Own,
    /// The rank exited non-zero on a peer's failure it only relayed (it said so through
    /// `DDP_FAILURE_FILE`, see `ddp_comm::env::note_peer_failure`).
    Relayed,
}

/// How a round ended, written once (the first claim wins).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RoundEnd {
    /// Why.
    pub kind: EndKind,
    /// One line for every launcher to print, naming the node and what happened there.
    pub line: String,
    /// The exit code every launcher exits with if the job ends here.
    pub exit_code: i32,
    /// How much of `--max-restarts` the job had spent when the round ended: failed rounds
    /// and live replacements together, counted in the shared state (absent from a launcher
    /// that predates it: 0, and then [`RoundInfo::failures_before`] counts).
    #[serde(default)]
    pub budget_spent: usize,
    /// A failure whose restart costs nothing: a rank of the round was replaced live (the
    /// replacement spent the budget) and the ranks then failed only on that rank's failure (a
    /// live recovery that could not complete, as ZeRO-1 without a shard's copy): the group
    /// restart is that recovery's fallback, paid for.
    #[serde(default)]
    pub paid: bool,
    /// For a rank's failure that only relayed a peer's: that peer's global rank (the state
    /// makes the restart [`RoundEnd::paid`] only when it is a rank replaced live in the round).
    #[serde(default)]
    pub relayed_from: Option<usize>,
}

impl RoundEnd {
    /// An end of `kind` with `line` and `exit_code`, the budget not stamped yet (the state
    /// stamps it when the end is written, [`super::state::State::end_round`]).
    pub fn new(kind: EndKind, line: String, exit_code: i32) -> Self {
        RoundEnd {
            kind,
            line,
            exit_code,
            budget_spent: 0,
            paid: false,
            relayed_from: None,
        }
    }

    /// The budget spent before this end: the state's stamp, or the round's failed rounds.
    pub fn spent_before(&self, info: &RoundInfo) -> usize {
        self.budget_spent.max(info.failures_before)
    }
}

/// What every launcher (and the host) does after a round's end: the same answer on all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// The job is over, with this exit code.
    Finish(i32),
    /// Join the next round.
    NextRound,
}

/// The rule: `Done` finishes with 0; `Interrupted`, `Refused` and `HostLost` finish with the
/// end's code; a failure, a lost node or a node that left restarts while less than
/// `max_restarts` of the budget was spent before it (failed rounds and live replacements
/// together), or when its restart is paid for ([`RoundEnd::paid`]); a scale-up always
/// restarts.
pub(crate) fn after(end: &RoundEnd, info: &RoundInfo, max_restarts: usize) -> After {
    match end.kind {
        EndKind::Done => After::Finish(0),
        EndKind::Interrupted | EndKind::Refused | EndKind::HostLost => After::Finish(end.exit_code),
        EndKind::ScaleUp => After::NextRound,
        EndKind::Failed | EndKind::Lost | EndKind::Left
            if end.paid || end.spent_before(info) < max_restarts =>
        {
            After::NextRound
        }
        EndKind::Failed | EndKind::Lost | EndKind::Left => After::Finish(end.exit_code),
    }
}

/// Whether `end` counts against `--max-restarts`.
pub(crate) fn is_failure(end: &RoundEnd) -> bool {
    matches!(end.kind, EndKind::Failed | EndKind::Lost | EndKind::Left)
}

/// Encodes a message for the store.
pub(crate) fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("the rendezvous messages always serialise")
}

/// Decodes a message read from key `key` of the store at `addr`.
pub(crate) fn decode<T: for<'de> Deserialize<'de>>(
    addr: &str,
    key: &str,
    bytes: &[u8],
) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| CommError::Store {
        addr: addr.to_string(),
        msg: format!(
            "malformed launcher rendezvous value at {key:?} ({e}): is a launcher of another ddprun version in this job?"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(node: usize) -> NodeSpec {
        NodeSpec {
            id: format!("id{node}"),
            host: format!("host{node} boot"),
            pid: 100 + node as u32,
            requested_node_rank: node,
            nproc_per_node: 2,
            command: vec!["train".into(), "--epochs".into(), "1".into()],
            max_restarts: 2,
            live_recovery: false,
            min_nodes: 1,
            max_nodes: 2,
            heartbeat_ms: 10_000,
            join_timeout_ms: 300_000,
        }
    }

    fn info(failures_before: usize) -> RoundInfo {
        RoundInfo {
            round: 3,
            nodes: vec!["id0".into(), "id1".into()],
            labels: vec![spec(0).label(), spec(1).label()],
            nproc_per_node: 2,
            master_addr: "127.0.0.1".into(),
            master_port: 1234,
            stop_within_ms: 0,
            failures_before,
            adopted: Vec::new(),
        }
    }

    fn end(kind: EndKind) -> RoundEnd {
        RoundEnd::new(kind, "x".into(), 137)
    }

    #[test]
    fn launchers_that_differ_are_named_with_both_values() {
        assert_eq!(spec(1).label(), "node 1 (ddprun pid 101 on host1)");
        assert!(spec(1).differences(&spec(0)).is_empty());
        let other = NodeSpec {
            nproc_per_node: 4,
            command: vec!["train".into()],
            ..spec(1)
        };
        assert_eq!(
            other.differences(&spec(0)),
            [
                "--nproc-per-node 4 (node 0 has 2)".to_string(),
                r#"the program ["train"] (node 0 has ["train", "--epochs", "1"])"#.to_string(),
            ]
        );
        let restarts = NodeSpec {
            max_restarts: 0,
            live_recovery: true,
            max_nodes: 3,
            heartbeat_ms: 1_500,
            ..spec(1)
        };
        assert_eq!(
            restarts.differences(&spec(0)),
            [
                "--max-restarts 0 (node 0 has 2)".to_string(),
                "--recover live (node 0 has restart)".to_string(),
                "--nnodes 1:3 (node 0 has 1:2)".to_string(),
                "--rdzv-heartbeat-secs 1.5 (node 0 has 10)".to_string(),
            ]
        );
    }

    #[test]
    fn failures_restart_until_the_budget_is_spent_and_scale_ups_always_do() {
        assert_eq!(after(&end(EndKind::Done), &info(5), 2), After::Finish(0));
        assert_eq!(after(&end(EndKind::Failed), &info(0), 2), After::NextRound);
        assert_eq!(after(&end(EndKind::Lost), &info(1), 2), After::NextRound);
        assert_eq!(
            after(&end(EndKind::Failed), &info(2), 2),
            After::Finish(137)
        );
        assert_eq!(
            after(&end(EndKind::Failed), &info(0), 0),
            After::Finish(137)
        );
        assert_eq!(after(&end(EndKind::ScaleUp), &info(2), 2), After::NextRound);
        assert_eq!(
            after(&end(EndKind::Interrupted), &info(0), 2),
            After::Finish(137)
        );
        assert_eq!(
            after(&end(EndKind::Refused), &info(0), 2),
            After::Finish(137)
        );
        assert!(is_failure(&end(EndKind::Lost)) && !is_failure(&end(EndKind::ScaleUp)));
        assert!(is_failure(&end(EndKind::Left)));
        assert_eq!(after(&end(EndKind::Left), &info(0), 1), After::NextRound);
        // Live replacements spent the budget too: the state's stamp counts them.
        let replaced = RoundEnd {
            budget_spent: 2,
            ..end(EndKind::Failed)
        };
        assert_eq!(after(&replaced, &info(0), 2), After::Finish(137));
        assert_eq!(after(&replaced, &info(0), 3), After::NextRound);
        // A paid restart (the fallback of a live recovery that could not complete) is free.
        let paid = RoundEnd {
            paid: true,
            ..replaced
        };
        assert_eq!(after(&paid, &info(0), 2), After::NextRound);
    }

    #[test]
    fn messages_round_trip_and_garbage_is_a_clear_error() {
        let started = info(1);
        let bytes = encode(&started);
        assert_eq!(
            decode::<RoundInfo>("h:1", "round/3", &bytes).unwrap(),
            started
        );
        assert_eq!(info(0).node_rank("id1"), Some(1));
        assert_eq!(info(0).node_rank("nope"), None);
        assert_eq!(info(0).world_size(), 4);
        let err = decode::<RoundEnd>("h:1", "end/3", b"{oops").unwrap_err();
        assert!(err.to_string().contains("\"end/3\""), "{err}");
    }
}
