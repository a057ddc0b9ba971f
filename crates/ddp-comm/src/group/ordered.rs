//! [`OrderedReduce`]: one piece received from several peers and reduced in rank order as it
//! streams in (the receiving half of the direct reduce-scatter, [`super::direct`]).

use super::ReduceOp;
use super::copy;
use super::link::{Link, ZEROS, link_err, link_of, pad8, skip};
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
    forward: Option<Forward>,
}

/// One term of an ordered reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Term {
    /// This rank's own values (already in the destination).
    Own,
    /// The values a peer sends.
    Peer(usize),
}

/// Where the finished result goes as it is produced, and how much of it (padding included)
/// has gone.
#[derive(Debug, Clone, Copy)]
struct Forward {
    peer: usize,
    sent: usize,
}

impl<'a> OrderedReduce<'a> {
    /// The steps of rank `rank` of `world` for the piece `dst` (`prefix`: `dst.len()` bytes
    /// when `rank >= 2`): the terms of every rank in rank order.
    pub(crate) fn new(
        rank: usize,
        world: usize,
        dst: &'a mut [u8],
        prefix: &'a mut [u8],
        reduce: ReduceFn,
        op: ReduceOp,
        elem: usize,
    ) -> Self {
        let order: Vec<Term> = (0..world)
            .map(|p| if p == rank { Term::Own } else { Term::Peer(p) })
            .collect();
        Self::in_order(&order, dst, prefix, reduce, op, elem)
    }

    /// The steps that reduce `order`'s terms, in that order, into `dst` (which holds this
    /// rank's own term, [`Term::Own`], exactly once in `order`); `prefix` takes the terms
    /// before it (`dst.len()` bytes when there are two or more).
    pub(crate) fn in_order(
        order: &[Term],
        dst: &'a mut [u8],
        prefix: &'a mut [u8],
        reduce: ReduceFn,
        op: ReduceOp,
        elem: usize,
    ) -> Self {
        let own = order
            .iter()
            .position(|t| *t == Term::Own)
            .expect("the order holds this rank's own term");
        let peer_of = |t: &Term| match t {
            Term::Peer(p) => *p,
            Term::Own => unreachable!("this rank's own term is in the order once"),
        };
        let pad_left = pad8(dst.len());
        let peer = |p: usize, into_prefix: bool, copy: bool| Step {
            from: Source::Peer(p),
            into_prefix,
            copy,
            done: 0,
            pad_left,
        };
        let mut steps = Vec::with_capacity(order.len());
        if own >= 2 {
            steps.push(peer(peer_of(&order[0]), true, true));
            steps.extend(order[1..own].iter().map(|t| peer(peer_of(t), true, false)));
            steps.push(Step {
                from: Source::Prefix,
                into_prefix: false,
                copy: false,
                done: 0,
                pad_left: 0,
            });
        } else if own == 1 {
            steps.push(peer(peer_of(&order[0]), false, false));
        }
        steps.extend(
            order[own + 1..]
                .iter()
                .map(|t| peer(peer_of(t), false, false)),
        );
        OrderedReduce {
            dst,
            prefix,
            steps,
            reduce,
            op,
            elem,
            forward: None,
        }
    }

    /// Also sends every finished byte of the result to `peer` as soon as it is final (the
    /// chain of nodes passes partial sums on while they are being summed).
    pub(crate) fn forwarding_to(mut self, peer: usize) -> Self {
        self.forward = Some(Forward { peer, sent: 0 });
        self
    }

    /// Bytes of `dst` that hold their final value.
    fn final_bytes(&self) -> usize {
        self.steps.last().map_or(self.dst.len(), |s| s.done)
    }

    pub(crate) fn finished(&self) -> bool {
        let len = self.dst.len();
        self.steps.iter().all(|s| s.done == len && s.pad_left == 0)
            && self.forward.is_none_or(|f| f.sent == len + pad8(len))
    }

    /// The peer of the first unfinished step (it waits on nothing but that peer's data), and
    /// the peer of the forward when it has finished bytes it could not send yet.
    pub(crate) fn waits_on(&self) -> (Option<usize>, Option<usize>) {
        let len = self.dst.len();
        let recv = self
            .steps
            .iter()
            .find(|s| s.done < len || s.pad_left > 0)
            .and_then(|s| match s.from {
                Source::Peer(p) => Some(p),
                Source::Prefix => None,
            });
        let ready = self.final_bytes();
        let send = self.forward.and_then(|f| {
            let wire = if ready == len { len + pad8(len) } else { ready };
            (f.sent < wire).then_some(f.peer)
        });
        (recv, send)
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
        let ready = self.final_bytes();
        if let Some(f) = &mut self.forward {
            let wire = len + pad8(len);
            let link = link_of(links, f.peer);
            let n = if f.sent < ready {
                link.send_some(&self.dst[f.sent..ready])
            } else if ready == len && f.sent < wire {
                link.send_some(&ZEROS[..wire - f.sent])
            } else {
                Ok(0)
            }
            .map_err(|e| link_err(e, f.peer, what))?;
            f.sent += n;
            moved += n;
        }
        Ok(moved)
    }
}
