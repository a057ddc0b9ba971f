//! The sharded optimizer's layout of what it moves: items (gradients, parameters) laid out
//! owner by owner — each owner's items in visit order are its *stream* — and cut into buckets
//! that each hold the `k`-th of `B` near-equal parts of **every** owner's stream. So every
//! reduce-scatter or all-gather call moves a part of every rank's shard, all ranks sending and
//! receiving at once, instead of one owner's item at a time; an item may span buckets.
//!
//! Sizes are in units of the caller's choosing (f32 elements for gradients, bytes for
//! parameters).

use std::ops::Range;

/// Items laid out owner by owner (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnerStreams {
    /// Per owner: `(item, first unit of the item in the owner's stream)`, in visit order.
    streams: Vec<Vec<(usize, usize)>>,
    /// Units of each owner's stream.
    totals: Vec<usize>,
    /// Units of each item.
    sizes: Vec<usize>,
}

impl OwnerStreams {
    /// The streams of the `present` items of `sizes` units, item `i` owned by `owners[i]`, over
    /// `world` owners.
    pub(crate) fn new(sizes: &[usize], present: &[bool], owners: &[usize], world: usize) -> Self {
        let mut streams = vec![Vec::new(); world];
        let mut totals = vec![0usize; world];
        for (i, &size) in sizes.iter().enumerate() {
            if present[i] {
                let o = owners[i];
                streams[o].push((i, totals[o]));
                totals[o] += size;
            }
        }
        OwnerStreams {
            streams,
            totals,
            sizes: sizes.to_vec(),
        }
    }

    /// Units of every owner's stream together.
    pub(crate) fn total(&self) -> usize {
        self.totals.iter().sum()
    }

    /// Buckets for a cap of `cap` units: each holds about `cap / world` units of every owner's
    /// stream (0 buckets when nothing is present).
    pub(crate) fn buckets(&self, cap: usize) -> usize {
        let per_owner = (cap / self.totals.len()).max(1);
        self.totals
            .iter()
            .map(|t| t.div_ceil(per_owner))
            .max()
            .unwrap_or(0)
    }

    /// Owner `p`'s stream units in bucket `k` of `buckets`.
    pub(crate) fn part(&self, p: usize, buckets: usize, k: usize) -> Range<usize> {
        let at = |k: usize| ((self.totals[p] as u128 * k as u128) / buckets as u128) as usize;
        at(k)..at(k + 1)
    }

    /// The sizes of every owner's part of bucket `k` of `buckets`, in rank order.
    pub(crate) fn counts(&self, buckets: usize, k: usize) -> Vec<usize> {
        (0..self.totals.len())
            .map(|p| self.part(p, buckets, k).len())
            .collect()
    }

    /// The items of owner `p` that overlap its stream range `part`, in stream order, with the
    /// overlap as `(item, range inside the item, offset inside the part)`. Across the buckets
    /// an item's ranges come in order and cover it once.
    pub(crate) fn overlaps(
        &self,
        p: usize,
        part: &Range<usize>,
    ) -> impl Iterator<Item = (usize, Range<usize>, usize)> + '_ {
        let part = part.clone();
        let stream = &self.streams[p];
        // The first item that ends after the part starts.
        let first = stream.partition_point(|&(i, at)| at + self.sizes[i] <= part.start);
        stream[first..]
            .iter()
            .take_while(move |&&(_, at)| at < part.end)
            .map(move |&(i, at)| {
                let from = part.start.max(at);
                let to = part.end.min(at + self.sizes[i]);
                (i, from - at..to - at, from - part.start)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_owner_stream_is_cut_into_the_buckets_in_order() {
        let sizes = [10, 3, 7, 5, 1];
        let present = [true, true, false, true, true];
        let owners = [0, 1, 0, 1, 0];
        let s = OwnerStreams::new(&sizes, &present, &owners, 2);
        assert_eq!(s.totals, [11, 8]);
        assert_eq!(s.total(), 19);
        assert_eq!(s.buckets(8), 3, "4 units per owner per bucket");
        assert_eq!(s.buckets(1000), 1);
        assert_eq!(s.counts(3, 0), [3, 2]);
        // Every unit of each owner's stream lands in exactly one bucket, in order.
        for (p, want) in [
            (
                0,
                (0..10).map(|e| (0, e)).chain([(4, 0)]).collect::<Vec<_>>(),
            ),
            (
                1,
                (0..3)
                    .map(|e| (1, e))
                    .chain((0..5).map(|e| (3, e)))
                    .collect(),
            ),
        ] {
            let mut seen = Vec::new();
            for k in 0..3 {
                let part = s.part(p, 3, k);
                for (i, range, off) in s.overlaps(p, &part) {
                    assert!(off + range.len() <= part.len());
                    seen.extend(range.map(|e| (i, e)));
                }
            }
            assert_eq!(seen, want, "owner {p}");
        }
    }

    #[test]
    fn nothing_present_makes_no_bucket() {
        let s = OwnerStreams::new(&[4, 4], &[false, false], &[0, 1], 2);
        assert_eq!(s.buckets(8), 0);
        assert_eq!(s.total(), 0);
    }
}
