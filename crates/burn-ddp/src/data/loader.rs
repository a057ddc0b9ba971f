//! [`ShardedDataLoader`]: per-rank batches from a [`DistributedSampler`] shard, built by
//! background workers with ordered prefetch.

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoaderState {
    /// The epoch in progress, or the next one.
    pub epoch: u64,
    /// Batches of that epoch already consumed.
    pub batches_done: usize,
}

/// Builds a [`ShardedDataLoader`]; every setting has a default except the batcher.
///
/// ```
/// use burn::data::dataloader::batcher::Batcher;
/// use burn::data::dataset::InMemDataset;
/// use burn::tensor::Device;
/// use burn_ddp::data::ShardedDataLoaderBuilder;
///
/// #[derive(Clone)]
/// struct Ids;
/// impl Batcher<u32, Vec<u32>> for Ids {
///     fn batch(&self, items: Vec<u32>, _device: &Device) -> Vec<u32> {
///         items
///     }
/// }
///
/// // Rank 1 of 2 (from RANK / WORLD_SIZE in a real program), 10 items, batch 2 per rank.
/// let loader = ShardedDataLoaderBuilder::new(Ids)
///     .batch_size(2)
///     .seed(7)
///     .build(InMemDataset::new((0..10).collect()), 1, 2, Device::default())
///     .unwrap();
/// assert_eq!(loader.num_batches(), 3); // 5 items on this rank → batches of 2, 2, 1
/// let epoch0: Vec<Vec<u32>> = loader.batches().map(Result::unwrap).collect();
/// let epoch1: Vec<Vec<u32>> = loader.batches().map(Result::unwrap).collect();
/// assert_eq!(epoch0.len(), 3);
/// assert_ne!(epoch0, epoch1); // each pass is a new epoch with a new order
/// ```
pub struct ShardedDataLoaderBuilder<I, O> {
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    drop_last_batch: bool,
    num_workers: usize,
    prefetch: usize,
    batch_timeout: Duration,
}

