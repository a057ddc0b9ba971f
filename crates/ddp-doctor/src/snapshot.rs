//! What a rank publishes (its [`RankSnapshot`]) and what its launcher adds ([`Observed`]): the
//! JSON of a progress file, a dump and `ddprun doctor`'s input.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::phase::Phase;

/// One collective in a rank's flight recorder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveRecord {
    /// Which kind of group ran it: `host` (a `ddp_comm::ProcessGroup`) or `nccl`; call numbers
    /// count per kind.
    pub group: String,
    /// The group's call number (`#seq`: the same call has the same number on every rank).
    pub seq: u64,
    /// The operation (`all_reduce`, `broadcast_bytes`, …).
    pub op: String,
    /// The element type (`f32`, `u8`, `bf16` …).
    pub dtype: String,
    /// This rank's element count.
    pub count: usize,
    /// What the caller said it is (`gradient bucket 3`), when it said so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// The rank's step when it was issued.
    pub step: u64,
    /// The rank's phase when it was issued.
    pub phase: Phase,
    /// When it was issued (and, on CPU transports, started): Unix time in milliseconds.
    pub issued_ms: f64,
    /// When it returned; `None` while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_ms: Option<f64>,
    /// It returned an error (the group is then broken).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

impl CollectiveRecord {
    /// `all_reduce #8213 (gradient bucket 0 of step 412)`.
    pub fn describe(&self) -> String {
        let op = match self.group.as_str() {
            "host" => self.op.clone(),
            g => format!("{} {}", g.to_uppercase(), self.op),
        };
        match &self.label {
            Some(l) => format!("{op} #{} ({l} of step {})", self.seq, self.step),
            None if self.count == 0 => format!("{op} #{} (step {})", self.seq, self.step),
            None => format!(
                "{op} #{} ({} × {}, step {})",
                self.seq, self.count, self.dtype, self.step
            ),
        }
    }

    /// Whether `other` is the same call (same kind of group, same call number).
    pub fn same_call(&self, other: &CollectiveRecord) -> bool {
        self.group == other.group && self.seq == other.seq
    }
}

/// One completed step of a rank: how long it took and where the time went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// The step's number.
    pub step: u64,
    /// From the previous step's end to this one's, in milliseconds.
    pub total_ms: f64,
    /// Of it, inside collectives (waiting for the other ranks included).
    pub collective_ms: f64,
    /// The rest (the rank's own work), by phase.
    pub busy_by_phase_ms: BTreeMap<Phase, f64>,
}

impl StepRecord {
    /// The rank's own work: the step less its time in collectives.
    pub fn busy_ms(&self) -> f64 {
        (self.total_ms - self.collective_ms).max(0.0)
    }
}

/// A rank's progress, as it publishes it a few times a second.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSnapshot {
    /// The rank's global rank (`RANK`).
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// When it was written: Unix time in milliseconds.
    pub written_ms: f64,
    /// The step it is in (steps completed so far, plus the one it resumed at).
    pub step: u64,
    /// The phase it is in.
    pub phase: Phase,
    /// Since when (Unix milliseconds).
    pub phase_since_ms: f64,
    /// Collectives finished so far.
    pub finished: u64,
    /// The last collectives, oldest first (the last one may still run).
    pub collectives: Vec<CollectiveRecord>,
    /// The last completed steps, oldest first.
    pub steps: Vec<StepRecord>,
    /// What the launcher saw of the process (absent in a rank's own file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<Observed>,
}

impl RankSnapshot {
    /// The collective this rank is inside, if any.
    pub fn waiting_in(&self) -> Option<&CollectiveRecord> {
        self.collectives
            .last()
            .filter(|c| c.finished_ms.is_none() && !c.failed)
    }

    /// When this rank last finished a collective (Unix milliseconds).
    pub fn last_finished_ms(&self) -> Option<f64> {
        self.collectives
            .iter()
            .filter_map(|c| c.finished_ms)
            .reduce(f64::max)
    }
}

/// What the launcher saw of a rank's process when it read its progress.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    /// The process's state (`running`, `sleeping`, `stopped`, `disk sleep`, `zombie`, `exited`).
    pub process: String,
    /// When the launcher looked (Unix milliseconds).
    pub seen_ms: f64,
    /// The main thread's stack, innermost frame first (`function (file:line)`), when taken.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stack: Vec<String>,
    /// Why no stack was taken, when one was wanted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack_error: Option<String>,
}
