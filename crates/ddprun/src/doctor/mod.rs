//! The hang doctor's launcher side: the watch loop reads its ranks' progress files (see
//! [`ddp_doctor`]), adds what it sees of each process (its state, and the stack of a rank
//! that holds the others up), shares them with the other nodes' launchers ([`share`]), and
//! prints one verdict per incident while every rank is still alive: a hang (no collective
//! finished for `--hang-after`, ranks wait in one: which, in what, and where each other rank
//! is) or a straggler (a warning: the job goes on). Dumps on SIGUSR1, and with
//! `--dump-on-hang DIR` at every hang and at a rank's failure; `ddprun doctor DIR`
//! ([`command`]) reads them.

pub(crate) mod command;
mod process;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod ptrace;
pub(crate) mod share;
mod stacks;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod unwind;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ddp_doctor::verdict::{self, Hang, Thresholds, Whereabouts};
use ddp_doctor::{Observed, RankSnapshot};

use crate::LaunchConfig;
use crate::failure_notes::FailureNotes;

/// How often the watch loop reads the progress files.
const POLL_EVERY: Duration = Duration::from_millis(250);
/// Where SIGUSR1's dumps go without `--dump-on-hang`.
pub(crate) const DEFAULT_DUMP_DIR: &str = "ddprun-dumps";
/// The collective timeout ranks use when `DDP_TIMEOUT_SECS` is unset.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A rank as the watch loop sees it.
pub(crate) struct Watched {
    /// Its global rank.
    pub rank: usize,
    /// Its process id (the launcher's child).
    pub pid: u32,
    /// Whether it still runs.
    pub running: bool,
}

/// The hang threshold of `cfg`: `--hang-after`, else a quarter of the ranks' collective
/// timeout (at least 1 s).
pub(crate) fn hang_after(cfg: &LaunchConfig) -> Duration {
    if let Some(t) = cfg.hang_after {
        return t;
    }
    let timeout = cfg
        .extra_env
        .iter()
        .rev()
        .find(|(k, _)| k == "DDP_TIMEOUT_SECS")
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var("DDP_TIMEOUT_SECS").ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
    (timeout / 4).max(Duration::from_secs(1))
}

/// A report older than this when read is silence: several missed publications
/// (`DDP_PROGRESS_MS`, read from the environment the ranks inherit), at least 3 s.
pub(crate) fn silent_after() -> Duration {
    (ddp_doctor::publisher::interval() * 4).max(Duration::from_secs(3))
}

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// One attempt's doctor.
pub(crate) struct Doctor {
    limits: Thresholds,
    world_size: usize,
    node: usize,
    dump_on_hang: Option<PathBuf>,
    checked: Instant,
    /// The job's last progress when the last hang verdict was told: one verdict per incident,
    /// a new one only after a collective finished.
    hang_told: Option<Option<f64>>,
    /// The stragglers warned about (again only after they caught up).
    stragglers_told: BTreeSet<usize>,
    usr1_seen: u32,
    /// A failure's dump was written (once per attempt).
    failure_dumped: bool,
    share: Option<share::Share>,
    stacks: stacks::Stacks,
}

impl Doctor {
    /// The doctor of node `node`'s ranks in a world of `world_size` (`share`: the exchange
    /// with the other nodes' launchers, on several nodes).
    pub fn new(
        cfg: &LaunchConfig,
        world_size: usize,
        node: usize,
        share: Option<share::Share>,
    ) -> Self {
        Doctor {
            limits: Thresholds {
                hang_after: hang_after(cfg),
                silent_after: silent_after(),
                straggler_factor: cfg.straggler_factor,
            },
            world_size,
            node,
            dump_on_hang: cfg.dump_on_hang.clone(),
            checked: Instant::now(),
            hang_told: None,
            stragglers_told: BTreeSet::new(),
            usr1_seen: crate::signals::usr1_count(),
            failure_dumped: false,
            share,
            stacks: stacks::Stacks::default(),
        }
    }

    /// Whether the rank with process id `pid` is held for its stack and not yet let go: the
    /// watch loop must not reap it with a plain wait meanwhile. Lets go first of every held
    /// rank that stopped or exited since (on every pass of the watch loop, stopping included:
    /// a held rank is never left unreaped).
    pub fn holds(&mut self, pid: u32) -> bool {
        self.stacks.release_stopped();
        self.stacks.holds(pid)
    }

