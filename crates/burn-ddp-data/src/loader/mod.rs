//! [`ShardedDataLoader`]: per-rank batches from a [`DistributedSampler`] shard, built by
//! background workers with ordered prefetch.

mod builder;
mod burn_adapter;
mod pass;
mod workers;

use std::any::Any;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use super::DataError;
use super::sampler::{DistributedSampler, check_rank};
use crate::RankOfJob;

pub use builder::ShardedDataLoaderBuilder;
pub use pass::ShardedBatches;

use pass::Source;
use workers::WorkerPool;

/// Default number of background worker threads.
pub const DEFAULT_NUM_WORKERS: usize = 2;
/// Default number of finished batches each worker may hold ahead of the consumer.
pub const DEFAULT_PREFETCH: usize = 2;
/// Default longest wait for one batch before the iterator yields [`DataError::Timeout`].
pub const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(600);

/// Where a loader stands in its sequence of epochs; save it in a checkpoint and give it back to
/// [`ShardedDataLoader::load_state`] to resume.
///
/// While a pass is being read, `epoch` is that pass's epoch and `batches_done` the batches
/// already yielded; between passes, `epoch` is the epoch the next pass will use and
/// `batches_done` is 0 (or the batches to skip, after `load_state`).
///
/// `samples_done` is the position in the epoch's global order (items read by all ranks
/// together), which is what lets a job resume at **another world size**: the new ranks share
/// the rest of the epoch (see [`DistributedSampler::indices_after`]), so no item of the epoch
/// is skipped or read twice beyond the sampler's padding. At the same world size the resume
/// is exactly the uninterrupted order either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoaderState {
    /// The epoch in progress, or the next one.
    pub epoch: u64,
    /// Batches of that epoch already consumed (by this loader's pass: after a resume at
    /// another world size, the batches of the rest of the epoch).
    pub batches_done: usize,
    /// Items of the epoch's global order consumed by all ranks together; `None` in states
    /// written before it existed (they resume by `batches_done`) or of a sliced loader.
    #[serde(default)]
    pub samples_done: Option<u64>,
    /// The world size of the loader that wrote the state (`None` as for `samples_done`).
    #[serde(default)]
    pub world_size: Option<usize>,
}

impl LoaderState {
    /// The start of `epoch`.
    pub fn at_epoch(epoch: u64) -> Self {
        LoaderState {
            epoch,
            batches_done: 0,
            samples_done: None,
            world_size: None,
        }
    }
}

#[derive(Debug, Clone)]
struct Config {
    rank: usize,
    world_size: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    drop_last_batch: bool,
    num_workers: usize,
    prefetch: usize,
    batch_timeout: Duration,
    /// A sub-range of this rank's items per epoch (from [`DataLoader::slice`]).
    range: Option<Range<usize>>,
}

#[derive(Debug, Default, Clone)]
struct EpochState {
    next_epoch: u64,
    skip_batches: usize,
    /// The next pass reads the rest of its epoch after this many items of the global order
    /// (a resume at another world size).
    skip_samples: Option<u64>,
    /// (generation, epoch, batches yielded) of the pass being read, if any.
    current: Option<(u64, u64, usize)>,
    /// Of the pass being read: the items of the global order consumed before its first batch,
    /// and this rank's items in it.
    current_span: (u64, usize),
}

/// One epoch's plan: the batches of dataset indices, in order.
struct Plan {
    epoch: u64,
    batches: Arc<Vec<Vec<usize>>>,
    /// The first batch to build (batches before it were consumed before a resume).
    first: usize,
    items_total: usize,
    items_before_first: usize,
}

