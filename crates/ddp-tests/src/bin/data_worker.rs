//! One rank of the multi-process sharded-data test (`tests/data.rs`).
//!
//! Reads RANK and WORLD_SIZE (as set by a launcher) and DATA_LEN, BATCH_SIZE, DROP_LAST,
//! DROP_LAST_BATCH, NUM_WORKERS, SEED, EPOCHS; runs `EPOCHS` passes of a
//! [`ShardedDataLoader`] over a dataset of the ids `0..DATA_LEN`, batched into `Int` tensors on
//! the CPU device, and prints one JSON line per epoch to stdout:
//! `{"rank":…,"epoch":…,"batches":…,"batch_sizes":[…],"ids":[…]}`.
//! Any error is printed to stderr and the process exits with status 1.

use std::process::ExitCode;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_ddp::data::ShardedDataLoaderBuilder;
use ddp_testkit::data_report::EpochReport;

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

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("data_worker: {e}");
            ExitCode::FAILURE
        }
    }
}
