//! The sweep's results summarised: per per-rank batch and mode, mean ± sd over seeds; the
//! paired gaps to one process; a verdict per per-rank batch, computed from the numbers; and
//! the `compare.md` / `compare.json` text.

use serde::Serialize;

use super::stats::{MeanSd, PairedDiff, accuracy_standard_error};
use super::{Mode, RunResult, SweepConfig};

/// One (per-rank batch, mode) cell: mean ± sd over the seeds.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub per_rank_batch: usize,
    pub mode: Mode,
    pub ranks: usize,
    pub global_batch: usize,
    pub train_loss: MeanSd,
    pub eval_loss: MeanSd,
    /// In percent.
    pub eval_accuracy: MeanSd,
    pub step_ms: MeanSd,
    /// The standard error of one run's eval accuracy at the mean accuracy, in points.
    pub eval_accuracy_se: f64,
}

/// The paired differences of one per-rank batch, over the seeds all modes share.
#[derive(Debug, Clone, Serialize)]
pub struct Gaps {
    pub per_rank_batch: usize,
    /// Per-rank BN's final train loss over one process's, `100 (L − L₁) / L₁`.
    pub per_rank_bn_train_loss_pct: PairedDiff,
    /// The same for SyncBatchNorm.
    pub sync_bn_train_loss_pct: PairedDiff,
    /// Per-rank BN's eval accuracy minus one process's, in points.
    pub per_rank_bn_eval_accuracy_pts: PairedDiff,
    /// The same for SyncBatchNorm.
    pub sync_bn_eval_accuracy_pts: PairedDiff,
    /// SyncBatchNorm's eval accuracy minus per-rank BN's, in points.
    pub sync_over_per_rank_eval_accuracy_pts: PairedDiff,
    /// SyncBatchNorm's train loss over per-rank BN's, in %.
    pub sync_over_per_rank_train_loss_pct: PairedDiff,
    /// SyncBatchNorm's step time over per-rank BN's, `100 (t − t_BN) / t_BN`: its cost.
    pub sync_bn_step_cost_pct: PairedDiff,
}

/// The computed verdict for one per-rank batch.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub per_rank_batch: usize,
    /// Per-rank BN is worse than one process beyond the error bars (eval accuracy lower or
    /// train loss higher).
    pub per_rank_bn_worse: bool,
    /// SyncBatchNorm is not worse than one process beyond the error bars.
    pub sync_bn_matches_one_process: bool,
    /// SyncBatchNorm is better than per-rank BN beyond the error bars.
    pub sync_bn_better_than_per_rank: bool,
    pub text: String,
}

/// Everything `compare.json` holds.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub config: SweepConfig,
    pub cells: Vec<Cell>,
    pub gaps: Vec<Gaps>,
    pub verdicts: Vec<Verdict>,
    pub runs: Vec<RunResult>,
}

impl Report {
    /// Summarises `runs` of the sweep `config` describes.
    pub fn new(config: SweepConfig, runs: Vec<RunResult>) -> Self {
        let mut cells = Vec::new();
        let mut gaps = Vec::new();
        let mut verdicts = Vec::new();
        for &b in &config.per_rank_batches {
            for &mode in &config.modes {
                let of = |f: fn(&RunResult) -> f64| {
                    let v: Vec<f64> = runs
                        .iter()
                        .filter(|r| r.per_rank_batch == b && r.mode == mode)
                        .map(f)
                        .collect();
                    MeanSd::of(&v)
                };
                let acc = of(|r| 100.0 * r.eval_accuracy);
                let ranks = mode.ranks(config.ranks);
                cells.push(Cell {
                    per_rank_batch: b,
                    mode,
                    ranks,
                    global_batch: b * config.ranks,
                    train_loss: of(|r| r.train_loss),
                    eval_loss: of(|r| r.eval_loss),
                    eval_accuracy: acc,
                    step_ms: of(|r| r.step_ms),
                    eval_accuracy_se: 100.0
                        * accuracy_standard_error(acc.mean / 100.0, config.eval_size),
                });
            }
            let g = gaps_of(&runs, b, config.eval_size);
            verdicts.push(verdict(b, &g));
            gaps.push(g);
        }
        Report {
            config,
            cells,
            gaps,
            verdicts,
            runs,
        }
    }

