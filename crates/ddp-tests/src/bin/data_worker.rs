//! One rank of the multi-process sharded-data test (`tests/data.rs`).
//!
//! Reads RANK and WORLD_SIZE (as set by a launcher) and DATA_LEN, BATCH_SIZE, DROP_LAST,
//! DROP_LAST_BATCH, NUM_WORKERS, SEED, EPOCHS; runs `EPOCHS` passes of a
//! [`ShardedDataLoader`] over a dataset of the ids `0..DATA_LEN`, batched into `Int` tensors on
//! the CPU device, and prints one JSON line per epoch to stdout:
//! `{"rank":…,"epoch":…,"batches":…,"batch_sizes":[…],"ids":[…]}`.
//! Any error is printed to stderr and the process exits with status 1.
//!
//! With `STATE_FILE` set it is an elastic job's rank instead (`tests/data.rs` runs it under
//! two `ddprun` of `--nnodes 1:2`): it joins the process group (`burn_ddp::init`), resumes the
//! loader from `STATE_FILE` when it is a restart (`DDP_ROUND` > 0), and after each
//! batch prints `{"attempt":…,"world":…,"epoch":…,"before":…,"ids":[…]}` (`before`: the
//! epoch's global sample position before the batch), waits for every rank (a barrier: a lost
//! peer fails it) and has rank 0 commit the loader's position to `STATE_FILE` (written to a
//! temporary, then renamed). `BATCH_SLEEP_MS` slows each batch down.

use std::process::ExitCode;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_ddp::data::{LoaderState, ShardedDataLoader, ShardedDataLoaderBuilder};
use ddp_testkit::data_report::{ConsumedBatch, EpochReport};

/// Batches sample ids into a 1-D `Int` tensor on the rank's device.
#[derive(Clone)]
struct IdBatcher;

impl Batcher<i64, Tensor<1, Int>> for IdBatcher {
    fn batch(&self, items: Vec<i64>, device: &Device) -> Tensor<1, Int> {
        let n = items.len();
        Tensor::from_data(TensorData::new(items, [n]), device)
    }
}

fn var<T: std::str::FromStr>(name: &str, default: Option<T>) -> Result<T, String> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| format!("environment variable {name}={v:?} is not a valid value")),
        Err(_) => default.ok_or_else(|| format!("environment variable {name} is not set")),
    }
}

fn run() -> Result<(), String> {
    let rank: usize = var("RANK", None)?;
    let world_size: usize = var("WORLD_SIZE", None)?;
    let len: i64 = var("DATA_LEN", None)?;
    let batch_size: usize = var("BATCH_SIZE", None)?;
    let drop_last: bool = var("DROP_LAST", Some(false))?;
    let drop_last_batch: bool = var("DROP_LAST_BATCH", Some(false))?;
    let num_workers: usize = var("NUM_WORKERS", Some(2))?;
    let seed: u64 = var("SEED", Some(0))?;
    let epochs: u64 = var("EPOCHS", Some(1))?;

    let device = Device::default();
    let loader = ShardedDataLoaderBuilder::new(IdBatcher)
        .batch_size(batch_size)
        .drop_last(drop_last)
        .drop_last_batch(drop_last_batch)
        .num_workers(num_workers)
        .seed(seed)
        .build(
            InMemDataset::new((0..len).collect()),
            rank,
            world_size,
            device.clone(),
        )
        .map_err(|e| e.to_string())?;

    if let Ok(path) = std::env::var("STATE_FILE") {
        return elastic(&loader, epochs, std::path::Path::new(&path));
    }
    for _ in 0..epochs {
        let pass = loader.batches();
        let epoch = pass.epoch();
        let mut report = EpochReport {
            rank,
            epoch,
            batches: 0,
            batch_sizes: Vec::new(),
            ids: Vec::new(),
        };
        for batch in pass {
            let batch = batch.map_err(|e| e.to_string())?;
            if batch.device() != device {
                return Err("batch is not on the rank's device".into());
            }
            let ids = batch
                .into_data()
                .try_to_vec_as::<i64>()
                .map_err(|e| format!("{e:?}"))?;
            report.batches += 1;
            report.batch_sizes.push(ids.len());
            report.ids.extend(ids);
        }
        let line = serde_json::to_string(&report).map_err(|e| e.to_string())?;
        println!("{line}");
    }
    Ok(())
}

/// The elastic mode (see the module docs).
fn elastic(
    loader: &ShardedDataLoader<i64, Tensor<1, Int>>,
    epochs: u64,
    state_file: &std::path::Path,
) -> Result<(), String> {
    // The CPU whatever the build's features (the automatic choice would be CUDA on a GPU).
    let ddp = burn_ddp::Ddp::builder()
        .device(Device::flex())
        .init()
        .map_err(|e| e.to_string())?;
    // The round (scale-ups included) where ddprun sets it: every round after the first
    // resumes; elsewhere (torchrun) the restart count.
    let attempt: u64 = match std::env::var_os("DDP_ROUND") {
        Some(_) => var("DDP_ROUND", Some(0))?,
        None => var("DDP_RESTART_COUNT", Some(0))?,
    };
    let pause = std::time::Duration::from_millis(var("BATCH_SLEEP_MS", Some(0))?);
    if attempt > 0 {
        match std::fs::read(state_file) {
            Ok(bytes) => {
                let state: LoaderState =
                    serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
                loader.load_state(state);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", state_file.display())),
        }
    }
    while loader.epoch() < epochs {
        let mut pass = loader.batches();
        let epoch = pass.epoch();
        loop {
            let before = loader.state().samples_done;
            let Some(batch) = pass.next() else { break };
            let ids = batch
                .map_err(|e| e.to_string())?
                .into_data()
                .try_to_vec_as::<i64>()
                .map_err(|e| format!("{e:?}"))?;
            let line = ConsumedBatch {
                attempt,
                world: ddp.world_size(),
                epoch,
                before,
                ids,
            };
            println!(
                "{}",
                serde_json::to_string(&line).map_err(|e| e.to_string())?
            );
            std::thread::sleep(pause);
            ddp.barrier().map_err(|e| e.to_string())?;
            if ddp.is_main() {
                let tmp = state_file.with_extension("tmp");
                let state = serde_json::to_vec(&loader.state()).map_err(|e| e.to_string())?;
                std::fs::write(&tmp, state)
                    .and_then(|()| std::fs::rename(&tmp, state_file))
                    .map_err(|e| format!("{}: {e}", state_file.display()))?;
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("data_worker: {e}");
            ExitCode::FAILURE
        }
    }
}