/// A data loader for one rank of a data-parallel job: each pass reads this rank's
/// [`DistributedSampler`] shard of the next epoch, in batches of the per-rank batch size,
/// built by background workers and placed on the rank's device.
///
/// # Batch size: per rank vs global
/// `batch_size` is per rank. One optimizer step of `W` ranks consumes `batch_size × W` items
/// (the global batch); after DDP averages the gradients, that step equals one single-process
/// step on the concatenated global batch.
///
/// # Same number of batches on every rank
/// The sampler gives every rank the same number of items (padding or truncation, see
/// [`DistributedSampler`]), so every rank yields [`num_batches`](Self::num_batches) batches:
/// `ceil(n / b)`, or `floor(n / b)` with [`drop_last_batch`](ShardedDataLoaderBuilder::drop_last_batch),
/// where `n` is the shard length. An empty dataset (or fewer items than ranks with
/// `drop_last`) is an **empty epoch on every rank** — no batches, no hang, and a `tracing`
/// warning. All ranks must see a dataset of the same length.
///
/// # Epochs and resuming
/// Each new pass ([`batches`](Self::batches) or [`DataLoader::iter`]) starts the next epoch, so
/// the order changes by itself. [`set_epoch`](Self::set_epoch) chooses the epoch of the next
/// pass; [`state`](Self::state)/[`load_state`](Self::load_state) save and restore the position
/// including batches already consumed in an interrupted epoch. They take `&self` because the
/// loader is shared: burn-train holds it as an `Arc<dyn DataLoader>`, and a program that
/// resumes or sets the epoch reaches it through another clone of that `Arc`.
///
/// # Workers and ordering
/// Batch `k` of a pass is built by worker `k mod num_workers`, and batches are yielded in plan
/// order, so the output is identical for any number of workers. Each worker holds at most
/// `prefetch` finished batches. Workers live as long as the loader and are reused across
/// epochs (a device stream per worker, not per epoch). A dataset error or a panic in the
/// dataset or batcher is yielded as an error and ends the pass; a batch that takes longer than
/// the batch timeout yields [`DataError::Timeout`]. Starting a new pass while an older one is
/// still being read ends the older one with [`DataError::Superseded`].
///
/// # Burn integration
/// It implements Burn's [`DataLoader`] trait, so an `Arc<ShardedDataLoader>` can be handed to
/// Burn's `Learner` as the training loader (errors become `DatasetError`s there).
pub struct ShardedDataLoader<I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<I, O>>,
    config: Config,
    device: Device,
    state: Arc<Mutex<EpochState>>,
    generation: Arc<AtomicU64>,
    active: ActiveSlot<O>,
    pool: OnceLock<Result<WorkerPool<O>, String>>,
}

/// The receivers of the pass being read, shared by the loader and that pass's iterator.
/// Starting a new pass replaces them, which releases workers still blocked on the old pass.
type ActiveSlot<O> = Arc<Mutex<Option<ActivePass<O>>>>;

struct ActivePass<O> {
    generation: u64,
    receivers: Vec<Receiver<Result<O, DataError>>>,
}