    /// `compare.md`: the setup, the tables and the verdicts.
    pub fn markdown(&self) -> String {
        let c = &self.config;
        let mut s = String::from(
            "# BatchNorm across ranks: one process vs per-rank BN vs SyncBatchNorm\n\n",
        );
        s += &format!(
            "{} ranks ({}), per-rank batches {}, seeds {}, {} epoch(s) of {} training images \
             (`{}`), eval on {} images after the last epoch, SGD with momentum 0.9, learning \
             rate {} × √(global batch / 32) with a cosine decay. Machine: {}. Wall time of the sweep: {:.1} min.\n\n",
            c.ranks,
            c.backend,
            list(&c.per_rank_batches),
            list(&c.seeds),
            c.epochs,
            c.train_size,
            c.data,
            c.eval_size,
            c.lr,
            c.machine,
            c.wall_seconds / 60.0,
        );
        s += "Mean ± standard deviation over the seeds. Each seed trains every mode on the same \
              data, initial weights and order; per-rank BN and SyncBatchNorm split the global \
              batch over the ranks.\n\n";
        s += "| per-rank batch | global batch | run | ranks | train loss | eval loss | eval acc % | step ms |\n";
        s += "|---|---|---|---|---|---|---|---|\n";
        for cell in &self.cells {
            s += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                cell.per_rank_batch,
                cell.global_batch,
                cell.mode.label(&c.wire),
                cell.ranks,
                pm(&cell.train_loss, 4),
                pm(&cell.eval_loss, 4),
                pm(&cell.eval_accuracy, 2),
                pm(&cell.step_ms, 2),
            );
        }
        let se = self
            .cells
            .iter()
            .map(|c| c.eval_accuracy_se)
            .fold(0.0f64, f64::max);
        s += &format!(
            "\nOne run's eval accuracy has a standard error of at most {se:.2} points on {} images.\n\n",
            c.eval_size
        );
        s += "Paired over seeds (mode − one process, per seed), mean ± sd [95 % interval]:\n\n";
        s += "| per-rank batch | per-rank BN train loss gap % | SyncBN train loss gap % | per-rank BN eval acc Δ pts | SyncBN eval acc Δ pts | SyncBN step time vs per-rank BN % |\n";
        s += "|---|---|---|---|---|---|\n";
        for g in &self.gaps {
            s += &format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                g.per_rank_batch,
                diff(&g.per_rank_bn_train_loss_pct, 1),
                diff(&g.sync_bn_train_loss_pct, 1),
                diff(&g.per_rank_bn_eval_accuracy_pts, 2),
                diff(&g.sync_bn_eval_accuracy_pts, 2),
                diff(&g.sync_bn_step_cost_pct, 1),
            );
        }
        s += "\nVerdicts (computed: \"beyond the error bars\" = the paired difference's 95 % interval \
              excludes 0 and it exceeds one eval image or 0.1 % of train loss):\n\n";
        for v in &self.verdicts {
            s += &format!("- per-rank batch {}: {}\n", v.per_rank_batch, v.text);
        }
        s
    }
}

/// Train-loss differences below this (in %) never count: float rounding, not BatchNorm.
const LOSS_FLOOR_PCT: f64 = 0.1;

