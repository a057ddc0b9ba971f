//! Capture and restore: a checkpoint holds a model's newest running statistics, and a
//! restore is not overwritten by an update the target model had pending.

use std::path::Path;

use burn::module::Module;
use burn::tensor::{Device, Distribution, Tensor};

use super::*;

/// BatchNorm's running statistics as they stand after the last forward (committed first).
fn running_statistics(bn: &burn::nn::BatchNorm) -> Vec<f32> {
    let bn = bn.valid();
    [bn.running_mean.value(), bn.running_var.value()]
        .into_iter()
        .flat_map(|t| t.into_data().try_to_vec::<f32>().unwrap())
        .collect()
}

/// Burn's `RunningState` keeps the newest update pending until the next forward, and a visit
/// reads the value before it. A checkpoint must hold the newest running statistics, and a
/// load into a module with a pending update of its own must not be overwritten by it: the
/// resumed module then continues bitwise as the one that was saved.
#[test]
fn a_checkpoint_holds_the_newest_running_statistics_and_a_load_keeps_them() {
    use burn::nn::{BatchNorm, BatchNormConfig};
    let device = Device::flex().autodiff();
    let forward = |bn: &BatchNorm, seed: u64| {
        device.seed(seed);
        let x = Tensor::<3>::random([4, 3, 5], Distribution::Normal(2.0, 3.0), &device);
        let _ = bn.forward(x);
    };
    let saved: BatchNorm = BatchNormConfig::new(3).init(&device);
    forward(&saved, 1);
    forward(&saved, 2);
    let ckpt = Checkpoint::capture_with_state(&saved, Vec::new(), Progress::default(), 1, ())
        .expect("capture");
    let newest = running_statistics(&saved);

    // A module that trained on other data: an update of its own is pending.
    let other: BatchNorm = BatchNormConfig::new(3).init(&device);
    forward(&other, 9);
    forward(&other, 10);
    let resumed = ckpt
        .restore_model(other, Path::new("test checkpoint"))
        .expect("restore");
    assert_eq!(running_statistics(&resumed), newest);

    forward(&saved, 3);
    forward(&resumed, 3);
    assert_eq!(running_statistics(&resumed), running_statistics(&saved));
}
