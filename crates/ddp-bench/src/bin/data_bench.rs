//! Throughput of the sharded data loader against Burn's `DataLoaderBuilder`, on the same
//! in-memory dataset of 28×28 images and the same tensor-building batcher.
//!
//! ```text
//! cargo run --release -p ddp-bench --bin data_bench -- [--items N] [--batch B] [--epochs E]
//! ```
//! Prints a table of items/s per worker count (best of `E` epochs after one warm-up epoch) and
//! the ratio sharded / Burn. The sharded loader runs as rank 0 of a world of 1, so both loaders
//! read every item once per epoch.

use std::time::Instant;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_ddp::data::ShardedDataLoaderBuilder;

const SIDE: usize = 28;

/// One image and its label, as a dataset item.
#[derive(Clone, Debug)]
struct Image {
    pixels: Vec<u8>,
    label: u8,
}

/// A batch of normalised images and labels.
#[derive(Clone, Debug)]
struct ImageBatch {
    images: Tensor<3>,
    labels: Tensor<1, Int>,
}

/// Builds tensors on the device: pixels scaled to [0, 1] and normalised, labels as Int.
#[derive(Clone)]
struct ImageBatcher;

impl Batcher<Image, ImageBatch> for ImageBatcher {
    fn batch(&self, items: Vec<Image>, device: &Device) -> ImageBatch {
        let n = items.len();
        let mut pixels = Vec::with_capacity(n * SIDE * SIDE);
        let mut labels = Vec::with_capacity(n);
        for item in items {
            pixels.extend(
                item.pixels
                    .iter()
                    .map(|&p| (f32::from(p) / 255.0 - 0.1307) / 0.3081),
            );
            labels.push(i64::from(item.label));
        }
        ImageBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, SIDE, SIDE]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// Items in a batch (checking that images and labels agree).
fn batch_len(b: &ImageBatch) -> usize {
    let n = b.images.dims()[0];
    assert_eq!(n, b.labels.dims()[0], "images and labels disagree");
    n
}

fn dataset(items: usize) -> InMemDataset<Image> {
    // A cheap deterministic pattern; the content does not matter for throughput.
    InMemDataset::new(
        (0..items)
            .map(|i| Image {
                pixels: (0..SIDE * SIDE)
                    .map(|p| ((i * 31 + p * 7) % 256) as u8)
                    .collect(),
                label: (i % 10) as u8,
            })
            .collect(),
    )
}

/// Items per second of the best of `epochs` passes (after one warm-up pass).
fn measure(epochs: usize, mut pass: impl FnMut() -> usize) -> f64 {
    pass();
    (0..epochs)
        .map(|_| {
            let start = Instant::now();
            let n = pass();
            n as f64 / start.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} expects a number, got {v:?}"))
        })
        .unwrap_or(default)
}

fn main() {
    let items = arg("--items", 60_000);
    let batch = arg("--batch", 64);
    let epochs = arg("--epochs", 3);
    let device = Device::default();

    println!(
        "data loader throughput: {items} items of {SIDE}x{SIDE} u8 -> f32 tensors, batch {batch}, \
         best of {epochs} epochs, device {device:?}"
    );
    println!(
        "| workers | burn DataLoaderBuilder (items/s) | ShardedDataLoader (items/s) | ratio |"
    );
    println!(
        "|--------:|---------------------------------:|----------------------------:|------:|"
    );
    for workers in [0usize, 1, 2, 4] {
        let burn_loader = DataLoaderBuilder::new(ImageBatcher)
            .batch_size(batch)
            .shuffle(42)
            .num_workers(workers)
            .set_device(device.clone())
            .build(dataset(items));
        let burn = measure(epochs, || {
            burn_loader
                .iter()
                .map(|b| batch_len(&b.expect("burn batch")))
                .sum()
        });

        let sharded_loader = ShardedDataLoaderBuilder::new(ImageBatcher)
            .batch_size(batch)
            .seed(42)
            .num_workers(workers)
            .build(dataset(items), 0, 1, device.clone())
            .expect("valid loader config");
        let sharded = measure(epochs, || {
            sharded_loader
                .batches()
                .map(|b| batch_len(&b.expect("sharded batch")))
                .sum()
        });
        println!(
            "| {workers:>7} | {burn:>32.0} | {sharded:>27.0} | {:>5.2} |",
            sharded / burn
        );
    }
}