impl<I, O> ShardedDataLoader<I, O>
where
    I: Send + 'static,
    O: Send + 'static,
{
    fn from_parts(
        dataset: Arc<dyn Dataset<I>>,
        batcher: Arc<dyn Batcher<I, O>>,
        config: Config,
        device: Device,
        state: EpochState,
    ) -> Self {
        Self {
            dataset,
            batcher,
            config,
            device,
            state: Arc::new(Mutex::new(EpochState {
                current: None,
                ..state
            })),
            generation: Arc::new(AtomicU64::new(0)),
            active: Arc::new(Mutex::new(None)),
            pool: OnceLock::new(),
        }
    }

    /// This loader's rank.
    pub fn rank(&self) -> usize {
        self.config.rank
    }

    /// The world size.
    pub fn world_size(&self) -> usize {
        self.config.world_size
    }

    /// Items per batch on this rank.
    pub fn batch_size(&self) -> usize {
        self.config.batch_size
    }

    /// The device batches are placed on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The sampler of the next pass (its epoch set), for the current dataset length.
    pub fn sampler(&self) -> DistributedSampler {
        let mut sampler = self.sampler_for(self.dataset.len());
        sampler.set_epoch(self.lock_state().next_epoch);
        sampler
    }

    fn sampler_for(&self, dataset_len: usize) -> DistributedSampler {
        let c = &self.config;
        DistributedSampler::new(dataset_len, c.world_size, c.rank)
            .expect("rank and world size were checked when the loader was built")
            .with_shuffle(c.shuffle)
            .with_seed(c.seed)
            .with_drop_last(c.drop_last)
    }

    /// This rank's items per epoch after sharding (and slicing), before batching.
    fn shard_len(&self) -> usize {
        let n = self.sampler_for(self.dataset.len()).num_samples();
        match &self.config.range {
            Some(r) => r.end.min(n) - r.start.min(n),
            None => n,
        }
    }

    /// Batches per epoch on this rank — the same on every rank.
    pub fn num_batches(&self) -> usize {
        let n = self.shard_len();
        if self.config.drop_last_batch {
            n / self.config.batch_size
        } else {
            n.div_ceil(self.config.batch_size)
        }
    }

    /// Items yielded per epoch on this rank (the items in [`num_batches`](Self::num_batches)).
    pub fn num_items_per_epoch(&self) -> usize {
        let n = self.shard_len();
        if self.config.drop_last_batch {
            n - n % self.config.batch_size
        } else {
            n
        }
    }

    /// The epoch the next pass will use (or the one in progress).
    pub fn epoch(&self) -> u64 {
        self.state().epoch
    }

    /// Makes the next pass use `epoch`, from its first batch. Every rank must do the same.
    pub fn set_epoch(&self, epoch: u64) {
        self.load_state(LoaderState::at_epoch(epoch));
    }

    /// The position to save in a checkpoint (see [`LoaderState`]).
    pub fn state(&self) -> LoaderState {
        let s = self.lock_state();
        let (b, w) = (self.config.batch_size, self.config.world_size);
        let global = self.config.range.is_none();
        let (batches_done, before, items) = match s.current {
            Some((_, _, n)) => (n, s.current_span.0, s.current_span.1),
            None => match s.skip_samples {
                Some(c) => (0, c, 0),
                None => (s.skip_batches, 0, self.num_items_per_epoch()),
            },
        };
        LoaderState {
            epoch: s.current.map_or(s.next_epoch, |(_, e, _)| e),
            batches_done,
            samples_done: global.then(|| before + (batches_done * b).min(items) as u64 * w as u64),
            world_size: global.then_some(w),
        }
    }

    /// Restores a saved position: the next pass reads `state.epoch`, skipping its first
    /// `state.batches_done` batches; the pass after it reads `state.epoch + 1` from the start.
    /// A pass in progress is left to finish, but is no longer tracked.
    ///
    /// A state written at another world size (or by a pass that itself resumed at another
    /// one) continues from `state.samples_done` instead: the next pass is this rank's share of
    /// the rest of the epoch ([`DistributedSampler::indices_after`]), so its
    /// [`num_batches`](ShardedBatches::num_batches) is smaller. Without `samples_done` (a
    /// state from before it existed) a different world size is warned about and the resume
    /// goes by batches (the checkpoint's world size, `burn_ddp::checkpoint::Resumed::world_size`, tells
    /// the program).
    pub fn load_state(&self, state: LoaderState) {
        let (b, w) = (self.config.batch_size, self.config.world_size);
        let by_batches = (state.batches_done * b).min(self.num_items_per_epoch()) as u64 * w as u64;
        let by_samples = match (state.samples_done, state.world_size) {
            (Some(c), Some(_)) if self.config.range.is_some() => {
                tracing::warn!(
                    samples_done = c,
                    "a sliced loader resumes by batches: the sample position of the state is not used"
                );
                None
            }
            (Some(c), Some(saved)) if saved != w || c != by_batches => {
                tracing::info!(
                    epoch = state.epoch,
                    samples_done = c,
                    saved_world_size = saved,
                    world_size = w,
                    "resuming the epoch from its global sample position"
                );
                Some(c)
            }
            _ => None,
        };
        let mut s = self.lock_state();
        s.next_epoch = state.epoch;
        s.skip_batches = if by_samples.is_some() {
            0
        } else {
            state.batches_done
        };
        s.skip_samples = by_samples;
        s.current = None;
    }

    fn lock_state(&self) -> MutexGuard<'_, EpochState> {
        lock(&self.state)
    }

    /// Starts the next epoch: computes its plan and advances the state.
    fn start_pass(&self) -> (u64, Plan) {
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let mut s = self.lock_state();
        let epoch = s.next_epoch;
        let skip = std::mem::take(&mut s.skip_batches);
        let before = s.skip_samples.take().unwrap_or(0);
        s.next_epoch = epoch.wrapping_add(1);

        let mut sampler = self.sampler_for(self.dataset.len());
        sampler.set_epoch(epoch);
        let mut indices = sampler.indices_after(usize::try_from(before).unwrap_or(usize::MAX));
        if let Some(r) = &self.config.range {
            let end = r.end.min(indices.len());
            let start = r.start.min(end);
            indices.truncate(end);
            indices.drain(..start);
        }
        let b = self.config.batch_size;
        if self.config.drop_last_batch {
            indices.truncate(indices.len() - indices.len() % b);
        }
        let items_total = indices.len();
        let batches: Arc<Vec<Vec<usize>>> =
            Arc::new(indices.chunks(b).map(<[usize]>::to_vec).collect());
        let first = skip.min(batches.len());
        let items_before_first = batches[..first].iter().map(Vec::len).sum();
        s.current = Some((generation, epoch, first));
        s.current_span = (before, items_total);
        drop(s);

        if batches.is_empty() {
            tracing::warn!(
                rank = self.config.rank,
                world_size = self.config.world_size,
                dataset_len = self.dataset.len(),
                epoch,
                "empty epoch: this rank has no batches (every rank gets the same count)"
            );
        } else {
            tracing::debug!(
                rank = self.config.rank,
                epoch,
                batches = batches.len(),
                first,
                "data pass"
            );
        }
        (
            generation,
            Plan {
                epoch,
                batches,
                first,
                items_total,
                items_before_first,
            },
        )
    }

    /// Starts the next epoch and returns an iterator over this rank's batches, in order.
    ///
    /// Errors (dataset failure, panic in the dataset or batcher, lost worker, timeout) are
    /// yielded once, after which the iterator ends.
    pub fn batches(&self) -> ShardedBatches<I, O> {
        let (generation, plan) = self.start_pass();
        // Release the workers from an older pass that is still being read (it now reports
        // `Superseded`); the generation was bumped first, so they stop building for it.
        let old = lock(&self.active).take();
        drop(old);
        let source = if self.config.num_workers == 0 {
            Ok(Source::Inline {
                dataset: self.dataset.clone(),
                batcher: self.batcher.clone(),
                device: self.device.clone(),
            })
        } else {
            self.pool().map(|pool| {
                let receivers =
                    pool.start(generation, plan.epoch, plan.batches.clone(), plan.first);
                let workers = receivers.len();
                *lock(&self.active) = Some(ActivePass {
                    generation,
                    receivers,
                });
                Source::Workers {
                    active: self.active.clone(),
                    workers,
                }
            })
        };
        let (source, pending_error) = match source {
            Ok(source) => (Some(source), None),
            Err(e) => (None, Some(e)),
        };
        ShardedBatches {
            source,
            pending_error,
            next: plan.first,
            first: plan.first,
            epoch: plan.epoch,
            items_done: plan.items_before_first,
            items_total: plan.items_total,
            batches: plan.batches,
            generation,
            live_generation: self.generation.clone(),
            state: self.state.clone(),
            timeout: self.config.batch_timeout,
            finished: false,
        }
    }

    fn pool(&self) -> Result<&WorkerPool<O>, DataError> {
        let pool = self.pool.get_or_init(|| {
            WorkerPool::spawn(
                self.config.num_workers,
                self.config.prefetch,
                self.dataset.clone(),
                self.batcher.clone(),
                self.device.clone(),
                self.generation.clone(),
            )
            .map_err(|e| e.to_string())
        });
        pool.as_ref()
            .map_err(|e| DataError::Spawn(std::io::Error::other(e.clone())))
    }

    fn derived(&self, config: Config, device: Device) -> Self {
        let state = self.lock_state().clone();
        Self::from_parts(
            self.dataset.clone(),
            self.batcher.clone(),
            config,
            device,
            state,
        )
    }

    /// A loader reading only items `start..end` of this rank's shard each epoch (same epoch
    /// sequence and batch size), for splitting an epoch. Ranges are clamped to the shard.
    ///
    /// # Errors
    /// [`DataError::InvalidSlice`] if `start > end`.
    pub fn slice_items(&self, start: usize, end: usize) -> Result<Self, DataError> {
        if start > end {
            return Err(DataError::InvalidSlice {
                start,
                end,
                len: self.shard_len(),
            });
        }
        Ok(self.sliced(start, end))
    }

    /// [`slice_items`](Self::slice_items) for `start <= end`.
    fn sliced(&self, start: usize, end: usize) -> Self {
        let base = self.config.range.clone().unwrap_or(0..usize::MAX);
        let lo = base.start.saturating_add(start).min(base.end);
        let hi = base.start.saturating_add(end).min(base.end);
        let config = Config {
            range: Some(lo..hi),
            ..self.config.clone()
        };
        self.derived(config, self.device.clone())
    }

    /// The same loader (same settings and epoch position) placing batches on `device`.
    pub fn with_device(&self, device: Device) -> Self {
        self.derived(self.config.clone(), device)
    }
}

impl<I, O> Drop for ShardedDataLoader<I, O> {
    fn drop(&mut self) {
        // Workers stop after the batch at hand; iterators still alive report `Superseded`.
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

/// Locks a mutex, recovering from poisoning (the guarded data stays consistent: every critical
/// section here is a plain field update).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests;