/// The paired differences at per-rank batch `b`; accuracy differences count from one image of
/// the `eval_size` eval images.
fn gaps_of(runs: &[RunResult], b: usize, eval_size: usize) -> Gaps {
    let at = |mode: Mode, seed: u64| {
        runs.iter()
            .find(|r| r.per_rank_batch == b && r.mode == mode && r.seed == seed)
    };
    let mut seeds: Vec<u64> = runs
        .iter()
        .filter(|r| r.per_rank_batch == b)
        .map(|r| r.seed)
        .collect();
    seeds.sort_unstable();
    seeds.dedup();
    let paired = |a: Mode, base: Mode, floor: f64, f: &dyn Fn(&RunResult, &RunResult) -> f64| {
        let d: Vec<f64> = seeds
            .iter()
            .filter_map(|&s| Some(f(at(a, s)?, at(base, s)?)))
            .collect();
        PairedDiff::of(&d, floor)
    };
    let image = 100.0 / eval_size.max(1) as f64;
    let loss_pct = |x: &RunResult, base: &RunResult| {
        100.0 * (x.train_loss - base.train_loss) / base.train_loss
    };
    let acc_pts = |x: &RunResult, base: &RunResult| 100.0 * (x.eval_accuracy - base.eval_accuracy);
    let step_pct =
        |x: &RunResult, base: &RunResult| 100.0 * (x.step_ms - base.step_ms) / base.step_ms;
    Gaps {
        per_rank_batch: b,
        per_rank_bn_train_loss_pct: paired(
            Mode::PerRankBn,
            Mode::OneProcess,
            LOSS_FLOOR_PCT,
            &loss_pct,
        ),
        sync_bn_train_loss_pct: paired(Mode::SyncBn, Mode::OneProcess, LOSS_FLOOR_PCT, &loss_pct),
        per_rank_bn_eval_accuracy_pts: paired(Mode::PerRankBn, Mode::OneProcess, image, &acc_pts),
        sync_bn_eval_accuracy_pts: paired(Mode::SyncBn, Mode::OneProcess, image, &acc_pts),
        sync_over_per_rank_eval_accuracy_pts: paired(
            Mode::SyncBn,
            Mode::PerRankBn,
            image,
            &acc_pts,
        ),
        sync_over_per_rank_train_loss_pct: paired(
            Mode::SyncBn,
            Mode::PerRankBn,
            LOSS_FLOOR_PCT,
            &loss_pct,
        ),
        sync_bn_step_cost_pct: paired(Mode::SyncBn, Mode::PerRankBn, 0.0, &step_pct),
    }
}

/// The verdict at one per-rank batch, from its gaps.
fn verdict(b: usize, g: &Gaps) -> Verdict {
    let worse = |acc: &PairedDiff, loss: &PairedDiff| acc.below_zero() || loss.above_zero();
    let per_rank_bn_worse = worse(
        &g.per_rank_bn_eval_accuracy_pts,
        &g.per_rank_bn_train_loss_pct,
    );
    let sync_bn_matches_one_process =
        !worse(&g.sync_bn_eval_accuracy_pts, &g.sync_bn_train_loss_pct);
    let sync_bn_better_than_per_rank = g.sync_over_per_rank_eval_accuracy_pts.above_zero()
        || g.sync_over_per_rank_train_loss_pct.below_zero();
    let numbers = |acc: &PairedDiff, loss: &PairedDiff| {
        format!(
            "eval acc {:+.2} ± {:.2} pts, train loss {:+.1} ± {:.1} %",
            acc.mean, acc.sd, loss.mean, loss.sd
        )
    };
    let per_rank = numbers(
        &g.per_rank_bn_eval_accuracy_pts,
        &g.per_rank_bn_train_loss_pct,
    );
    let sync = numbers(&g.sync_bn_eval_accuracy_pts, &g.sync_bn_train_loss_pct);
    let cost = &g.sync_bn_step_cost_pct;
    let cost = format!("{:+.1} ± {:.1} %", cost.mean, cost.sd);
    let seeds = g.per_rank_bn_eval_accuracy_pts.n;
    let text = if seeds < 2 {
        format!("one seed: no verdict (per-rank BN {per_rank}; SyncBN {sync} vs one process)")
    } else if per_rank_bn_worse {
        let sync_part = if sync_bn_matches_one_process {
            format!("SyncBatchNorm closes the gap ({sync}, within the error bars)")
        } else if sync_bn_better_than_per_rank {
            format!("SyncBatchNorm narrows the gap but stays worse ({sync})")
        } else {
            format!("SyncBatchNorm does not close it ({sync})")
        };
        format!(
            "per-rank BN is worse than one process beyond the error bars ({per_rank}); {sync_part}; SyncBN step time {cost}"
        )
    } else if sync_bn_matches_one_process {
        format!(
            "per-rank BN is not worse than one process beyond the error bars ({per_rank}): \
             SyncBatchNorm buys nothing here ({sync}); SyncBN step time {cost}"
        )
    } else {
        format!(
            "per-rank BN is not worse than one process beyond the error bars ({per_rank}), \
             SyncBatchNorm is ({sync}); SyncBN step time {cost}"
        )
    };
    Verdict {
        per_rank_batch: b,
        per_rank_bn_worse,
        sync_bn_matches_one_process,
        sync_bn_better_than_per_rank,
        text,
    }
}

