//! The thesis on burn-train's path: two ranks with batch b take the steps one process takes
//! with batch 2b (tanh and plain SGD: no ReLU kinks or Adam normalisation to amplify the
//! rounding of a batch mean taken in two halves). Rank 0's console has one line per epoch and
//! split; rank 1's has nothing. And the program runs as a user launches it, under `ddprun`.

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
        dir.path().join("two/checkpoint/model-2.bpk").exists(),
        "rank 0 writes checkpoints"
    );
    assert!(
        !dir.path().join("two/rank1/checkpoint").exists(),
        "rank 1 writes none"
    );
}

/// The program as a user launches it: `ddprun --nproc-per-node 2 -- train-learner …` exits 0,
/// its prefixed output has rank 0's line per epoch and split and nothing of rank 1, and the
/// parameters are bitwise those of the same two ranks started without the launcher.
#[test]
fn under_ddprun_two_ranks_train_as_they_do_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let (direct, _) = train(2, 10, &dir.path().join("direct"));

    let ddprun = std::path::Path::new(PROGRAM).with_file_name("ddprun");
    assert!(
        ddprun.exists(),
        "{} is missing: `cargo test --workspace` builds it",
        ddprun.display()
    );
    let out = dir.path().join("ddprun");
    let port = ddp_testkit::free_port().to_string();
    let ended = ddp_testkit::Launched::spawn(
        std::process::Command::new(&ddprun)
            .args(["--nproc-per-node", "2", "--master-port", &port, "--"])
            .arg(PROGRAM)
            .args(["--epochs", "2", "--train-size", "600", "--batch-size", "10"])
            .arg("--out")
            .arg(&out)
            .env("RAYON_NUM_THREADS", "1"),
    )
    .expect("start ddprun")
    .wait_for(Duration::from_secs(240));
    let (status, stdout, stderr) = (ended.status, ended.stdout, ended.stderr);
    assert!(status.success(), "ddprun: {status}\n{stdout}\n{stderr}");

    let rank0 = ddp_testkit::rank_lines(&stdout, 0);
    assert!(
        rank0.iter().any(|l| l.starts_with("epoch 2/2 train:"))
            && rank0.iter().any(|l| l.starts_with("epoch 2/2 valid:")),
        "rank 0 prints a line per epoch and split:\n{stdout}"
    );
    assert!(
        ddp_testkit::rank_lines(&stdout, 1).is_empty(),
        "rank 1 stays quiet:\n{stdout}"
    );
    assert_eq!(
        read_f32(&out.join("params.f32")),
        direct,
        "ddprun's ranks and the same ranks started directly differ"
    );
}