impl<I, O> ShardedDataLoaderBuilder<I, O>
where
    I: Send + 'static,
    O: Send + 'static,
{
    /// A builder with batch size 1, shuffling with seed 0, padding (no sampler drop_last),
    /// partial last batches kept, [`DEFAULT_NUM_WORKERS`] workers, [`DEFAULT_PREFETCH`] batches
    /// of prefetch per worker and a [`DEFAULT_BATCH_TIMEOUT`].
    pub fn new(batcher: impl Batcher<I, O> + 'static) -> Self {
        Self {
            batcher: Arc::new(batcher),
            batch_size: 1,
            shuffle: true,
            seed: 0,
            drop_last: false,
            drop_last_batch: false,
            num_workers: DEFAULT_NUM_WORKERS,
            prefetch: DEFAULT_PREFETCH,
            batch_timeout: DEFAULT_BATCH_TIMEOUT,
        }
    }

    /// Items per batch **on this rank**. The global (effective) batch of one optimizer step is
    /// `batch_size × world_size`: to match a single-process run with batch `B` on `W` ranks,
    /// use `B / W` here.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// Shuffle each epoch (default `true`).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Base seed of the shuffle; epoch `e` uses `seed + e`. Must be equal on every rank.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sampler-level drop_last: truncate the global order to a multiple of the world size
    /// instead of padding it (see [`DistributedSampler`]).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Batch-level drop_last: drop this rank's last batch when it has fewer than `batch_size`
    /// items. Every rank has the same shard length, so every rank drops or keeps alike.
    pub fn drop_last_batch(mut self, drop_last_batch: bool) -> Self {
        self.drop_last_batch = drop_last_batch;
        self
    }

    /// Background worker threads building batches (0: build them in the iterating thread).
    pub fn num_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// Finished batches each worker may hold ahead of the consumer (at least 1 is used).
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Longest wait for one batch; past it the iterator yields [`DataError::Timeout`].
    pub fn batch_timeout(mut self, timeout: Duration) -> Self {
        self.batch_timeout = timeout;
        self
    }

    /// Builds the loader for rank `rank` of `world_size`, placing batches on `device`.
    ///
    /// # Errors
    /// [`DataError::ZeroReplicas`], [`DataError::RankOutOfRange`] or
    /// [`DataError::ZeroBatchSize`] for a bad configuration.
    pub fn build(
        self,
        dataset: impl Dataset<I> + 'static,
        rank: usize,
        world_size: usize,
        device: Device,
    ) -> Result<ShardedDataLoader<I, O>, DataError> {
        check_rank(world_size, rank)?;
        if self.batch_size == 0 {
            return Err(DataError::ZeroBatchSize);
        }
        let config = Config {
            rank,
            world_size,
            batch_size: self.batch_size,
            shuffle: self.shuffle,
            seed: self.seed,
            drop_last: self.drop_last,
            drop_last_batch: self.drop_last_batch,
            num_workers: self.num_workers,
            prefetch: self.prefetch.max(1),
            batch_timeout: self.batch_timeout,
            range: None,
        };
        Ok(ShardedDataLoader::from_parts(
            Arc::new(dataset),
            self.batcher,
            config,
            device,
            EpochState::default(),
        ))
    }

    /// Builds the loader for this rank of a [`Ddp`](crate::Ddp) job: its rank, world size
    /// and device (batches land on `ddp.device()`; call `.autodiff()` on the tensors' device
    /// yourself only if the batcher does not).
    ///
    /// ```no_run
    /// # use burn_ddp::data::ShardedDataLoaderBuilder;
    /// # use burn::data::{dataloader::batcher::Batcher, dataset::Dataset};
    /// # fn demo<I: Send + 'static, O: Send + 'static>(
    /// #     ddp: &burn_ddp::Ddp,
    /// #     batcher: impl Batcher<I, O> + 'static,
    /// #     dataset: impl Dataset<I> + 'static,
    /// # ) {
    /// let loader = ShardedDataLoaderBuilder::new(batcher)
    ///     .batch_size(32) // per rank: the global batch is 32 × world size
    ///     .seed(42)
    ///     .build_for(dataset, ddp)
    ///     .unwrap();
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`Self::build`].
    pub fn build_for(
        self,
        dataset: impl Dataset<I> + 'static,
        ddp: &crate::Ddp,
    ) -> Result<ShardedDataLoader<I, O>, DataError> {
        self.build(dataset, ddp.rank(), ddp.world_size(), ddp.device().clone())
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
    /// (generation, epoch, batches yielded) of the pass being read, if any.
    current: Option<(u64, u64, usize)>,
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
/// including batches already consumed in an interrupted epoch.
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

    /// The loader with default settings and per-rank `batch_size`, in one call.
    ///
    /// # Errors
    /// As [`ShardedDataLoaderBuilder::build`].
    pub fn new(
        dataset: impl Dataset<I> + 'static,
        batcher: impl Batcher<I, O> + 'static,
        batch_size: usize,
        rank: usize,
        world_size: usize,
        device: Device,
    ) -> Result<Self, DataError> {
        ShardedDataLoaderBuilder::new(batcher)
            .batch_size(batch_size)
            .build(dataset, rank, world_size, device)
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
        self.load_state(LoaderState {
            epoch,
            batches_done: 0,
        });
    }

    /// The position to save in a checkpoint (see [`LoaderState`]).
    pub fn state(&self) -> LoaderState {
        let s = self.lock_state();
        match s.current {
            Some((_, epoch, batches_done)) => LoaderState {
                epoch,
                batches_done,
            },
            None => LoaderState {
                epoch: s.next_epoch,
                batches_done: s.skip_batches,
            },
        }
    }

    /// Restores a saved position: the next pass reads `state.epoch`, skipping its first
    /// `state.batches_done` batches; the pass after it reads `state.epoch + 1` from the start.
    /// A pass in progress is left to finish, but is no longer tracked.
    pub fn load_state(&self, state: LoaderState) {
        let mut s = self.lock_state();
        s.next_epoch = state.epoch;
        s.skip_batches = state.batches_done;
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
        s.next_epoch = epoch.wrapping_add(1);

        let mut sampler = self.sampler_for(self.dataset.len());
        sampler.set_epoch(epoch);
        let mut indices = sampler.indices();
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

/// Where the batches of a pass come from.
enum Source<I, O> {
    /// Built in the iterating thread (`num_workers == 0`).
    Inline {
        dataset: Arc<dyn Dataset<I>>,
        batcher: Arc<dyn Batcher<I, O>>,
        device: Device,
    },
    /// Built by the worker pool; batch `k` comes from receiver `(k - first) % workers` of
    /// the active pass, if this pass is still the active one.
    Workers {
        active: ActiveSlot<O>,
        workers: usize,
    },
}

/// The batches of one pass (one epoch) of a [`ShardedDataLoader`], in order.
pub struct ShardedBatches<I, O> {
    source: Option<Source<I, O>>,
    pending_error: Option<DataError>,
    batches: Arc<Vec<Vec<usize>>>,
    next: usize,
    first: usize,
    epoch: u64,
    items_done: usize,
    items_total: usize,
    generation: u64,
    live_generation: Arc<AtomicU64>,
    state: Arc<Mutex<EpochState>>,
    timeout: Duration,
    finished: bool,
}

impl<I, O> ShardedBatches<I, O> {
    /// The epoch of this pass.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches this pass yields in total (including any skipped on resume).
    pub fn num_batches(&self) -> usize {
        self.batches.len()
    }

    /// Items yielded so far / items in this pass on this rank.
    pub fn progress(&self) -> Progress {
        Progress::new(self.items_done, self.items_total, Some("items".to_string()))
    }

    fn record(&self, batches_done: usize, done: bool) {
        let mut s = lock(&self.state);
        if let Some((generation, _, n)) = s.current.as_mut()
            && *generation == self.generation
        {
            *n = batches_done;
            if done {
                s.current = None;
            }
        }
    }

    fn fetch(&mut self, k: usize) -> Result<O, DataError> {
        match self
            .source
            .as_ref()
            .expect("source is set when no error is pending")
        {
            Source::Inline {
                dataset,
                batcher,
                device,
            } => build_batch(
                dataset.as_ref(),
                batcher.as_ref(),
                &self.batches[k],
                device,
                self.epoch,
                k,
            ),
            Source::Workers { active, workers } => {
                let worker = (k - self.first) % *workers;
                let slot = lock(active);
                let Some(pass) = slot.as_ref().filter(|p| p.generation == self.generation) else {
                    return Err(DataError::Superseded { epoch: self.epoch });
                };
                match pass.receivers[worker].recv_timeout(self.timeout) {
                    Ok(result) => result,
                    Err(RecvTimeoutError::Timeout) => Err(DataError::Timeout {
                        batch: k,
                        epoch: self.epoch,
                        timeout: self.timeout,
                    }),
                    Err(RecvTimeoutError::Disconnected) => {
                        if self.live_generation.load(Ordering::SeqCst) != self.generation {
                            Err(DataError::Superseded { epoch: self.epoch })
                        } else {
                            Err(DataError::WorkerLost {
                                worker,
                                batch: k,
                                epoch: self.epoch,
                            })
                        }
                    }
                }
            }
        }
    }
}

impl<I, O> ShardedBatches<I, O> {
    /// Ends the pass: drops its receivers (if still active) so its workers are released.
    fn release(&mut self) {
        if let Some(Source::Workers { active, .. }) = self.source.take() {
            let mut slot = lock(&active);
            if slot
                .as_ref()
                .is_some_and(|p| p.generation == self.generation)
            {
                *slot = None;
            }
        }
    }
}

impl<I, O> Drop for ShardedBatches<I, O> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<I, O> Iterator for ShardedBatches<I, O> {
    type Item = Result<O, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        if let Some(e) = self.pending_error.take() {
            self.finished = true;
            return Some(Err(e));
        }
        if self.next >= self.batches.len() {
            self.finished = true;
            self.release();
            self.record(self.next, true);
            return None;
        }
        let k = self.next;
        match self.fetch(k) {
            Ok(batch) => {
                self.next += 1;
                self.items_done += self.batches[k].len();
                self.record(self.next, false);
                Some(Ok(batch))
            }
            Err(e) => {
                tracing::error!(epoch = self.epoch, batch = k, error = %e, "data loader error");
                self.finished = true;
                self.release();
                Some(Err(e))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.finished {
            return (0, Some(0));
        }
        let left = self.batches.len() - self.next.min(self.batches.len());
        (0, Some(left + usize::from(self.pending_error.is_some())))
    }
}

/// Locks a mutex, recovering from poisoning (the guarded data stays consistent: every critical
/// section here is a plain field update).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Fetches the items of one batch and batches them, turning a dataset error or a panic into
/// a [`DataError`].
fn build_batch<I, O>(
    dataset: &dyn Dataset<I>,
    batcher: &dyn Batcher<I, O>,
    indices: &[usize],
    device: &Device,
    epoch: u64,
    batch: usize,
) -> Result<O, DataError> {
    let run = catch_unwind(AssertUnwindSafe(|| {
        dataset
            .get_many(indices.to_vec())
            .map(|items| batcher.batch(items, device))
    }));
    match run {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(DataError::Dataset {
            epoch,
            batch,
            message: e.to_string(),
        }),
        Err(payload) => Err(DataError::Panicked {
            epoch,
            batch,
            message: panic_message(payload.as_ref()),
        }),
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// One pass handed to a worker.
struct Job<O> {
    generation: u64,
    epoch: u64,
    batches: Arc<Vec<Vec<usize>>>,
    /// The worker builds batches `start, start + stride, …`.
    start: usize,
    stride: usize,
    out: SyncSender<Result<O, DataError>>,
}

/// Persistent worker threads, reused for every pass.
struct WorkerPool<O> {
    commands: Vec<Sender<Job<O>>>,
    handles: Vec<JoinHandle<()>>,
    prefetch: usize,
}

impl<O: Send + 'static> WorkerPool<O> {
    fn spawn<I: Send + 'static>(
        num_workers: usize,
        prefetch: usize,
        dataset: Arc<dyn Dataset<I>>,
        batcher: Arc<dyn Batcher<I, O>>,
        device: Device,
        live_generation: Arc<AtomicU64>,
    ) -> Result<Self, DataError> {
        let mut commands = Vec::with_capacity(num_workers);
        let mut handles = Vec::with_capacity(num_workers);
        for w in 0..num_workers {
            let (tx, rx) = mpsc::channel::<Job<O>>();
            let dataset = dataset.clone();
            let batcher = batcher.clone();
            let device = device.clone();
            let live = live_generation.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ddp-data-{w}"))
                .spawn(move || worker_loop(rx, dataset.as_ref(), batcher.as_ref(), &device, &live))
                .map_err(DataError::Spawn)?;
            commands.push(tx);
            handles.push(handle);
        }
        Ok(Self {
            commands,
            handles,
            prefetch,
        })
    }

    /// Hands a pass to every worker; returns the per-worker receivers.
    fn start(
        &self,
        generation: u64,
        epoch: u64,
        batches: Arc<Vec<Vec<usize>>>,
        first: usize,
    ) -> Vec<Receiver<Result<O, DataError>>> {
        let stride = self.commands.len();
        self.commands
            .iter()
            .enumerate()
            .map(|(w, command)| {
                let (out, rx) = mpsc::sync_channel(self.prefetch);
                let job = Job {
                    generation,
                    epoch,
                    batches: batches.clone(),
                    start: first + w,
                    stride,
                    out,
                };
                // A dead worker drops the job (and its sender): the iterator then reports
                // `WorkerLost` for that worker's first batch instead of waiting.
                let _ = command.send(job);
                rx
            })
            .collect()
    }
}

impl<O> Drop for WorkerPool<O> {
    fn drop(&mut self) {
        // Closing the command channels ends each worker's loop once its current pass is over;
        // the live generation was bumped by the loader's drop, so a pass in progress stops
        // after the batch at hand. The threads are detached rather than joined: a worker may be
        // blocked handing a batch to an iterator that outlives the loader, and joining it here
        // could deadlock the thread that holds that iterator.
        self.commands.clear();
        self.handles.clear();
    }
}

fn worker_loop<I, O>(
    jobs: Receiver<Job<O>>,
    dataset: &dyn Dataset<I>,
    batcher: &dyn Batcher<I, O>,
    device: &Device,
    live_generation: &AtomicU64,
) {
    while let Ok(job) = jobs.recv() {
        let mut k = job.start;
        while k < job.batches.len() {
            if live_generation.load(Ordering::SeqCst) != job.generation {
                break; // superseded by a newer pass
            }
            let result = build_batch(dataset, batcher, &job.batches[k], device, job.epoch, k);
            let failed = result.is_err();
            if job.out.send(result).is_err() || failed {
                break; // the consumer is gone, or the pass ends at this error
            }
            k += job.stride;
        }
    }
}

/// [`DataLoaderIterator`] adapter: Burn's loaders yield `DatasetError`.
struct BurnIter<I, O>(ShardedBatches<I, O>);

impl<I, O> Iterator for BurnIter<I, O> {
    type Item = Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.0.next().map(|r| r.map_err(DatasetError::new))
    }
}

impl<I, O> DataLoaderIterator<O> for BurnIter<I, O> {
    fn progress(&self) -> Progress {
        self.0.progress()
    }
}

impl<I, O> DataLoader<O> for ShardedDataLoader<I, O>
where
    I: Send + 'static,
    O: Send + 'static,
{
    /// Starts the next epoch (see [`ShardedDataLoader::batches`]).
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        Box::new(BurnIter(self.batches()))
    }

    /// Items per epoch on this rank (what the iterator's progress counts to).
    fn num_items(&self) -> usize {
        self.num_items_per_epoch()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<O>> {
        Arc::new(self.with_device(device.clone()))
    }

    /// Items `start..end` of this rank's shard each epoch; an inverted range gives an empty
    /// loader (the trait has no error channel here).
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<O>> {
        Arc::new(self.sliced(start, end.max(start)))
    }
}

#[cfg(test)]
mod tests;
