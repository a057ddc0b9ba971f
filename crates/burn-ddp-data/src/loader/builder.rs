//! [`ShardedDataLoaderBuilder`]: the loader's settings, each with a default.

use super::*;

/// Builds a [`ShardedDataLoader`]; every setting has a default except the batcher.
///
/// ```
/// use burn::data::dataloader::batcher::Batcher;
/// use burn::data::dataset::InMemDataset;
/// use burn::tensor::Device;
/// use burn_ddp_data::ShardedDataLoaderBuilder;
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

    /// Builds the loader for this rank of a data-parallel job — `burn_ddp::Ddp` is one
    /// ([`RankOfJob`]): its rank, world size and the device a training step needs. With a
    /// `Ddp`, batches land on `ddp.device().autodiff()`, where the model trains and
    /// `loss.backward()` works. (For an evaluation loader without autodiff, use [`Self::build`]
    /// with `ddp.device().clone()`.)
    ///
    /// ```no_run
    /// # use burn_ddp_data::{RankOfJob, ShardedDataLoaderBuilder};
    /// # use burn::data::{dataloader::batcher::Batcher, dataset::Dataset};
    /// # fn demo<I: Send + 'static, O: Send + 'static>(
    /// #     ddp: &impl RankOfJob,
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
        ddp: &impl RankOfJob,
    ) -> Result<ShardedDataLoader<I, O>, DataError> {
        self.build(dataset, ddp.rank(), ddp.world_size(), ddp.training_device())
    }
}
