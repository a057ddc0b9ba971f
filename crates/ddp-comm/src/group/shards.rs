//! The layout of a buffer split into one shard per rank, in rank order and of any sizes (the
//! argument of [`ProcessGroup::reduce_scatter`] and [`ProcessGroup::all_gather_into`]), and
//! how the direct reduce-scatter cuts it into rounds.

use std::ops::Range;

use crate::error::{CommError, Result};

#[cfg(doc)]
use super::ProcessGroup;

/// Bytes of each rank's piece in one round of the direct reduce-scatter: the rounds bound the
/// staging memory (one piece, for the prefix sum of ranks ≥ 2, or `world_size` pieces of
/// 16-bit values on the compressed path). Measured on 2 cores, 4 ranks, 25–100 MiB: 1 MiB
/// pieces were 15 % slower than 4 MiB ones (a round ends with every rank waiting for all),
/// 64 MiB no faster.
pub(super) const PIECE_BYTES: usize = 4 << 20;

/// Shard `p` is elements `offs[p]..offs[p + 1]` of the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Shards {
    offs: Vec<usize>,
}

impl Shards {
    /// The shards of `counts` (one per rank), checked against the buffer length and the world
    /// size; `call` names the collective in the error.
    pub(super) fn new(counts: &[usize], len: usize, world: usize, call: &str) -> Result<Self> {
        if counts.len() != world {
            return Err(CommError::InvalidArgument(format!(
                "{call}: {} shard sizes given for a world of {world} ranks (one per rank)",
                counts.len()
            )));
        }
        let offs: Vec<usize> = std::iter::once(0)
            .chain(counts.iter().scan(0usize, |acc, &c| {
                *acc = acc.saturating_add(c);
                Some(*acc)
            }))
            .collect();
        if offs[world] != len {
            return Err(CommError::InvalidArgument(format!(
                "{call}: the shard sizes add up to {} elements but the buffer has {len}",
                offs[world]
            )));
        }
        Ok(Shards { offs })
    }

    /// `len` elements in `world` shards whose sizes differ by at most one (the all-reduce's
    /// split).
    pub(super) fn even(len: usize, world: usize) -> Self {
        Shards {
            offs: (0..=world).map(|c| split_point(len, world, c)).collect(),
        }
    }

    /// The elements of rank `p`'s shard.
    pub(super) fn range(&self, p: usize) -> Range<usize> {
        self.offs[p]..self.offs[p + 1]
    }

    /// The shard boundaries in bytes, for elements of `elem` bytes (`world + 1` values).
    pub(super) fn byte_offsets(&self, elem: usize) -> Vec<usize> {
        self.offs.iter().map(|&o| o * elem).collect()
    }

    /// FNV-1a over the shard sizes, sent in the collective's header so that ranks that pass
    /// different sizes fail with a mismatch instead of exchanging the wrong elements.
    pub(super) fn fingerprint(&self) -> u32 {
        let mut h: u32 = 0x811c_9dc5;
        for w in self.offs.windows(2) {
            for b in ((w[1] - w[0]) as u64).to_le_bytes() {
                h ^= b as u32;
                h = h.wrapping_mul(0x0100_0193);
            }
        }
        h
    }

    /// Rounds of the direct reduce-scatter for elements of `elem` bytes: enough that no
    /// rank's piece exceeds [`PIECE_BYTES`] (at least one).
    pub(super) fn rounds(&self, elem: usize) -> usize {
        let widest = self.offs.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        (widest * elem).div_ceil(PIECE_BYTES).max(1)
    }

    /// Every rank's piece in round `k` of `rounds`: the `k`-th of `rounds` near-equal parts of
    /// its shard, so that every round moves a part of every shard.
    pub(super) fn pieces(&self, rounds: usize, k: usize) -> Vec<Range<usize>> {
        self.offs
            .windows(2)
            .map(|w| {
                let count = w[1] - w[0];
                w[0] + split_point(count, rounds, k)..w[0] + split_point(count, rounds, k + 1)
            })
            .collect()
    }
}

/// Where part `c` of `len` elements split `n` ways starts.
pub(super) fn split_point(len: usize, n: usize, c: usize) -> usize {
    ((len as u128 * c as u128) / n as u128) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked_against_the_buffer_and_the_world() {
        let s = Shards::new(&[3, 0, 5], 8, 3, "reduce_scatter").unwrap();
        assert_eq!([s.range(0), s.range(1), s.range(2)], [0..3, 3..3, 3..8]);
        assert_eq!(s.byte_offsets(4), [0, 12, 12, 32]);
        let e = Shards::new(&[3, 5], 8, 3, "reduce_scatter").unwrap_err();
        assert!(
            e.to_string()
                .contains("2 shard sizes given for a world of 3"),
            "{e}"
        );
        let e = Shards::new(&[3, 0, 4], 8, 3, "all_gather_into").unwrap_err();
        assert!(
            e.to_string()
                .contains("add up to 7 elements but the buffer has 8"),
            "{e}"
        );
        assert!(matches!(e, CommError::InvalidArgument(_)));
    }

    #[test]
    fn even_shards_differ_by_at_most_one() {
        let s = Shards::even(10, 4);
        let sizes: Vec<usize> = (0..4).map(|p| s.range(p).len()).collect();
        assert_eq!(sizes, [2, 3, 2, 3]);
        assert_eq!(Shards::even(0, 3).rounds(4), 1);
    }

    #[test]
    fn the_fingerprint_tells_layouts_apart() {
        let a = Shards::new(&[3, 5], 8, 2, "x").unwrap();
        let b = Shards::new(&[5, 3], 8, 2, "x").unwrap();
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(
            a.fingerprint(),
            Shards::new(&[3, 5], 8, 2, "y").unwrap().fingerprint()
        );
    }

    #[test]
    fn the_pieces_of_all_rounds_tile_every_shard() {
        let counts = [0usize, 1, 2_500_001, 1_048_576, 5];
        let total = counts.iter().sum();
        let s = Shards::new(&counts, total, counts.len(), "x").unwrap();
        let rounds = s.rounds(4);
        assert_eq!(rounds, 3, "2 500 001 f32 values need three 4 MiB pieces");
        let mut next: Vec<usize> = (0..counts.len()).map(|p| s.range(p).start).collect();
        for k in 0..rounds {
            for (p, piece) in s.pieces(rounds, k).into_iter().enumerate() {
                assert_eq!(piece.start, next[p], "rank {p} round {k}");
                assert!(piece.len() * 4 <= PIECE_BYTES);
                next[p] = piece.end;
            }
        }
        for (p, &end) in next.iter().enumerate() {
            assert_eq!(end, s.range(p).end);
        }
    }
}
