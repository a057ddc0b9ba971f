//! Burn's [`DataLoader`] trait for [`ShardedDataLoader`], so burn-train's `Learner` can use it.

use super::*;

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
