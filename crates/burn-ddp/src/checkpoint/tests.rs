//! A checkpoint saved and resumed in a world of one: the model, the optimizer state and the
//! progress come back, and training continues exactly as without the interruption.

use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Distribution, Tensor};
use ddp_comm::ProcessGroup;

use super::*;
use crate::comm::SharedGroup;
use crate::data::LoaderState;

fn alone() -> SharedGroup {
    Arc::new(Mutex::new(ProcessGroup::single()))
}

fn flat(m: &Linear) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0
                .extend(p.val().into_data().try_to_vec::<f32>().unwrap());
        }
    }
    let mut c = Collect(Vec::new());
    m.visit(&mut c);
    c.0
}

fn step(model: Linear, optim: &mut ModuleOptimizer, seed: u64) -> Linear {
    let device = Device::flex().autodiff();
    device.seed(seed);
    let x = Tensor::<2>::random([8, 4], Distribution::Normal(0.0, 1.0), &device);
    let loss = model.forward(x).powi_scalar(2).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step(1e-2, model, grads)
}

#[test]
fn save_then_load_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let g = alone();
    let device = Device::flex().autodiff();
    let mut optim: ModuleOptimizer = AdamConfig::new().init();
    let mut model: Linear = LinearConfig::new(4, 3).init(&device);
    for s in 0..3 {
        model = step(model, &mut optim, s);
    }
    let ckpt = Checkpointer::new(dir.path());
    assert!(!ckpt.exists(&g).unwrap());
    let progress = Progress {
        step: 3,
        epochs_done: 1,
        loader: Some(LoaderState {
            batches_done: 2,
            samples_done: Some(2 * 4 * 3),
            world_size: Some(3),
            ..LoaderState::at_epoch(1)
        }),
    };
    ckpt.save(&g, &model, &optim, progress, &"notes".to_string())
        .unwrap();
    assert!(ckpt.exists(&g).unwrap());

    // The uninterrupted run takes two more steps.
    let mut straight = model;
    for s in 3..5 {
        straight = step(straight, &mut optim, s);
    }

    // A fresh process: a new model (other weights) and a fresh optimizer, resumed.
    let fresh: Linear = LinearConfig::new(4, 3).init(&device);
    let mut optim2: ModuleOptimizer = AdamConfig::new().init();
    let (model, resumed) = ckpt.load::<_, String>(&g, fresh, &mut optim2).unwrap();
    let resumed = resumed.expect("the checkpoint is found");
    assert_eq!(resumed.progress, progress);
    assert_eq!(resumed.metadata, "notes");
    assert_eq!(resumed.world_size, 1);
    let mut again = model;
    for s in 3..5 {
        again = step(again, &mut optim2, s);
    }
    assert_eq!(
        flat(&again),
        flat(&straight),
        "Adam's moments were not restored"
    );
}

#[test]
fn no_checkpoint_is_none_and_leaves_the_optimizer_alone() {
    let dir = tempfile::tempdir().unwrap();
    let g = alone();
    let model: Linear = LinearConfig::new(2, 2).init(&Device::flex());
    let before = flat(&model);
    let mut optim: ModuleOptimizer = AdamConfig::new().init();
    let (model, got) = Checkpointer::new(dir.path())
        .load::<_, ()>(&g, model, &mut optim)
        .unwrap();
    assert!(got.is_none());
    assert_eq!(flat(&model), before, "the model comes back untouched");
}

#[test]
fn a_checkpoint_of_another_model_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let g = alone();
    let device = Device::flex();
    let small: Linear = LinearConfig::new(2, 2).init(&device);
    let optim: ModuleOptimizer = AdamConfig::new().init();
    let ckpt = Checkpointer::new(dir.path());
    ckpt.save(&g, &small, &optim, Progress::default(), &())
        .unwrap();
    let big: Linear = LinearConfig::new(5, 7).init(&device);
    let mut optim: ModuleOptimizer = AdamConfig::new().init();
    let e = ckpt.load::<_, ()>(&g, big, &mut optim).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, DdpError::Checkpoint(CheckpointError::DoesNotFit { .. })),
        "{msg}"
    );
    assert!(msg.contains("checkpoint.bin"), "{msg}");
}

