//! [`DistributedSampler`]: which dataset indices each rank reads in an epoch.

use super::DataError;
use super::shuffle::permutation;

/// Splits the indices `0..dataset_len` of a dataset among `num_replicas` ranks, with
/// PyTorch's `torch.utils.data.DistributedSampler` semantics.
///
/// Each epoch:
/// 1. the global order is `0..dataset_len`, or, with `shuffle` (the default), the stable
///    permutation for `seed + epoch` (wrapping add; see the [`shuffle`](super::shuffle) module
///    for the exact, platform-independent algorithm). Every rank computes the same order.
/// 2. the order is made a multiple of `num_replicas` long:
///    - `drop_last = false` (default): **padding** — the head of the order is repeated
///      (cyclically if the dataset has fewer items than ranks) until the length is
///      `ceil(len / W) · W`. Every item is seen at least once per epoch, and at most `W − 1`
///      items are seen twice (with `len < W`, items repeat more, so every rank still gets one).
///    - `drop_last = true`: **truncation** — the tail is dropped down to `floor(len / W) · W`.
///      No item is seen twice, but up to `W − 1` items (different ones each epoch when
///      shuffling) are skipped. With fewer items than ranks, every rank gets an empty epoch.
/// 3. rank `r` takes positions `r, r + W, r + 2W, …` of that list (`indices[r::W]`).
///
/// So every rank gets exactly [`num_samples`](Self::num_samples) indices — the property that
/// keeps DDP ranks in lockstep. An empty dataset gives every rank an empty epoch.
///
/// Call [`set_epoch`](Self::set_epoch) before each epoch (the
/// [`ShardedDataLoader`](super::ShardedDataLoader) does it by itself), or every epoch repeats
/// the same order.
///
/// ```
/// use burn_ddp_data::DistributedSampler;
///
/// // 10 items, 4 ranks, no shuffling: padded to 12 by repeating items 0 and 1.
/// let shard = |rank| {
///     DistributedSampler::new(10, 4, rank)
///         .unwrap()
///         .with_shuffle(false)
///         .indices()
/// };
/// assert_eq!(shard(0), vec![0, 4, 8]);
/// assert_eq!(shard(1), vec![1, 5, 9]);
/// assert_eq!(shard(2), vec![2, 6, 0]);
/// assert_eq!(shard(3), vec![3, 7, 1]);
///
/// // The same with drop_last: truncated to 8, items 8 and 9 are skipped this epoch.
/// let s = DistributedSampler::new(10, 4, 3).unwrap().with_shuffle(false).with_drop_last(true);
/// assert_eq!(s.indices(), vec![3, 7]);
///
/// // Bad configuration is an error, not a panic.
/// assert!(DistributedSampler::new(10, 4, 4).is_err());
/// assert!(DistributedSampler::new(10, 0, 0).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler for rank `rank` of `num_replicas` over a dataset of `dataset_len` items, with
    /// `shuffle = true`, `seed = 0`, `drop_last = false` and epoch 0.
    ///
    /// # Errors
    /// [`DataError::ZeroReplicas`] if `num_replicas == 0`, [`DataError::RankOutOfRange`] if
    /// `rank >= num_replicas`.
    pub fn new(dataset_len: usize, num_replicas: usize, rank: usize) -> Result<Self, DataError> {
        check_rank(num_replicas, rank)?;
        Ok(Self {
            dataset_len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// Shuffle the order each epoch (default `true`).
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Base seed of the shuffle; epoch `e` uses `seed + e` (default 0). Must be the same on
    /// every rank.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Truncate instead of pad (default `false`; see the type docs for the trade-off).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which changes the shuffle order. Every rank must use the same epoch.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Number of items in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// The world size.
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether the order is shuffled.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// The base seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether the tail is dropped instead of padded.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// Indices per rank and epoch: `ceil(len / W)` when padding, `floor(len / W)` with
    /// `drop_last`. The same on every rank.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.dataset_len / self.num_replicas
        } else {
            self.dataset_len.div_ceil(self.num_replicas)
        }
    }

    /// Indices per epoch over all ranks: `num_samples · W`.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.num_replicas
    }

    /// The padded (or truncated) global order of the current epoch, of length
    /// [`total_size`](Self::total_size); rank `r` reads positions `r, r + W, …`.
    pub fn global_indices(&self) -> Vec<usize> {
        self.global_indices_after(0)
    }

    /// The epoch's order before padding or truncation: the permutation, or `0..len`.
    fn order(&self) -> Vec<usize> {
        if self.shuffle {
            permutation(self.dataset_len, self.seed.wrapping_add(self.epoch))
        } else {
            (0..self.dataset_len).collect()
        }
    }

    /// The rest of the epoch's global order after its first `consumed` items, made a multiple
    /// of the world size: truncated with `drop_last`, else padded with the head of the
    /// *whole* order (cyclically), as [`global_indices`](Self::global_indices) is. So for a
    /// `consumed` that is a multiple of the world size, it is `global_indices()[consumed..]`.
    pub fn global_indices_after(&self, consumed: usize) -> Vec<usize> {
        let order = self.order();
        let len = order.len();
        let start = consumed.min(len);
        let rest = len - start;
        let w = self.num_replicas;
        if self.drop_last {
            return order[start..start + rest / w * w].to_vec();
        }
        let mut out = order[start..].to_vec();
        if rest > 0 {
            for i in 0..rest.div_ceil(w) * w - rest {
                out.push(order[i % len]);
            }
        }
        out
    }

    /// This rank's indices for the current epoch, in the order they should be read.
    pub fn indices(&self) -> Vec<usize> {
        self.indices_after(0)
    }

    /// This rank's indices for the rest of the current epoch, after the first `consumed`
    /// items of the epoch's order were read by the job **at any world size**: ranks read the
    /// order strided, so `k` items read on each of `W` ranks are its first `k·W`, whatever `W`
    /// was. The rest is shared among this sampler's ranks as an epoch is (see
    /// [`global_indices_after`](Self::global_indices_after)): every rank gets the same count,
    /// no item of the epoch is skipped or read twice beyond the padding. At the same world
    /// size it continues exactly where [`indices`](Self::indices) would have.
    ///
    /// ```
    /// use burn_ddp_data::DistributedSampler;
    ///
    /// // 12 items read by 4 ranks, 1 each (the first 4 of the order), then 2 ranks go on.
    /// let rest = |rank| {
    ///     DistributedSampler::new(12, 2, rank)
    ///         .unwrap()
    ///         .with_shuffle(false)
    ///         .indices_after(4)
    /// };
    /// assert_eq!(rest(0), vec![4, 6, 8, 10]);
    /// assert_eq!(rest(1), vec![5, 7, 9, 11]);
    /// ```
    pub fn indices_after(&self, consumed: usize) -> Vec<usize> {
        self.global_indices_after(consumed)
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }
}

