//! A run interrupted after one epoch and resumed ends with the same parameters (and BatchNorm
//! running statistics) as an uninterrupted run.

use burn::nn::BatchNorm;
use burn::tensor::Device;
use burn_ddp::Ddp;
use ddp_comm::LaunchEnv;
use train_cnn::metrics::EpochMetrics;
use train_cnn::model::Net;
use train_cnn::train::{LrSchedule, TrainConfig, train};

/// Burn's random initialisation draws from a process-wide generator seeded by `--seed`; tests
/// running in parallel threads would interleave their draws, so each test holds this lock.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process as a world of one on the CPU, as the program is when started alone (every
/// test of this binary gets the same process-wide group).
fn alone() -> Ddp {
    Ddp::builder()
        .launch_env(LaunchEnv::single_process())
        .device(Device::flex())
        .init()
        .unwrap()
}

fn values(model: &Net<BatchNorm>) -> Vec<f32> {
    train_cnn::model::parameter_values(model)
}

fn tiny(out: &std::path::Path, epochs: usize) -> TrainConfig {
    let mut cfg = TrainConfig::new(out);
    cfg.synthetic_sizes = (192, 64);
    cfg.channels = vec![4, 8, 8];
    cfg.batch_size = 16;
    cfg.epochs = epochs;
    cfg.seed = 11;
    cfg.progress = false;
    // The "interrupted" run below is a run of fewer epochs; with the cosine schedule its
    // learning rates would differ from the first epoch of the longer run (the schedule spans
    // `--epochs`), so this checkpoint-fidelity test keeps the rate constant.
    cfg.schedule = LrSchedule::Constant;
    cfg
}

#[test]
fn resumed_run_matches_uninterrupted_run() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let straight_dir = dir.path().join("straight");
    let split_dir = dir.path().join("split");

    let straight = train::<BatchNorm>(&alone(), &tiny(&straight_dir, 2)).unwrap();

    let first = train::<BatchNorm>(&alone(), &tiny(&split_dir, 1)).unwrap();
    assert_eq!(first.history.len(), 1);
    let mut cfg = tiny(&split_dir, 2);
    cfg.resume = true;
    // A different seed on the command line must not change the resumed data order: the
    // checkpoint's sampler state wins.
    cfg.seed = 11;
    let resumed = train::<BatchNorm>(&alone(), &cfg).unwrap();
    assert_eq!(resumed.resumed_after, Some(1));
    assert_eq!(resumed.history.len(), 2);
    let same = |a: &EpochMetrics, b: &EpochMetrics| {
        (
            a.epoch,
            a.train_loss,
            a.train_accuracy,
            a.eval_loss,
            a.eval_accuracy,
        ) == (
            b.epoch,
            b.train_loss,
            b.train_accuracy,
            b.eval_loss,
            b.eval_accuracy,
        )
    };
    // Epoch 1 comes from the checkpoint; epoch 2 was recomputed after the resume.
    assert!(same(&resumed.history[0], &first.history[0]));
    assert!(same(&resumed.history[0], &straight.history[0]));

    let a = values(&straight.model);
    let b = values(&resumed.model);
    assert_eq!(a.len(), b.len());
    let max_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(max_diff <= 1e-6, "max |Δparam| = {max_diff}");
    // And the resumed run really trained: epoch-2 parameters differ from epoch-1 ones.
    let c = values(&first.model);
    assert!(a.iter().zip(&c).any(|(x, y)| (x - y).abs() > 1e-4));
    assert!((resumed.history[1].train_loss - straight.history[1].train_loss).abs() < 1e-6);
    assert!((resumed.history[1].eval_accuracy - straight.history[1].eval_accuracy).abs() < 1e-9);
}

#[test]
fn resume_refuses_a_different_model() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    train::<BatchNorm>(&alone(), &tiny(dir.path(), 1)).unwrap();
    let mut cfg = tiny(dir.path(), 2);
    cfg.resume = true;
    cfg.channels = vec![4, 8, 16];
    let e = train::<BatchNorm>(&alone(), &cfg).unwrap_err();
    assert!(
        e.to_string()
            .contains("the checkpoint holds a CNN of blocks [4, 8, 8] for 28×28 images"),
        "{e}"
    );
    // A ResNet is not resumed from the CNN's checkpoint either.
    cfg.model = train_cnn::model::ModelKind::Resnet18;
    let e = train::<BatchNorm>(&alone(), &cfg).unwrap_err();
    assert!(
        e.to_string().contains("but these settings build a ResNet"),
        "{e}"
    );
}

#[test]
fn resume_without_a_checkpoint_is_a_clear_error() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny(dir.path(), 1);
    cfg.resume = true;
    let e = train::<BatchNorm>(&alone(), &cfg).unwrap_err();
    assert!(e.to_string().contains("checkpoint.bin"), "{e}");
}