#[test]
fn a_damaged_file_is_an_error_not_a_fresh_start() {
    let dir = tempfile::tempdir().unwrap();
    let g = alone();
    let ckpt = Checkpointer::new(dir.path());
    std::fs::write(ckpt.path(), b"half a checkpoint").unwrap();
    let model: Linear = LinearConfig::new(2, 2).init(&Device::flex());
    let mut optim: ModuleOptimizer = AdamConfig::new().init();
    let e = ckpt.load::<_, ()>(&g, model, &mut optim).unwrap_err();
    assert!(e.to_string().contains("not usable"), "{e}");
}

#[test]
fn an_unwritable_directory_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let g = alone();
    let ckpt = Checkpointer::new(dir.path().join("missing/sub"));
    let model: Linear = LinearConfig::new(2, 2).init(&Device::flex());
    let optim: ModuleOptimizer = AdamConfig::new().init();
    let e = ckpt
        .save(&g, &model, &optim, Progress::default(), &())
        .unwrap_err();
    assert!(e.to_string().contains("missing/sub/checkpoint.bin"), "{e}");
}

#[test]
fn schedules() {
    let c = Checkpointer::new("x");
    assert!(!c.due_after_step(10));
    assert!(c.due_after_epoch(1) && c.due_after_epoch(2) && !c.due_after_epoch(0));
    let c = c.every_steps(4).every_epochs(0);
    assert!(!c.due_after_step(0) && !c.due_after_step(3) && c.due_after_step(4));
    assert!(c.due_after_step(8) && !c.due_after_epoch(1));
    let c = Checkpointer::at("a/b.ck").every_epochs(3);
    assert_eq!(c.path(), Path::new("a/b.ck"));
    assert!(!c.due_after_epoch(2) && c.due_after_epoch(3));
}

/// Only `NotFound` means "no checkpoint": an error reading the directory (here ENOTDIR, a path
/// through a regular file, and ELOOP, a link to itself — stand-ins for EIO or an NFS timeout)
/// stops the run instead of starting it over. Before, `is_file()` read both as "none".
#[test]
fn an_unreadable_checkpoint_path_is_an_error_not_no_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let g = alone();
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, b"a file where a directory should be").unwrap();
    let through_a_file = Checkpointer::new(&blocker);
    let looped_dir = dir.path().join("looped");
    std::fs::create_dir(&looped_dir).unwrap();
    let looped = Checkpointer::new(&looped_dir);
    std::os::unix::fs::symlink(looped.path(), looped.path()).unwrap();
    for ckpt in [through_a_file, looped] {
        let e = ckpt.exists(&g).unwrap_err().to_string();
        assert!(e.contains(&ckpt.path().display().to_string()), "{e}");
        let e = ckpt.read::<()>(&g).unwrap_err().to_string();
        assert!(e.contains(&ckpt.path().display().to_string()), "{e}");
        let device = Device::flex().autodiff();
        let model: Linear = LinearConfig::new(4, 3).init(&device);
        let mut optim: ModuleOptimizer = AdamConfig::new().init();
        assert!(ckpt.load::<_, ()>(&g, model, &mut optim).is_err());
    }
}

/// A first save killed half-way leaves a temporary while no checkpoint exists yet; the next
/// read removes it (before, only when a checkpoint was there).
#[test]
fn a_stale_temporary_is_removed_before_the_first_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let g = alone();
    let ckpt = Checkpointer::new(dir.path());
    let stale = ckpt
        .path()
        .with_file_name(".checkpoint.bin.tmp-deadhost-4242-00000000deadbeef");
    std::fs::write(&stale, b"half a checkpoint").unwrap();
    assert!(ckpt.read::<()>(&g).unwrap().is_none());
    assert!(!stale.exists());
}
