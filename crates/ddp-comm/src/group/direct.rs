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
use super::engine::{Op, ReduceFn, Waiting, drive, link_err, link_of, pad8, skip};
use super::link::Link;
use super::shards::Shards;
use super::{Element, Mesh, ReduceOp, copy, element};
use crate::error::{CommError, Result};

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

/// Where a step of an [`OrderedReduce`] reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Peer(usize),
    /// The prefix sum `x0 + … + x(r-1)`.
    Prefix,
}

/// One term of an [`OrderedReduce`]: `into` (the prefix sum or this rank's piece) takes
/// `from`'s bytes, copied or reduced, never ahead of the step before it.
#[derive(Debug, Clone, Copy)]
struct Step {
    from: Source,
    into_prefix: bool,
    copy: bool,
    /// Bytes of the piece done.
    done: usize,
    /// Padding bytes of the peer's message still to skip.
    pad_left: usize,
}

/// Receives this rank's piece from every peer and reduces it **in rank order** as it streams
/// in, straight from the links (no staging copy where the link is shared memory).
///
/// The order is `x0 + x1 + … + x(n-1)`. Rank 0 adds `x1`, `x2`, … to its own values; rank 1
/// adds `x0` to its own (`x1 + x0` and `x0 + x1` are the same bits) then `x2`, …; a later rank
/// `r` sums `x0 + … + x(r-1)` into a prefix area, adds that to its own values, then `x(r+1)`,
/// …. Every step may run only up to the byte the step before it has reached, so all peers
/// stream at once while each element still sees its terms in order.
pub(crate) struct OrderedReduce<'a> {
    dst: &'a mut [u8],
    prefix: &'a mut [u8],
    steps: Vec<Step>,
    reduce: ReduceFn,
    op: ReduceOp,
    elem: usize,
}

impl<'a> OrderedReduce<'a> {
    /// The steps of rank `rank` of `world` for the piece `dst` (`prefix`: `dst.len()` bytes
    /// when `rank >= 2`).
    fn new(
        rank: usize,
        world: usize,
        dst: &'a mut [u8],
        prefix: &'a mut [u8],
        reduce: ReduceFn,
        op: ReduceOp,
        elem: usize,
    ) -> Self {
        let pad_left = pad8(dst.len());
        let peer = |p: usize, into_prefix: bool, copy: bool| Step {
            from: Source::Peer(p),
            into_prefix,
            copy,
            done: 0,
            pad_left,
        };
        let mut steps = Vec::with_capacity(world);
        if rank >= 2 {
            steps.push(peer(0, true, true));
            steps.extend((1..rank).map(|p| peer(p, true, false)));
            steps.push(Step {
                from: Source::Prefix,
                into_prefix: false,
                copy: false,
                done: 0,
                pad_left: 0,
            });
        } else if rank == 1 {
            steps.push(peer(0, false, false));
        }
        steps.extend((rank + 1..world).map(|p| peer(p, false, false)));
        OrderedReduce {
            dst,
            prefix,
            steps,
            reduce,
            op,
            elem,
        }
    }

    pub(crate) fn finished(&self) -> bool {
        let len = self.dst.len();
        self.steps.iter().all(|s| s.done == len && s.pad_left == 0)
    }

    /// The peer of the first unfinished step (it waits on nothing but that peer's data).
    pub(crate) fn waits_on(&self) -> Option<usize> {
        let len = self.dst.len();
        self.steps
            .iter()
            .find(|s| s.done < len || s.pad_left > 0)
            .and_then(|s| match s.from {
                Source::Peer(p) => Some(p),
                Source::Prefix => None,
            })
    }

    pub(crate) fn progress(
        &mut self,
        links: &mut [Option<Link>],
        what: &str,
    ) -> std::result::Result<usize, CommError> {
        let len = self.dst.len();
        let mut moved = 0;
        // How far the step before may have reached: the first step is bounded by the piece.
        let mut limit = len;
        for step in &mut self.steps {
            if step.done < limit {
                let at = step.done;
                match step.from {
                    Source::Prefix => {
                        (self.reduce)(&mut self.dst[at..limit], &self.prefix[at..limit], self.op);
                        moved += limit - at;
                        step.done = limit;
                    }
                    Source::Peer(p) => {
                        let link = link_of(links, p);
                        let a = link
                            .readable(self.elem, limit - at)
                            .map_err(|e| link_err(e, p, what))?;
                        let a = a - a % self.elem;
                        if a > 0 {
                            let into = if step.into_prefix {
                                &mut self.prefix[at..at + a]
                            } else {
                                &mut self.dst[at..at + a]
                            };
                            if step.copy {
                                copy::copy(into, link.peek(a));
                            } else {
                                (self.reduce)(into, link.peek(a), self.op);
                            }
                            link.consume(a);
                            step.done += a;
                            moved += a;
                        }
                    }
                }
            }
            if let Source::Peer(p) = step.from
                && step.done == len
                && step.pad_left > 0
            {
                let k = skip(link_of(links, p), step.pad_left).map_err(|e| link_err(e, p, what))?;
                step.pad_left -= k;
                moved += k;
            }
            limit = step.done;
        }
        Ok(moved)
    }
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
