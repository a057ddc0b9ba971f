//! Sharded data for data-parallel training (re-exported by `burn-ddp` as `burn_ddp::data`): a
//! [`DistributedSampler`] with PyTorch's semantics and a [`ShardedDataLoader`] that turns any Burn [`Dataset`](burn::data::dataset::Dataset) and
//! [`Batcher`](burn::data::dataloader::batcher::Batcher) into per-rank batches.
//!
//! # Why not Burn's own loader
//! Burn's `DataLoaderBuilder` shuffles once per pass with a generator that is not reseeded per
//! epoch, and Burn's multi-device split hands out contiguous slices with the remainder on the
//! last one — ranks can get different batch counts, and a rank that runs out of batches first
//! leaves the others waiting in a collective forever. Here every rank gets the same number of
//! batches by construction.
//!
//! # Padding vs `drop_last`
//! The dataset's `len` items are split over `W` ranks. When `W` does not divide `len`:
//! - **padding** (default): the epoch's order is extended by repeating its head up to
//!   `ceil(len / W) · W`. Every item is used every epoch; up to `W − 1` items are used twice,
//!   which slightly over-weights them (and makes evaluation metrics count them twice).
//! - **`drop_last`** (sampler level, [`ShardedDataLoaderBuilder::drop_last`]): the order is
//!   truncated to `floor(len / W) · W`. No duplicates; up to `W − 1` items are skipped, a
//!   different few each epoch when shuffling. Prefer it for evaluation when exact counts matter
//!   and for training when duplicates are unwanted.
//!
//! Independently, **batch-level drop_last** ([`ShardedDataLoaderBuilder::drop_last_batch`])
//! drops a rank's final batch when it is smaller than the batch size; since all ranks have the
//! same shard length, all ranks agree.
//!
//! # Per-rank vs global batch size
//! `batch_size` is **per rank**. With `W` ranks, one optimizer step consumes `W × batch_size`
//! items — the global batch — and DDP's gradient averaging makes the step equal to one
//! single-process step with batch `W × batch_size`. To reproduce a single-process run with
//! batch `B`, use `B / W` per rank (and, with the same learning rate, the same optimisation).
//! Steps per epoch are `ceil(len / W / batch_size)` (or the floor variants with drop_last).
//!
//! # Example
//! ```
//! use burn::data::dataloader::batcher::Batcher;
//! use burn::data::dataset::InMemDataset;
//! use burn::tensor::{Device, Int, Tensor, TensorData};
//! use burn_ddp_data::ShardedDataLoaderBuilder;
//!
//! #[derive(Clone, Debug)]
//! struct Item {
//!     label: i64,
//! }
//!
//! #[derive(Clone)]
//! struct LabelBatcher;
//! impl Batcher<Item, Tensor<1, Int>> for LabelBatcher {
//!     fn batch(&self, items: Vec<Item>, device: &Device) -> Tensor<1, Int> {
//!         let n = items.len();
//!         let labels: Vec<i64> = items.iter().map(|i| i.label).collect();
//!         Tensor::from_data(TensorData::new(labels, [n]), device)
//!     }
//! }
//!
//! // In a real job these come from the launcher (RANK, WORLD_SIZE) and the rank's device.
//! let (rank, world_size) = (0, 3);
//! let dataset = InMemDataset::new((0..100).map(|label| Item { label }).collect());
//! let loader = ShardedDataLoaderBuilder::new(LabelBatcher)
//!     .batch_size(8) // per rank: the global batch is 8 × 3 = 24
//!     .seed(42)
//!     .num_workers(2)
//!     .build(dataset, rank, world_size, Device::default())?;
//!
//! // 100 items over 3 ranks: padded to 102, 34 per rank → batches of 8, 8, 8, 8, 2.
//! assert_eq!(loader.num_batches(), 5);
//! for epoch in 0..2 {
//!     let mut n = 0;
//!     for batch in loader.batches() {
//!         let labels = batch?; // a dataset error or a panic in the batcher arrives here
//!         n += labels.dims()[0];
//!     }
//!     assert_eq!(n, 34);
//!     // The next pass is the next epoch; checkpoint `loader.state()` to resume later.
//!     assert_eq!(loader.state().epoch, epoch + 1);
//! }
//! # Ok::<(), burn_ddp_data::DataError>(())
//! ```

#![warn(missing_docs)]

mod error;
mod loader;
mod rank;
mod sampler;
pub mod shuffle;

pub use error::DataError;
pub use loader::{
    DEFAULT_BATCH_TIMEOUT, DEFAULT_NUM_WORKERS, DEFAULT_PREFETCH, LoaderState, ShardedBatches,
    ShardedDataLoader, ShardedDataLoaderBuilder,
};
pub use rank::RankOfJob;
pub use sampler::DistributedSampler;
