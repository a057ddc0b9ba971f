//! Per-epoch metrics: the record, the printed table, and the CSV / JSON files.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// What one epoch measured. Losses and accuracies are over all ranks' samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    /// Epoch number, from 1.
    pub epoch: usize,
    /// Mean training loss over the epoch (every rank's batches, weighted by samples).
    pub train_loss: f64,
    /// Training accuracy over the epoch (measured in training mode, on the fly).
    pub train_accuracy: f64,
    /// Mean loss on the eval split (eval mode: running BatchNorm statistics); NaN (`null` in
    /// JSON) for an epoch that was not evaluated (`--eval-last-only`).
    #[serde(deserialize_with = "f64_or_nan")]
    pub eval_loss: f64,
    /// Accuracy on the eval split (NaN when not evaluated, as [`Self::eval_loss`]).
    #[serde(deserialize_with = "f64_or_nan")]
    pub eval_accuracy: f64,
    /// Training samples processed per second, all ranks together.
    pub samples_per_sec: f64,
    /// Wall time of the epoch (training and evaluation), seconds.
    pub seconds: f64,
    /// Seconds of the epoch spent in gradient synchronisation (mean over ranks), including
    /// [`Self::wait_seconds`]: the communication part of the epoch.
    #[serde(default)]
    pub sync_seconds: f64,
    /// Seconds of the epoch spent waiting for the other ranks at the start of each sync (the
    /// presence exchange, which absorbs the slower ranks' compute), mean over ranks.
    #[serde(default)]
    pub wait_seconds: f64,
}

/// A number, or `null` (how JSON writes NaN) read back as NaN.
fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

const HEADER: [&str; 9] = [
    "epoch",
    "train_loss",
    "train_accuracy",
    "eval_loss",
    "eval_accuracy",
    "samples_per_sec",
    "seconds",
    "sync_seconds",
    "wait_seconds",
];

/// The metrics as a text table (one header line, one line per epoch).
pub fn table(history: &[EpochMetrics]) -> String {
    let mut s = format!(
        "{:>5}  {:>10}  {:>9}  {:>9}  {:>8}  {:>9}  {:>7}  {:>6}  {:>6}\n",
        "epoch",
        "train loss",
        "train acc",
        "eval loss",
        "eval acc",
        "samples/s",
        "time s",
        "sync s",
        "wait s"
    );
    for m in history {
        s.push_str(&format!(
            "{:>5}  {:>10.4}  {:>8.2}%  {:>9.4}  {:>7.2}%  {:>9.0}  {:>7.1}  {:>6.2}  {:>6.2}\n",
            m.epoch,
            m.train_loss,
            100.0 * m.train_accuracy,
            m.eval_loss,
            100.0 * m.eval_accuracy,
            m.samples_per_sec,
            m.seconds,
            m.sync_seconds,
            m.wait_seconds
        ));
    }
    s
}

/// Writes the metrics as CSV (header + one row per epoch).
pub fn write_csv(path: &Path, history: &[EpochMetrics]) -> std::io::Result<()> {
    let mut out = Vec::new();
    writeln!(out, "{}", HEADER.join(","))?;
    for m in history {
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{}",
            m.epoch,
            m.train_loss,
            m.train_accuracy,
            m.eval_loss,
            m.eval_accuracy,
            m.samples_per_sec,
            m.seconds,
            m.sync_seconds,
            m.wait_seconds
        )?;
    }
    write_atomic(path, &out)
}

/// Writes the metrics as a JSON array of objects.
pub fn write_json(path: &Path, history: &[EpochMetrics]) -> std::io::Result<()> {
    let json = serde_json::to_vec_pretty(history).map_err(std::io::Error::other)?;
    write_atomic(path, &json)
}

/// Reads metrics written by [`write_json`].
pub fn read_json(path: &Path) -> std::io::Result<Vec<EpochMetrics>> {
    serde_json::from_slice(&std::fs::read(path)?).map_err(std::io::Error::other)
}

/// Writes `bytes` atomically (temporary file, fsync, rename): burn-ddp's, as for checkpoints.
pub use burn_ddp::checkpoint::write_atomic;

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<EpochMetrics> {
        (1..=3)
            .map(|e| EpochMetrics {
                epoch: e,
                train_loss: 2.0 / e as f64,
                train_accuracy: 0.3 * e as f64,
                eval_loss: 2.1 / e as f64,
                eval_accuracy: 0.25 * e as f64,
                samples_per_sec: 1000.0,
                seconds: 1.5,
                sync_seconds: 0.25,
                wait_seconds: 0.05,
            })
            .collect()
    }

    #[test]
    fn csv_and_json_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let h = sample();
        write_csv(&dir.path().join("m.csv"), &h).unwrap();
        write_json(&dir.path().join("m.json"), &h).unwrap();
        assert_eq!(read_json(&dir.path().join("m.json")).unwrap(), h);
        let csv = std::fs::read_to_string(dir.path().join("m.csv")).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0], HEADER.join(","));
        let row: Vec<f64> = lines[2].split(',').map(|v| v.parse().unwrap()).collect();
        assert_eq!(row[0], 2.0);
        assert_eq!(row[1], 1.0);
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn an_epoch_not_evaluated_round_trips_through_json_as_nan() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = sample();
        h[0].eval_loss = f64::NAN;
        h[0].eval_accuracy = f64::NAN;
        let path = dir.path().join("m.json");
        write_json(&path, &h).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("null"));
        let back = read_json(&path).unwrap();
        assert!(back[0].eval_loss.is_nan() && back[0].eval_accuracy.is_nan());
        assert_eq!(back[1..], h[1..]);
    }

    #[test]
    fn table_has_a_row_per_epoch() {
        let t = table(&sample());
        assert_eq!(t.lines().count(), 4);
        assert!(t.lines().nth(1).unwrap().contains("30.00%"), "{t}");
    }
}
