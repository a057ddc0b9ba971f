//! The hang doctor's launcher side: the watch loop reads its ranks' progress files (see
//! [`ddp_doctor`]), adds what it sees of each process (its state, and the stack of a rank
//! that holds the others up), shares them with the other nodes' launchers ([`share`]), and
//! prints one verdict per incident while every rank is still alive: a hang (no collective
//! finished for `--hang-after`, ranks wait in one: which, in what, and where each other rank
//! is) or a straggler (a warning: the job goes on). Dumps on SIGUSR1 and, with
//! `--dump-on-hang DIR`, at every hang; `ddprun doctor DIR` ([`command`]) reads them.

pub(crate) mod command;
mod process;
pub(crate) mod share;
mod stacks;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ddp_doctor::verdict::{self, Thresholds, Whereabouts};
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
    /// Its process id.
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
    /// The collective of the hang verdict told (one verdict per incident).
    hang_told: Option<u64>,
    /// The stragglers warned about (again only after they caught up).
    stragglers_told: BTreeSet<usize>,
    usr1_seen: u32,
    share: Option<share::Share>,
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
        let hang_after = hang_after(cfg);
        Doctor {
            limits: Thresholds {
                hang_after,
                // Reports come every 500 ms (DDP_PROGRESS_MS): several missed is silence.
                silent_after: Duration::from_secs(3).min(hang_after),
                straggler_factor: cfg.straggler_factor,
            },
            world_size,
            node,
            dump_on_hang: cfg.dump_on_hang.clone(),
            checked: Instant::now(),
            hang_told: None,
            stragglers_told: BTreeSet::new(),
            usr1_seen: crate::signals::usr1_count(),
            share,
        }
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
        let mut local: Vec<RankSnapshot> = ranks
            .iter()
            .filter_map(|r| {
                let mut s = notes.progress(r.rank)?;
                s.observed = Some(Observed {
                    process: if r.running {
                        process::state(r.pid)
                    } else {
                        "exited".into()
                    },
                    seen_ms: now_ms,
                    ..Observed::default()
                });
                Some(s)
            })
            .collect();
        let others = self
            .share
            .as_ref()
            .map(|s| s.trade(&local))
            .unwrap_or_default();
        let all = |local: &[RankSnapshot]| -> Vec<RankSnapshot> {
            local.iter().chain(others.iter()).cloned().collect()
        };

        match verdict::hang(&all(&local), self.world_size, now_ms, &self.limits) {
            Some(h) if self.hang_told != Some(h.collective.seq) => {
                self.hang_told = Some(h.collective.seq);
                let culprits = h.culprits();
                let working: Vec<usize> = h
                    .others
                    .iter()
                    .filter(|(_, w)| matches!(w, Whereabouts::Working { .. }))
                    .map(|(r, _)| *r)
                    .collect();
                // Stacks of this node's ranks that hold the others up and are not in a
                // collective.
                for s in local.iter_mut().filter(|s| working.contains(&s.rank)) {
                    take_stack(s, ranks);
                }
                let ours = culprits.iter().any(|c| local.iter().any(|s| s.rank == *c));
                let anyones = culprits.iter().any(|c| others.iter().any(|s| s.rank == *c));
                // One verdict per job: the node of a culprit tells it (with its stack), node
                // 0 when no node has a culprit's report.
                if ours || (self.node == 0 && !anyones) {
                    let line = verdict::hang(&all(&local), self.world_size, now_ms, &self.limits)
                        .map_or_else(|| h.to_string(), |h| h.to_string());
                    eprintln!("ddprun: {line}");
                    if let Some(dir) = self.dump_on_hang.clone() {
                        self.dump(&dir, &all(&local), std::slice::from_ref(&line));
                    }
                }
            }
            Some(_) => {}
            None => self.hang_told = None,
        }

        let found = verdict::stragglers(&all(&local), &self.limits);
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
            for s in local.iter_mut().filter(|s| {
                s.observed
                    .as_ref()
                    .is_some_and(|o| o.process != "stopped" && o.process != "exited")
            }) {
                take_stack(s, ranks);
            }
            let mut lines: Vec<String> = Vec::new();
            let everyone = all(&local);
            if let Some(h) = verdict::hang(&everyone, self.world_size, now_ms, &self.limits) {
                lines.push(h.to_string());
            }
            lines.extend(
                verdict::stragglers(&everyone, &self.limits)
                    .iter()
                    .map(ToString::to_string),
            );
            let dir = self
                .dump_on_hang
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DUMP_DIR));
            self.dump(&dir, &everyone, &lines);
        }
    }

    fn dump(&self, dir: &std::path::Path, snapshots: &[RankSnapshot], lines: &[String]) {
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
}

/// Takes the stack of `s`'s process (a rank of this node) into its observation.
fn take_stack(s: &mut RankSnapshot, ranks: &[Watched]) {
    let Some(r) = ranks.iter().find(|r| r.rank == s.rank && r.running) else {
        return;
    };
    let observed = s.observed.get_or_insert_with(Observed::default);
    match stacks::main_thread(r.pid) {
        Ok(frames) => observed.stack = frames,
        Err(e) => observed.stack_error = Some(e),
    }
}
