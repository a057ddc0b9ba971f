//! What the loader needs to know of the job it feeds.

use burn::tensor::Device;

/// One rank of a data-parallel job, as
/// [`ShardedDataLoaderBuilder::build_for`](crate::ShardedDataLoaderBuilder::build_for) sees it.
/// `burn_ddp::Ddp` implements it; a
/// program with its own launcher can implement it for its own type.
pub trait RankOfJob {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// The device a training step of this rank reads its batches on (for `burn_ddp::Ddp`,
    /// its device with autodiff, so that a loss computed from a batch can be differentiated).
    fn training_device(&self) -> Device;
}

impl<T: RankOfJob + ?Sized> RankOfJob for &T {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn training_device(&self) -> Device {
        (**self).training_device()
    }
}

impl<T: RankOfJob + ?Sized> RankOfJob for std::sync::Arc<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn training_device(&self) -> Device {
        (**self).training_device()
    }
}