    /// Reads the progress of `ranks` (this node's), tells a verdict when one is due, and
    /// writes a dump when SIGUSR1 came.
    pub fn poll(&mut self, ranks: &[Watched], notes: &FailureNotes) {
        let usr1 = crate::signals::usr1_count();
        if self.checked.elapsed() < POLL_EVERY && usr1 == self.usr1_seen {
            return;
        }
        self.checked = Instant::now();
        let now_ms = unix_ms();
        let mut local = read_local(ranks, notes, now_ms);
        let others = self
            .share
            .as_ref()
            .map(|s| s.trade(&local))
            .unwrap_or_default();
        let everyone =
            |local: &[RankSnapshot]| -> Vec<RankSnapshot> { [local, &others[..]].concat() };

        let all = everyone(&local);
        let progress = verdict::last_progress(&all);
        if let Some(h) = verdict::hang(&all, self.world_size, now_ms, &self.limits)
            && self.hang_told != Some(progress)
        {
            self.hang_told = Some(progress);
            if self.tells(&h, &local, &others) {
                // Stacks of this node's ranks that hold the others up outside a collective.
                for s in local.iter_mut().filter(|s| {
                    h.others
                        .iter()
                        .any(|(r, w)| *r == s.rank && matches!(w, Whereabouts::Working { .. }))
                }) {
                    self.take_stack(s, ranks);
                }
                let all = everyone(&local);
                let line = verdict::hang(&all, self.world_size, now_ms, &self.limits)
                    .map_or_else(|| h.to_string(), |h| h.to_string());
                eprintln!("ddprun: {line}");
                if let Some(dir) = self.dump_on_hang.clone() {
                    self.dump(&dir, &all, std::slice::from_ref(&line));
                }
            }
        }

        let found = verdict::stragglers(&all, &self.limits);
        for s in &found {
            let ours = local.iter().any(|l| l.rank == s.rank);
            if ours && self.stragglers_told.insert(s.rank) {
                eprintln!("ddprun: warning: {s}");
            }
        }
        self.stragglers_told
            .retain(|r| found.iter().any(|s| s.rank == *r));

        if usr1 != self.usr1_seen {
            self.usr1_seen = usr1;
            for s in &mut local {
                self.take_stack(s, ranks);
            }
            let all = everyone(&local);
            let mut lines: Vec<String> = Vec::new();
            if let Some(h) = verdict::hang(&all, self.world_size, now_ms, &self.limits) {
                lines.push(h.to_string());
            }
            lines.extend(
                verdict::stragglers(&all, &self.limits)
                    .iter()
                    .map(ToString::to_string),
            );
            let dir = self
                .dump_on_hang
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DUMP_DIR));
            self.dump(&dir, &all, &lines);
        }
    }

    /// Whether this launcher tells hang `h`: one verdict per job, by the launcher of the lowest
    /// blamed rank that reported (it has the stack), by node 0's when none reported.
    fn tells(&self, h: &Hang, local: &[RankSnapshot], others: &[RankSnapshot]) -> bool {
        let reported =
            |r: usize| local.iter().any(|s| s.rank == r) || others.iter().any(|s| s.rank == r);
        match h.culprits().into_iter().filter(|&r| reported(r)).min() {
            Some(first) => local.iter().any(|s| s.rank == first),
            None => self.node == 0,
        }
    }

    /// A rank failed (`what`): with `--dump-on-hang DIR`, the ranks' last progress goes into a
    /// dump (once per attempt), so `ddprun doctor DIR` can say where a job that died was.
    pub fn failed(&mut self, ranks: &[Watched], notes: &FailureNotes, what: &str) {
        let Some(dir) = self.dump_on_hang.clone() else {
            return;
        };
        if std::mem::replace(&mut self.failure_dumped, true) {
            return;
        }
        let local = read_local(ranks, notes, unix_ms());
        let mut all = local.clone();
        if let Some(share) = &self.share {
            all.extend(share.trade(&local));
        }
        self.dump(&dir, &all, &[format!("failed: {what}")]);
    }

    fn dump(&self, dir: &Path, snapshots: &[RankSnapshot], lines: &[String]) {
        let name = format!("dump-{}-node{}", unix_ms() as u64, self.node);
        match ddp_doctor::dump::write(dir, &name, snapshots, lines) {
            Ok(path) => eprintln!(
                "ddprun: wrote the flight recorders of {} rank(s) to {} (read it with `ddprun doctor {}`)",
                snapshots.len(),
                path.display(),
                path.display()
            ),
            Err(e) => eprintln!("ddprun: cannot write the dump: {e}"),
        }
    }

    /// Takes the stack of `s`'s process (a rank of this node) into its observation: the
    /// process that wrote the report when it descends from the launcher's child (a wrapper
    /// that forks), else the child.
    fn take_stack(&mut self, s: &mut RankSnapshot, ranks: &[Watched]) {
        let Some(r) = ranks.iter().find(|r| r.rank == s.rank && r.running) else {
            return;
        };
        let pid = if s.pid != r.pid && process::descends_from(s.pid, r.pid) {
            s.pid
        } else {
            r.pid
        };
        let state = process::state(pid);
        let observed = s.observed.get_or_insert_with(Observed::default);
        match self.stacks.main_thread(pid, &state) {
            Ok(frames) => observed.stack = frames,
            Err(e) => observed.stack_error = Some(e),
        }
    }
}

/// This node's ranks' latest progress, each with what the launcher sees of its process now.
fn read_local(ranks: &[Watched], notes: &FailureNotes, now_ms: f64) -> Vec<RankSnapshot> {
    ranks
        .iter()
        .filter_map(|r| {
            let mut s = notes.progress(r.rank)?;
            let pid = if s.pid != r.pid && process::descends_from(s.pid, r.pid) {
                s.pid
            } else {
                r.pid
            };
            s.observed = Some(Observed {
                process: if r.running {
                    process::state(pid)
                } else {
                    "exited".into()
                },
                seen_ms: now_ms,
                ..Observed::default()
            });
            Some(s)
        })
        .collect()
}