/// Checks a (world size, rank) pair.
pub(crate) fn check_rank(num_replicas: usize, rank: usize) -> Result<(), DataError> {
    if num_replicas == 0 {
        return Err(DataError::ZeroReplicas);
    }
    if rank >= num_replicas {
        return Err(DataError::RankOutOfRange {
            rank,
            world_size: num_replicas,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn shards(len: usize, w: usize, drop_last: bool, seed: u64, epoch: u64) -> Vec<Vec<usize>> {
        (0..w)
            .map(|r| {
                let mut s = DistributedSampler::new(len, w, r)
                    .unwrap()
                    .with_seed(seed)
                    .with_drop_last(drop_last);
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    /// Reassembles the global order from the per-rank shards (`global[k·W + r] = shard_r[k]`).
    fn interleave(shards: &[Vec<usize>]) -> Vec<usize> {
        let n = shards[0].len();
        (0..n)
            .flat_map(|k| shards.iter().map(move |s| s[k]))
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Equal lengths, in-range indices, and the exact coverage/duplication rule: the
        /// interleaved shards are a permutation of `0..len` followed by a cyclic repeat of its
        /// head (padding), or the first `floor(len/W)·W` entries of a permutation (drop_last).
        #[test]
        fn shards_cover_the_dataset(
            len in 0usize..10_000,
            w in 1usize..=8,
            drop_last in any::<bool>(),
            seed in any::<u64>(),
            epoch in 0u64..1000,
        ) {
            let sh = shards(len, w, drop_last, seed, epoch);
            let n = sh[0].len();
            for s in &sh {
                prop_assert_eq!(s.len(), n, "unequal shard lengths");
                prop_assert!(s.iter().all(|&i| i < len));
            }
            let global = interleave(&sh);
            if drop_last {
                prop_assert_eq!(n, len / w);
                let distinct: HashSet<usize> = global.iter().copied().collect();
                prop_assert_eq!(distinct.len(), global.len(), "shards overlap with drop_last");
                prop_assert_eq!(len - global.len(), len % w, "dropped more than the tail");
            } else {
                prop_assert_eq!(n, len.div_ceil(w));
                let mut head = global[..len].to_vec();
                head.sort_unstable();
                prop_assert_eq!(head, (0..len).collect::<Vec<_>>(), "not every index covered");
                let pad = &global[len..];
                prop_assert!(pad.len() < w.max(1));
                for (i, &p) in pad.iter().enumerate() {
                    prop_assert_eq!(p, global[i % len], "duplicate that is not head padding");
                }
            }
        }

        /// Same (seed, epoch) → same shards, from fresh samplers.
        #[test]
        fn shards_are_deterministic(
            len in 0usize..10_000,
            w in 1usize..=8,
            drop_last in any::<bool>(),
            seed in any::<u64>(),
            epoch in any::<u64>(),
        ) {
            prop_assert_eq!(
                shards(len, w, drop_last, seed, epoch),
                shards(len, w, drop_last, seed, epoch)
            );
        }

        /// Different epochs → a different order on every rank. Sound condition: a dataset of at
        /// least 20 items and shards of at least 8 items, so an accidental repeat of a rank's
        /// shard has probability below 1/(20·19·…·13) ≈ 2e-10 per case.
        #[test]
        fn epochs_change_every_shard(
            len in 20usize..10_000,
            w in 1usize..=8,
            drop_last in any::<bool>(),
            seed in any::<u64>(),
            epoch in 0u64..1000,
            step in 1u64..1000,
        ) {
            prop_assume!(len / w >= 8);
            let a = shards(len, w, drop_last, seed, epoch);
            let b = shards(len, w, drop_last, seed, epoch + step);
            for (r, (x, y)) in a.iter().zip(&b).enumerate() {
                prop_assert_ne!(x, y, "rank {} got the same shard in two epochs", r);
            }
        }
    }

    proptest! {
        /// A job that reads `k` items per rank at world size `w1`, then goes on at `w2` from
        /// the global count `k·w1`: every item of the epoch is read once, apart from padding
        /// (each phase pads fewer than its world size), every rank of a phase gets the same
        /// count, and at `w2 = w1` the rest is what the uninterrupted shard had.
        #[test]
        fn resuming_at_another_world_size_reads_the_rest_of_the_epoch(
            len in 0usize..300,
            w1 in 1usize..6,
            w2 in 1usize..6,
            fraction in 0.0f64..1.0,
            drop_last in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let sampler = |w, r| DistributedSampler::new(len, w, r).unwrap().with_seed(seed).with_drop_last(drop_last);
            let per_rank = sampler(w1, 0).num_samples();
            let k = (per_rank as f64 * fraction) as usize;
            let mut read: Vec<usize> = Vec::new();
            for r in 0..w1 {
                read.extend(&sampler(w1, r).indices()[..k]);
            }
            let rest: Vec<Vec<usize>> = (0..w2).map(|r| sampler(w2, r).indices_after(k * w1)).collect();
            prop_assert!(rest.iter().all(|s| s.len() == rest[0].len()));
            read.extend(rest.iter().flatten());
            let distinct: HashSet<usize> = read.iter().copied().collect();
            let padding = read.len() - distinct.len();
            if drop_last {
                prop_assert_eq!(padding, 0);
                prop_assert!(len - distinct.len() < w1 + w2);
            } else {
                prop_assert_eq!(distinct.len(), len);
                prop_assert!(padding < w1.max(w2) * 2 || len < w1.max(w2));
            }
            if w1 == w2 {
                for (r, got) in rest.iter().enumerate() {
                    prop_assert_eq!(&got[..], &sampler(w1, r).indices()[k..]);
                }
            }
        }
    }

    #[test]
    fn no_shuffle_is_strided_order() {
        let s = DistributedSampler::new(7, 3, 1)
            .unwrap()
            .with_shuffle(false);
        // Padded to 9: [0..7, 0, 1]; rank 1 takes positions 1, 4, 7.
        assert_eq!(s.indices(), vec![1, 4, 0]);
    }

    #[test]
    fn fewer_items_than_ranks() {
        // Padding repeats the items cyclically so every rank still gets one.
        let sh = shards(3, 8, false, 0, 0);
        assert!(sh.iter().all(|s| s.len() == 1));
        let seen: HashSet<usize> = sh.iter().flatten().copied().collect();
        assert_eq!(seen, HashSet::from([0, 1, 2]));
        // drop_last: an empty epoch on every rank.
        assert!(shards(3, 8, true, 0, 0).iter().all(Vec::is_empty));
        // Empty dataset: an empty epoch on every rank, both ways.
        assert!(shards(0, 4, false, 0, 0).iter().all(Vec::is_empty));
        assert!(shards(0, 4, true, 0, 0).iter().all(Vec::is_empty));
    }

    #[test]
    fn bad_config_is_a_clear_error() {
        let e = DistributedSampler::new(5, 2, 2).unwrap_err();
        assert!(matches!(
            e,
            DataError::RankOutOfRange {
                rank: 2,
                world_size: 2
            }
        ));
        assert!(
            e.to_string()
                .contains("rank 2 is out of range for world size 2")
        );
        assert!(matches!(
            DistributedSampler::new(5, 0, 0),
            Err(DataError::ZeroReplicas)
        ));
    }

    #[test]
    fn seed_plus_epoch_is_the_shuffle_seed() {
        // PyTorch semantics: the order depends on seed + epoch only.
        assert_eq!(shards(100, 2, false, 5, 3), shards(100, 2, false, 8, 0));
        assert_eq!(
            DistributedSampler::new(100, 1, 0)
                .unwrap()
                .with_seed(9)
                .indices(),
            permutation(100, 9)
        );
    }
}
