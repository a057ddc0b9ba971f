//! The direct reduce-scatter behind every large reduction: each rank sends every other rank
//! that rank's piece of its buffer, receives its own piece from everyone, and adds the `n`
//! contributions **in rank order** (`x0 + x1 + … + x(n-1)`).
//!
//! A rank sends and receives `(n-1)/n` of the buffer, as in a ring reduce-scatter, but the
//! order of the additions no longer depends on which rank reduces an element: the all-reduce,
//! its small inline path, [`ProcessGroup::reduce_scatter`] with any shard sizes and the
//! compressed variants all give every element the same bits. That is what lets a sharded
//! optimizer (ZeRO stage 1) reduce-scatter gradients to their owners and still train bitwise
//! as the all-reduce does.
//!
//! Each rank's piece is reduced as it streams in, straight from the links ([`OrderedReduce`]),
//! so it costs what a ring's reduce-scatter costs. The shards are cut into rounds
//! ([`Shards::pieces`]) of at most [`super::shards::PIECE_BYTES`] per rank, which bounds the
//! staging memory.

use std::ops::Range;

use super::compression::{self, Half};
use super::engine::{Op, Waiting, drive};
use super::ordered::OrderedReduce;
use super::shards::Shards;
use super::{Element, Mesh, ReduceOp, element};
use crate::error::Result;

#[cfg(doc)]
use super::ProcessGroup;

/// Who this rank is and how it waits, shared by the rounds of one collective.
pub(super) struct Round<'a> {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) wait: &'a Waiting,
    pub(super) what: &'a str,
}

/// Reduces every shard of `buf` onto its rank (after the header exchange): on return this
/// rank's shard holds the reduction, in rank order, of all ranks' values of it (divided by the
/// world size for a mean); the rest of `buf` is unchanged.
pub(super) fn reduce_scatter<T: Element>(
    mesh: &mut Mesh,
    round: &Round<'_>,
    buf: &mut [T],
    shards: &Shards,
    op: ReduceOp,
) -> Result<()> {
    let rounds = shards.rounds(std::mem::size_of::<T>());
    for k in 0..rounds {
        reduce_round(mesh, round, buf, &shards.pieces(rounds, k), op)?;
    }
    Ok(())
}

/// One round: `pieces[p]` (element ranges of `buf`) to rank `p`, this rank's piece reduced as
/// it streams in ([`OrderedReduce`]).
fn reduce_round<T: Element>(
    mesh: &mut Mesh,
    round: &Round<'_>,
    buf: &mut [T],
    pieces: &[Range<usize>],
    op: ReduceOp,
) -> Result<()> {
    let (r, n) = (round.rank, round.world);
    let sz = std::mem::size_of::<T>();
    let mine = bytes_of(&pieces[r], sz);
    let Mesh { links, stage, .. } = mesh;
    // x0 + … + x(r-1) is summed here when this rank is neither the first nor the second.
    let prefix_len = if r >= 2 { mine.len() } else { 0 };
    stage.resize(prefix_len.div_ceil(8), 0);
    let prefix: &mut [u8] = &mut bytemuck::cast_slice_mut(stage)[..prefix_len];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
    let (before, rest) = bytes.split_at_mut(mine.start);
    let (dst, after) = rest.split_at_mut(mine.len());
    let mut ops: Vec<Op<'_>> = Vec::with_capacity(n);
    for (p, piece) in pieces.iter().enumerate().filter(|&(p, _)| p != r) {
        let at = bytes_of(piece, sz);
        // Pieces never overlap: another rank's piece lies wholly before or after ours.
        let data: &[u8] = if at.end <= mine.start {
            &before[at]
        } else {
            &after[at.start - mine.end..at.end - mine.end]
        };
        ops.push(Op::Send {
            peer: p,
            hdr: None,
            data,
            done: 0,
        });
    }
    let dst_len = dst.len();
    ops.push(Op::Ordered(OrderedReduce::new(
        r,
        n,
        dst,
        prefix,
        element::reduce_bytes::<T>,
        op,
        sz,
    )));
    drive(links, &mut ops, round.wait, round.what)?;
    drop(ops);
    if op == ReduceOp::Mean {
        let mine = &mut buf[pieces[r].clone()];
        debug_assert_eq!(std::mem::size_of_val(mine), dst_len);
        element::divide(mine, n);
    }
    Ok(())
}

/// One round of the 16-bit reduce-scatter: every piece travels rounded to `h`; this rank
/// adds the `n` rounded contributions of its piece (its own rounded too) in rank order into
/// f32 accumulators, divides by `div` for a mean and rounds the result once. The rounded
/// result goes to `mesh.half` at this rank's place in the pieces' wire layout (their 16-bit
/// images side by side in rank order: for the even pieces of a contiguous segment, the
/// segment's own layout), its decoded value into `buf`.
pub(super) fn reduce_round_half(
    mesh: &mut Mesh,
    round: &Round<'_>,
    buf: &mut [f32],
    pieces: &[Range<usize>],
    h: Half,
    div: Option<usize>,
) -> Result<()> {
    let (r, n) = (round.rank, round.world);
    let wire_at: Vec<usize> = std::iter::once(0)
        .chain(pieces.iter().scan(0, |acc, p| {
            *acc += 2 * p.len();
            Some(*acc)
        }))
        .collect();
    let each = 2 * pieces[r].len();
    let Mesh {
        links,
        scratch,
        half: wire,
        ..
    } = mesh;
    wire.resize(wire_at[n], 0);
    scratch.resize(each * n, 0);
    for (p, piece) in pieces.iter().enumerate() {
        let src = &buf[piece.clone()];
        if p == r {
            compression::encode(h, src, &mut scratch[r * each..(r + 1) * each]);
        } else {
            compression::encode(h, src, &mut wire[wire_at[p]..wire_at[p + 1]]);
        }
    }
    {
        let mut ops: Vec<Op<'_>> = Vec::with_capacity(2 * (n - 1));
        for (p, slot) in slots_mut(scratch, each, n).into_iter().enumerate() {
            if p == r {
                continue;
            }
            ops.push(Op::Send {
                peer: p,
                hdr: None,
                data: &wire[wire_at[p]..wire_at[p + 1]],
                done: 0,
            });
            ops.push(Op::Recv {
                peer: p,
                dst: slot,
                done: 0,
            });
        }
        drive(links, &mut ops, round.wait, round.what)?;
    }
    let terms: Vec<&[u8]> = (0..n).map(|p| &scratch[p * each..(p + 1) * each]).collect();
    compression::reduce_chunk(
        h,
        &mut buf[pieces[r].clone()],
        &terms,
        div,
        &mut wire[wire_at[r]..wire_at[r + 1]],
    );
    Ok(())
}

/// The `n` staging slots of `each` bytes at the start of `scratch` (empty slices when
/// `each` is 0).
fn slots_mut(scratch: &mut [u8], each: usize, n: usize) -> Vec<&mut [u8]> {
    let mut rest = &mut scratch[..each * n];
    (0..n)
        .map(|_| {
            let (slot, tail) = std::mem::take(&mut rest).split_at_mut(each);
            rest = tail;
            slot
        })
        .collect()
}

/// The byte range of the elements `r`, for elements of `sz` bytes.
pub(super) fn bytes_of(r: &Range<usize>, sz: usize) -> Range<usize> {
    r.start * sz..r.end * sz
}