fn pm(m: &MeanSd, digits: usize) -> String {
    format!("{:.*} ± {:.*}", digits, m.mean, digits, m.sd)
}

fn diff(d: &PairedDiff, digits: usize) -> String {
    if d.ci95.is_finite() {
        format!(
            "{:+.*} ± {:.*} [±{:.*}]",
            digits, d.mean, digits, d.sd, digits, d.ci95
        )
    } else {
        format!("{:+.*}", digits, d.mean)
    }
}

fn list<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(seeds: &[u64], batches: &[usize]) -> SweepConfig {
        SweepConfig {
            ranks: 4,
            backend: "cpu".into(),
            per_rank_batches: batches.to_vec(),
            seeds: seeds.to_vec(),
            epochs: 3,
            train_size: 4096,
            eval_size: 20_000,
            lr: 0.02,
            data: "synthetic".into(),
            modes: vec![Mode::OneProcess, Mode::PerRankBn, Mode::SyncBn],
            wire: None,
            machine: "test".into(),
            wall_seconds: 60.0,
        }
    }

    fn run(b: usize, seed: u64, mode: Mode, loss: f64, acc: f64, step: f64) -> RunResult {
        RunResult {
            per_rank_batch: b,
            seed,
            mode,
            ranks: mode.ranks(4),
            train_loss: loss,
            eval_loss: loss * 1.1,
            eval_accuracy: acc,
            step_ms: step,
        }
    }

    /// At b = 4 per-rank BN is clearly worse and SyncBN matches one process; at b = 64 all
    /// three agree within noise.
    fn runs() -> Vec<RunResult> {
        let mut v = Vec::new();
        for (i, seed) in [1u64, 2, 3, 4, 5].into_iter().enumerate() {
            let noise = [0.0, 0.004, -0.003, 0.002, -0.001][i];
            v.push(run(
                4,
                seed,
                Mode::OneProcess,
                0.30 + noise,
                0.90 + noise,
                10.0,
            ));
            v.push(run(
                4,
                seed,
                Mode::PerRankBn,
                0.36 + noise,
                0.87 + noise,
                8.0 + noise,
            ));
            v.push(run(
                4,
                seed,
                Mode::SyncBn,
                0.30 - noise / 2.0,
                0.90 + noise / 3.0,
                9.0,
            ));
            v.push(run(64, seed, Mode::OneProcess, 0.5 + noise, 0.8, 50.0));
            v.push(run(
                64,
                seed,
                Mode::PerRankBn,
                0.5 - noise,
                0.8 + noise,
                40.0,
            ));
            v.push(run(
                64,
                seed,
                Mode::SyncBn,
                0.5 + 0.5 * noise,
                0.8 - noise,
                44.0 + noise,
            ));
        }
        v
    }

    #[test]
    fn verdicts_follow_the_numbers() {
        let r = Report::new(config(&[1, 2, 3, 4, 5], &[4, 64]), runs());
        let v4 = &r.verdicts[0];
        assert!(
            v4.per_rank_bn_worse && v4.sync_bn_matches_one_process,
            "{v4:?}"
        );
        assert!(v4.sync_bn_better_than_per_rank);
        assert!(
            v4.text.contains("SyncBatchNorm closes the gap"),
            "{}",
            v4.text
        );
        let v64 = &r.verdicts[1];
        assert!(!v64.per_rank_bn_worse, "{v64:?}");
        assert!(v64.text.contains("buys nothing"), "{}", v64.text);
        let g = &r.gaps[0];
        assert!(
            (g.per_rank_bn_train_loss_pct.mean - 20.0).abs() < 1.0,
            "{g:?}"
        );
        assert!((g.per_rank_bn_eval_accuracy_pts.mean + 3.0).abs() < 0.01);
        assert!((g.sync_bn_step_cost_pct.mean - 12.5).abs() < 0.5);
    }

    /// Gaps whose train-loss differences are the given per-seed values (eval accuracy and
    /// step time unchanged).
    fn gaps(per_rank: &[f64], sync: &[f64], sync_over_per_rank: &[f64]) -> Gaps {
        let d = |v: &[f64]| PairedDiff::of(v, 0.1);
        let none = d(&[0.0, 0.0, 0.0]);
        Gaps {
            per_rank_batch: 8,
            per_rank_bn_train_loss_pct: d(per_rank),
            sync_bn_train_loss_pct: d(sync),
            per_rank_bn_eval_accuracy_pts: none,
            sync_bn_eval_accuracy_pts: none,
            sync_over_per_rank_eval_accuracy_pts: none,
            sync_over_per_rank_train_loss_pct: d(sync_over_per_rank),
            sync_bn_step_cost_pct: none,
        }
    }

    #[test]
    fn every_verdict_is_reached_by_its_numbers() {
        const WORSE: [f64; 3] = [10.0, 11.0, 12.0];
        const SLIGHTLY_WORSE: [f64; 3] = [3.0, 3.2, 3.4];
        const SAME: [f64; 3] = [-1.0, 0.5, 0.4];
        const BETTER: [f64; 3] = [-6.0, -6.5, -7.0];
        type Case<'a> = (&'a [f64], &'a [f64], &'a [f64], &'a str);
        let cases: [Case; 5] = [
            (&WORSE, &SAME, &BETTER, "SyncBatchNorm closes the gap"),
            (
                &WORSE,
                &SLIGHTLY_WORSE,
                &BETTER,
                "narrows the gap but stays worse",
            ),
            (&WORSE, &WORSE, &SAME, "SyncBatchNorm does not close it"),
            (&SAME, &SAME, &SAME, "SyncBatchNorm buys nothing here"),
            (&SAME, &WORSE, &SAME, "%), SyncBatchNorm is ("),
        ];
        for (per_rank, sync, over, want) in cases {
            let v = verdict(8, &gaps(per_rank, sync, over));
            assert!(v.text.contains(want), "{want:?} not in {:?}", v.text);
            assert_eq!(v.per_rank_bn_worse, per_rank == WORSE, "{}", v.text);
        }
        let one_seed = Gaps {
            per_rank_bn_eval_accuracy_pts: PairedDiff::of(&[-2.0], 0.1),
            ..gaps(&[10.0], &[0.0], &[-10.0])
        };
        assert!(
            verdict(8, &one_seed)
                .text
                .starts_with("one seed: no verdict")
        );
    }

    #[test]
    fn the_markdown_has_every_cell_and_verdict() {
        let r = Report::new(config(&[1, 2, 3, 4, 5], &[4, 64]), runs());
        let md = r.markdown();
        assert_eq!(md.matches("| 4 | 16 |").count(), 3, "{md}");
        assert_eq!(md.matches("| 64 | 256 |").count(), 3, "{md}");
        assert!(md.contains("| 0.3004 ± 0.0027 |"), "{md}");
        assert!(
            md.contains("- per-rank batch 4: per-rank BN is worse"),
            "{md}"
        );
        assert!(md.contains("seeds 1, 2, 3, 4, 5"), "{md}");
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"per_rank_bn_worse\":true"), "{json}");
    }

    #[test]
    fn one_seed_gives_no_verdict_and_missing_runs_are_not_finite_numbers() {
        let one: Vec<RunResult> = runs().into_iter().filter(|r| r.seed == 1).collect();
        let r = Report::new(config(&[1], &[4, 64]), one);
        assert!(r.verdicts[0].text.starts_with("one seed: no verdict"));
        assert!(r.cells.iter().all(|c| c.eval_accuracy.mean.is_finite()));
        let r = Report::new(config(&[1], &[4, 8]), runs());
        assert!(
            r.cells[3].eval_accuracy.mean.is_nan(),
            "b = 8 was never run"
        );
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            json.contains("\"mean\":null"),
            "NaN is null in JSON: {json}"
        );
    }
}
