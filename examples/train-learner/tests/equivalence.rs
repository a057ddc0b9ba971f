//! The thesis on burn-train's path: two ranks with batch b take the steps one process takes
//! with batch 2b (tanh and plain SGD: no ReLU kinks or Adam normalisation to amplify the
//! rounding of a batch mean taken in two halves). Rank 0's console has one line per epoch and
//! split; rank 1's has nothing.

use std::time::Duration;

use ddp_testkit::{RankJob, read_f32};

const PROGRAM: &str = env!("CARGO_BIN_EXE_train-learner");

/// Rank 0's final parameters and the job's outcome, `world` ranks of batch `batch` each.
fn train(world: usize, batch: usize, out: &std::path::Path) -> (Vec<f32>, ddp_testkit::JobResult) {
    let res = RankJob::new(PROGRAM, world)
        .args(["--epochs", "2", "--train-size", "600", "--batch-size"])
        .arg(batch.to_string())
        .arg("--out")
        .arg(out)
        .env("RAYON_NUM_THREADS", "1")
        .deadline(Duration::from_secs(240))
        .run()
        .expect("spawn train-learner");
    res.assert_success();
    (read_f32(&out.join("params.f32")), res)
}

#[test]
fn two_ranks_of_batch_10_train_as_one_process_of_batch_20() {
    let dir = tempfile::tempdir().unwrap();
    let (one, _) = train(1, 20, &dir.path().join("one"));
    let (two, res) = train(2, 10, &dir.path().join("two"));
    assert_eq!(one.len(), two.len());
    let apart = one
        .iter()
        .zip(&two)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("2 ranks × 10 vs 1 process × 20: max |Δparam| = {apart:e}");
    assert!(apart <= 1e-5, "max |Δparam| = {apart:e}");
    let moved = one.iter().any(|v| v.abs() > 0.0);
    assert!(moved, "no parameters");

    let rank0 = &res.rank(0).stdout;
    assert!(
        rank0.contains("epoch 2/2 train:") && rank0.contains("epoch 2/2 valid:"),
        "rank 0 prints a line per epoch and split:\n{rank0}"
    );
    assert!(
        rank0.lines().count() < 20,
        "rank 0 is not a line per step:\n{rank0}"
    );
    assert!(
        res.rank(1).stdout.trim().is_empty(),
        "rank 1 stays quiet:\n{}",
        res.rank(1).stdout
    );
    assert!(
        dir.path().join("one/rank0/checkpoint").exists(),
        "rank 0 writes checkpoints"
    );
}
