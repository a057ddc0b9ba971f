//! The flight recorder: one per process, always on (unless `DDP_RECORDER=0`), a fixed ring of
//! the last collectives plus the step, the phase and where the last steps' time went.
//!
//! A collective costs two monotonic clock reads and two uncontended lock round trips (its
//! issue and its end); a phase change and a step's end one each. Nothing allocates after the
//! ring is full except a label's text, which is built only when a snapshot is taken.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::phase::Phase;
use crate::snapshot::{CollectiveRecord, RankSnapshot, StepRecord};

/// `DDP_RECORDER=0` turns the recorder off (for measuring its cost); anything else, or unset,
/// leaves it on.
pub const RECORDER_VAR: &str = "DDP_RECORDER";
/// How many collectives the ring keeps.
pub const RING_SIZE: usize = 64;
/// How many completed steps a snapshot carries.
pub const STEPS_KEPT: usize = 16;

/// What a caller says its next collective is: `what` and an optional index
/// (`gradient bucket` and 3 → "gradient bucket 3").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Label {
    what: &'static str,
    index: Option<u64>,
}

impl Label {
    /// A label without an index.
    pub const fn new(what: &'static str) -> Self {
        Label { what, index: None }
    }

    /// A label with an index.
    pub const fn indexed(what: &'static str, index: u64) -> Self {
        Label {
            what,
            index: Some(index),
        }
    }

    fn text(self) -> String {
        match self.index {
            Some(i) => format!("{} {i}", self.what),
            None => self.what.to_string(),
        }
    }
}

/// A collective in flight, from [`issue`] to [`finish`].
#[derive(Debug)]
#[must_use = "a collective issued must be finished"]
pub struct Ticket {
    id: u64,
    issued: Instant,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    id: u64,
    group: &'static str,
    seq: u64,
    op: &'static str,
    dtype: &'static str,
    count: usize,
    label: Option<Label>,
    step: u64,
    phase: Phase,
    issued: Instant,
    finished: Option<Instant>,
    failed: bool,
}

struct Recorder {
    epoch: Instant,
    epoch_unix_ms: f64,
    ring: VecDeque<Slot>,
    next_id: u64,
    pending_label: Option<Label>,
    finished: u64,
    step: u64,
    phase: Phase,
    phase_since: Instant,
    step_started: Instant,
    phase_time: [Duration; Phase::ALL.len()],
    collective_time: [Duration; Phase::ALL.len()],
    steps: VecDeque<StepRecord>,
}

impl Recorder {
    fn new() -> Self {
        let epoch = Instant::now();
        let epoch_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3);
        Recorder {
            epoch,
            epoch_unix_ms,
            ring: VecDeque::with_capacity(RING_SIZE),
            next_id: 0,
            pending_label: None,
            finished: 0,
            step: 0,
            phase: Phase::Setup,
            phase_since: epoch,
            step_started: epoch,
            phase_time: Default::default(),
            collective_time: Default::default(),
            steps: VecDeque::with_capacity(STEPS_KEPT),
        }
    }

    fn unix_ms(&self, t: Instant) -> f64 {
        self.epoch_unix_ms + t.saturating_duration_since(self.epoch).as_secs_f64() * 1e3
    }

    fn close_phase(&mut self, now: Instant) {
        self.phase_time[self.phase.index()] += now.saturating_duration_since(self.phase_since);
        self.phase_since = now;
    }
}

static ENABLED: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;

/// Whether the recorder is on (`DDP_RECORDER` is not `0`; read once).
pub fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on = std::env::var(RECORDER_VAR).map_or(true, |v| v.trim() != "0");
            ENABLED.store(if on { ON } else { OFF }, Ordering::Relaxed);
            on
        }
    }
}

/// Turns the recorder on or off from now on, whatever `DDP_RECORDER` says (a benchmark's A/B
/// in one process: `cargo xtask bench ddp`). A collective issued while on and ending while
/// off is still finished.
pub fn set_enabled(on: bool) {
    ENABLED.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

fn recorder() -> MutexGuard<'static, Recorder> {
    static RECORDER: OnceLock<Mutex<Recorder>> = OnceLock::new();
    let cell = RECORDER.get_or_init(|| Mutex::new(Recorder::new()));
    // A panic while holding the lock leaves plain data behind: keep recording.
    cell.lock().unwrap_or_else(|p| p.into_inner())
}

/// Labels the next collective this process issues (any thread): the flight recorder shows it
/// with the label, e.g. `all_reduce #8213 (gradient bucket 0 of step 412)`.
pub fn label_next(label: Label) {
    if enabled() {
        recorder().pending_label = Some(label);
    }
}

