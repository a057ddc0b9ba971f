//! [`OrderedReduce`]: one piece received from several peers and reduced in rank order as it
//! streams in (the receiving half of the direct reduce-scatter, [`super::direct`]).

use super::ReduceOp;
use super::copy;
use super::link::{Link, link_err, link_of, pad8, skip};
use crate::error::CommError;

/// A reduction of raw received bytes into a byte view of a typed buffer.
pub(crate) type ReduceFn = fn(&mut [u8], &[u8], ReduceOp);

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
    pub(crate) fn new(
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