/// Records call `seq` of a `group` (`host`, `nccl`): `op` of `count` × `dtype`, issued now.
/// `None` when the recorder is off.
pub fn issue(
    group: &'static str,
    op: &'static str,
    dtype: &'static str,
    count: usize,
    seq: u64,
) -> Option<Ticket> {
    if !enabled() {
        return None;
    }
    let issued = Instant::now();
    let mut r = recorder();
    let id = r.next_id;
    r.next_id += 1;
    if r.ring.len() == RING_SIZE {
        r.ring.pop_front();
    }
    let slot = Slot {
        id,
        group,
        seq,
        op,
        dtype,
        count,
        label: r.pending_label.take(),
        step: r.step,
        phase: r.phase,
        issued,
        finished: None,
        failed: false,
    };
    r.ring.push_back(slot);
    Some(Ticket { id, issued })
}

/// Records the end of the collective `ticket` stands for (`failed`: it returned an error).
pub fn finish(ticket: Ticket, failed: bool) {
    let now = Instant::now();
    let mut r = recorder();
    let phase = r.phase.index();
    r.collective_time[phase] += now.saturating_duration_since(ticket.issued);
    r.finished += 1;
    if let Some(s) = r.ring.iter_mut().rev().find(|s| s.id == ticket.id) {
        s.finished = Some(now);
        s.failed = failed;
    }
}

/// Marks the phase this rank enters.
pub fn set_phase(phase: Phase) {
    if !enabled() {
        return;
    }
    let now = Instant::now();
    let mut r = recorder();
    if r.phase != phase {
        r.close_phase(now);
        r.phase = phase;
    }
}

/// The phase this rank is in, as last marked.
pub fn phase() -> Phase {
    if enabled() {
        recorder().phase
    } else {
        Phase::Setup
    }
}

/// Marks the end of a step (the optimizer's update done): the step's time goes into the
/// recorder's step history and the step number advances. The phase becomes [`Phase::Data`]
/// (what follows an update in a training loop) until the program marks another.
pub fn step_done() {
    if !enabled() {
        return;
    }
    let now = Instant::now();
    let mut r = recorder();
    r.close_phase(now);
    let total = now.saturating_duration_since(r.step_started);
    let collective: Duration = r.collective_time.iter().sum();
    let busy_by_phase_ms: BTreeMap<Phase, f64> = Phase::ALL
        .iter()
        .filter_map(|&p| {
            let busy = r.phase_time[p.index()].saturating_sub(r.collective_time[p.index()]);
            (!busy.is_zero()).then_some((p, busy.as_secs_f64() * 1e3))
        })
        .collect();
    if r.steps.len() == STEPS_KEPT {
        r.steps.pop_front();
    }
    let record = StepRecord {
        step: r.step,
        total_ms: total.as_secs_f64() * 1e3,
        collective_ms: collective.as_secs_f64() * 1e3,
        busy_by_phase_ms,
    };
    r.steps.push_back(record);
    r.phase_time = Default::default();
    r.collective_time = Default::default();
    r.step_started = now;
    r.step += 1;
    r.phase = Phase::Data;
}

/// Sets the step number (a program resuming at step `step` after a restart).
pub fn set_step(step: u64) {
    if enabled() {
        recorder().step = step;
    }
}

/// The step this rank is in.
pub fn step() -> u64 {
    if enabled() { recorder().step } else { 0 }
}

/// This process's recorder now, as global rank `rank` publishes it.
pub fn snapshot(rank: usize) -> RankSnapshot {
    let r = recorder();
    let collectives = r
        .ring
        .iter()
        .map(|s| CollectiveRecord {
            group: s.group.to_string(),
            seq: s.seq,
            op: s.op.to_string(),
            dtype: s.dtype.to_string(),
            count: s.count,
            label: s.label.map(Label::text),
            step: s.step,
            phase: s.phase,
            issued_ms: r.unix_ms(s.issued),
            finished_ms: s.finished.map(|t| r.unix_ms(t)),
            failed: s.failed,
        })
        .collect();
    RankSnapshot {
        rank,
        pid: std::process::id(),
        // The wall clock now (not the recorder's epoch plus its running time): the launcher
        // compares it with its own reading of the same clock.
        written_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3),
        step: r.step,
        phase: r.phase,
        phase_since_ms: r.unix_ms(r.phase_since),
        finished: r.finished,
        collectives,
        steps: r.steps.iter().cloned().collect(),
        observed: None,
    }
}

/// Marks `phase` until the guard drops, then the phase before it again.
pub fn enter(phase: Phase) -> PhaseGuard {
    let before = self::phase();
    set_phase(phase);
    PhaseGuard { before }
}

/// From [`enter`]: restores the phase before it when dropped.
#[derive(Debug)]
#[must_use = "the phase ends when the guard drops"]
pub struct PhaseGuard {
    before: Phase,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        set_phase(self.before);
    }
}
