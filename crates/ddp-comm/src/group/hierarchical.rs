//! The node-aware all-reduce: what stays inside a host goes through shared memory, and what
//! crosses the network is one partial sum per element per node boundary, every element still
//! summed **in rank order** (`x0 + x1 + … + x(N−1)`, bitwise the flat all-reduce's result).
//!
//! The flat algorithm ([`super::direct`] then a ring all-gather) sends each rank's raw values
//! straight to the rank that reduces them, so the bytes a node sends across grow with its ranks
//! (`S·L·(k−1)/k` for the reduce-scatter alone, `L` ranks per node, `k` nodes). A ring that
//! reduces across nodes would send less but adds in an order that depends on where the ring
//! starts. This one keeps the order with **a chain of nodes**:
//!
//! 1. **Chain reduce.** The buffer is split into `C` channels (`C` = the fewest ranks any node
//!    has); node `j`'s local rank `c` owns channel `c`. The node's other ranks send it their
//!    raw values of that channel over shared memory; it adds, in rank order, the partial sum of
//!    the nodes before (from channel `c`'s owner on node `j − 1`) and its node's values
//!    ([`OrderedReduce`]), and passes every finished byte on to the owner on node `j + 1` while
//!    it is still summing the rest. The channels' chains run side by side, each over its own
//!    pair of ranks per node boundary, so every rank with a channel carries `1/C` of the
//!    buffer across. The rounds of [`Shards::pieces`] bound the staging memory.
//! 2. **Result across.** The last node holds the result; channel `c` goes to the other nodes
//!    along the chain `k−1 → c → c+1 → …` (node indices modulo `k − 1`), each owner relaying
//!    the bytes as they arrive, so the forwarding is spread over the nodes.
//! 3. **Result inside.** Each owner sends its channel to its node's other ranks over shared
//!    memory.
//!
//! Bytes a node sends across, per all-reduce of `S` bytes: `S` of partial sums (every node but
//! the last) plus its share of the forwarding, `S·(k−2)/(k−1)` (the last node sends the `S` of
//! the result and no partial sums). That is `S` for two nodes, the bound `2·S·(k−1)/k` of any
//! all-reduce; for more nodes the average over the nodes is that bound and the busiest node
//! sends `S·(2k−3)/(k−1)` (1.125 × the bound for 3 nodes, 1.11 × for 4), the least any scheme
//! can give that finishes every element's sum on the last node in rank order — the price of
//! bitwise results independent of the layout.

use std::ops::Range;

use super::compression::{self, Half};
use super::direct::{Round, bytes_of};
use super::engine::{Op, drive};
use super::nodes::Nodes;
use super::ordered::{OrderedReduce, Term};
use super::shards::Shards;
use super::{Element, Mesh, ReduceOp, element};
use crate::error::Result;

/// The node-aware all-reduce of `buf` (after the header exchange): on return every rank's
/// `buf` holds the rank-order reduction of all ranks' values (divided by the world size for a
/// mean).
pub(super) fn all_reduce<T: Element>(
    mesh: &mut Mesh,
    round: &Round<'_>,
    nodes: &Nodes,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let sz = std::mem::size_of::<T>();
    let me = Place::of(round.rank, nodes);
    let channels = chain_reduce(mesh, round, nodes, &me, buf, op)?;
    let channel_bytes: Vec<Range<usize>> = (0..nodes.channels())
        .map(|c| bytes_of(&channels.range(c), sz))
        .collect();
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
    let chain = Chain {
        round,
        nodes,
        me: &me,
    };
    chain.result_across(mesh, bytes, &channel_bytes)?;
    chain.result_inside(mesh, bytes, &channel_bytes)
}

/// The node-aware compressed all-reduce of `buf`, f32 values that travel as `h` (after the
/// header exchange; taken where [`Nodes::compressed_chain_pays`]): bitwise the flat
/// compressed all-reduce's result, whose arithmetic is every contribution rounded to 16 bits,
/// the `n` of them added in rank order in f32 and the result (divided by `n` for a mean)
/// rounded to 16 bits once.
///
/// So: every rank rounds its values to `h` first; the chain reduce adds them in rank order in
/// f32, as for a plain all-reduce (the partial sums cross nodes in f32: rounding them would
/// round more than once); the last node rounds each channel's result to `h` once, and the
/// result crosses nodes and reaches each node's ranks as 16-bit values. `wire` is scratch
/// space for those (two bytes per value).
pub(super) fn all_reduce_compressed(
    mesh: &mut Mesh,
    round: &Round<'_>,
    nodes: &Nodes,
    buf: &mut [f32],
    op: ReduceOp,
    h: Half,
    wire: &mut Vec<u8>,
) -> Result<()> {
    wire.resize(2 * buf.len(), 0);
    // Each contribution rounded to the format, as the flat path encodes it.
    compression::encode(h, buf, wire);
    compression::decode(h, wire, buf);
    let me = Place::of(round.rank, nodes);
    let channels = chain_reduce(mesh, round, nodes, &me, buf, op)?;
    if let Some(c) = me.channel
        && me.node + 1 == nodes.count()
    {
        // The one rounding of the result.
        let range = channels.range(c);
        compression::encode(h, &buf[range.clone()], &mut wire[bytes_of(&range, 2)]);
    }
    let channel_bytes: Vec<Range<usize>> = (0..nodes.channels())
        .map(|c| bytes_of(&channels.range(c), 2))
        .collect();
    let chain = Chain {
        round,
        nodes,
        me: &me,
    };
    chain.result_across(mesh, wire, &channel_bytes)?;
    chain.result_inside(mesh, wire, &channel_bytes)?;
    compression::decode(h, wire, buf);
    Ok(())
}

/// The node-aware reduce-scatter of `buf` into `shards` (after the header exchange; taken
/// where [`Nodes::reduce_scatter_chain_pays`]): the chain reduce of [`all_reduce`], every
/// element summed in rank order (so each shard is bitwise the flat reduce-scatter's), then
/// each channel's finished values go from their owner on the last node straight to the ranks
/// whose shards they fall in. A node sends across one buffer of partial sums per boundary, and
/// the last node the other nodes' shards, where the flat reduce-scatter sends every rank's
/// pieces for every rank on the other nodes.
pub(super) fn reduce_scatter<T: Element>(
    mesh: &mut Mesh,
    round: &Round<'_>,
    nodes: &Nodes,
    buf: &mut [T],
    shards: &Shards,
    op: ReduceOp,
) -> Result<()> {
    let sz = std::mem::size_of::<T>();
    let me = Place::of(round.rank, nodes);
    let channels = chain_reduce(mesh, round, nodes, &me, buf, op)?;
    let last = nodes.count() - 1;
    // Every (channel, shard) overlap whose owner on the last node is not the shard's rank is
    // one message. What this rank sends lies in its channel outside its shard, what it
    // receives in its shard outside its channel: disjoint ranges of `buf`.
    let mut moves: Vec<(Range<usize>, bool, usize)> = Vec::new();
    for c in 0..nodes.channels() {
        let owner = nodes.owner(last, c);
        let chan = channels.range(c);
        for p in (0..round.world).filter(|&p| p != owner) {
            let shard = shards.range(p);
            let overlap = chan.start.max(shard.start)..chan.end.min(shard.end);
            if overlap.is_empty() {
                continue;
            }
            if owner == round.rank {
                moves.push((bytes_of(&overlap, sz), true, p));
            } else if p == round.rank {
                moves.push((bytes_of(&overlap, sz), false, owner));
            }
        }
    }
    moves.sort_by_key(|(r, _, _)| r.start);
    let ranges: Vec<Range<usize>> = moves.iter().map(|(r, _, _)| r.clone()).collect();
    let parts = split_mut(bytemuck::cast_slice_mut(buf), &ranges);
    let mut ops: Vec<Op<'_>> = moves
        .iter()
        .zip(parts)
        .map(|(&(_, send, peer), part)| {
            if send {
                Op::Send {
                    peer,
                    hdr: None,
                    data: part,
                    done: 0,
                }
            } else {
                Op::Recv {
                    peer,
                    dst: part,
                    done: 0,
                }
            }
        })
        .collect();
    drive(&mut mesh.links, &mut ops, round.wait, round.what)
}

/// Phase 1, the chain reduce of every channel, round by round: afterwards each channel's owner
/// on the last node holds the channel's rank-order reduction (divided by the world size for a
/// mean). Returns the channels.
fn chain_reduce<T: Element>(
    mesh: &mut Mesh,
    round: &Round<'_>,
    nodes: &Nodes,
    me: &Place,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<Shards> {
    let channels = Shards::even(buf.len(), nodes.channels());
    let rounds = channels.rounds(std::mem::size_of::<T>());
    for t in 0..rounds {
        let pieces = channels.pieces(rounds, t);
        chain_round::<T>(mesh, round, nodes, me, buf, &pieces, op)?;
    }
    if let Some(c) = me.channel
        && me.node + 1 == nodes.count()
        && op == ReduceOp::Mean
    {
        element::divide(&mut buf[channels.range(c)], round.world);
    }
    Ok(channels)
}

/// What the phases after the chain reduce share: the collective, the layout and this rank's
/// place in it.
struct Chain<'a> {
    round: &'a Round<'a>,
    nodes: &'a Nodes,
    me: &'a Place,
}

/// Where this rank sits: its node and the channel it owns (if any).
struct Place {
    rank: usize,
    node: usize,
    channel: Option<usize>,
}

impl Place {
    fn of(rank: usize, nodes: &Nodes) -> Self {
        let node = nodes.node_of(rank);
        let local = rank - nodes.ranks(node).start;
        Place {
            rank,
            node,
            channel: (local < nodes.channels()).then_some(local),
        }
    }
}

/// One round of the chain: this rank's values of every channel it does not own go to that
/// channel's owner on this node; the channel it owns is reduced in rank order as the terms
/// stream in and passed on to the next node's owner.
fn chain_round<T: Element>(
    mesh: &mut Mesh,
    round: &Round<'_>,
    nodes: &Nodes,
    me: &Place,
    buf: &mut [T],
    pieces: &[Range<usize>],
    op: ReduceOp,
) -> Result<()> {
    let sz = std::mem::size_of::<T>();
    let ranges: Vec<Range<usize>> = pieces.iter().map(|p| bytes_of(p, sz)).collect();
    let Mesh { links, stage, .. } = mesh;
    let mut ops: Vec<Op<'_>> = Vec::with_capacity(ranges.len() + 1);
    let mut owned = None;
    for (c, part) in split_mut(bytemuck::cast_slice_mut(buf), &ranges)
        .into_iter()
        .enumerate()
    {
        if me.channel == Some(c) {
            owned = Some(part);
        } else {
            ops.push(Op::Send {
                peer: nodes.owner(me.node, c),
                hdr: None,
                data: part,
                done: 0,
            });
        }
    }
    if let (Some(c), Some(dst)) = (me.channel, owned) {
        let mut order = Vec::with_capacity(nodes.ranks(me.node).len() + 1);
        if me.node > 0 {
            order.push(Term::Peer(nodes.owner(me.node - 1, c)));
        }
        order.extend(nodes.ranks(me.node).map(|p| {
            if p == me.rank {
                Term::Own
            } else {
                Term::Peer(p)
            }
        }));
        let own_at = order.iter().position(|t| *t == Term::Own).unwrap_or(0);
        let prefix_len = if own_at >= 2 { dst.len() } else { 0 };
        stage.resize(prefix_len.div_ceil(8), 0);
        let prefix: &mut [u8] = &mut bytemuck::cast_slice_mut(stage)[..prefix_len];
        let mut reduce =
            OrderedReduce::in_order(&order, dst, prefix, element::reduce_bytes::<T>, op, sz);
        if me.node + 1 < nodes.count() {
            reduce = reduce.forwarding_to(nodes.owner(me.node + 1, c));
        }
        ops.push(Op::Ordered(reduce));
    }
    drive(links, &mut ops, round.wait, round.what)
}

/// The nodes channel `c`'s result visits after the last node, in order: `c, c+1, …` modulo
/// `k − 1`, so that each node is the chain's end (and forwards nothing) for some channels.
fn visit_order(c: usize, k: usize) -> Vec<usize> {
    std::iter::once(k - 1)
        .chain((0..k - 1).map(|i| (c + i) % (k - 1)))
        .collect()
}

impl Chain<'_> {
    /// Phase 2: each channel's result from its owner on the last node to its owners on the
    /// others, relayed along [`visit_order`].
    fn result_across(
        &self,
        mesh: &mut Mesh,
        bytes: &mut [u8],
        channels: &[Range<usize>],
    ) -> Result<()> {
        let Chain { round, nodes, me } = self;
        let Some(c) = me.channel else {
            return Ok(());
        };
        let order = visit_order(c, nodes.count());
        let at = order
            .iter()
            .position(|&j| j == me.node)
            .expect("every node is on the chain");
        let owner = |i: usize| order.get(i).map(|&j| nodes.owner(j, c));
        let buf = &mut bytes[channels[c].clone()];
        let op = match (at.checked_sub(1).and_then(owner), owner(at + 1)) {
            (None, Some(next)) => Op::Send {
                peer: next,
                hdr: None,
                data: buf,
                done: 0,
            },
            (Some(prev), Some(next)) => Op::Relay {
                from: prev,
                to: next,
                buf,
                got: 0,
                sent: 0,
            },
            (Some(prev), None) => Op::Recv {
                peer: prev,
                dst: buf,
                done: 0,
            },
            (None, None) => return Ok(()),
        };
        drive(&mut mesh.links, &mut [op], round.wait, round.what)
    }

    /// Phase 3: every channel from its owner on this node to the node's other ranks.
    fn result_inside(
        &self,
        mesh: &mut Mesh,
        bytes: &mut [u8],
        channels: &[Range<usize>],
    ) -> Result<()> {
        let Chain { round, nodes, me } = self;
        let local = nodes.ranks(me.node);
        if local.len() < 2 {
            return Ok(());
        }
        let mut ops: Vec<Op<'_>> = Vec::with_capacity(2 * local.len());
        for (c, part) in split_mut(bytes, channels).into_iter().enumerate() {
            if me.channel == Some(c) {
                let data: &[u8] = part;
                ops.extend(local.clone().filter(|&p| p != me.rank).map(|p| Op::Send {
                    peer: p,
                    hdr: None,
                    data,
                    done: 0,
                }));
            } else {
                ops.push(Op::Recv {
                    peer: nodes.owner(me.node, c),
                    dst: part,
                    done: 0,
                });
            }
        }
        drive(&mut mesh.links, &mut ops, round.wait, round.what)
    }
}

/// `bytes` cut at `ranges` (in increasing order, not overlapping): one slice per range.
fn split_mut<'b>(mut rest: &'b mut [u8], ranges: &[Range<usize>]) -> Vec<&'b mut [u8]> {
    let mut at = 0;
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (part, tail) = tail.split_at_mut(r.len());
        parts.push(part);
        rest = tail;
        at = r.end;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_node_gets_each_result_once_and_ends_some_chains() {
        for k in 2..6 {
            let mut ends = vec![0; k];
            for c in 0..(k - 1) {
                let order = visit_order(c, k);
                let mut seen = order.clone();
                seen.sort_unstable();
                assert_eq!(seen, (0..k).collect::<Vec<_>>(), "k {k} c {c}");
                ends[*order.last().unwrap()] += 1;
            }
            assert_eq!(ends[k - 1], 0, "the last node only sends");
            assert!(ends[..k - 1].iter().all(|&e| e == 1), "k {k}: {ends:?}");
        }
    }

    #[test]
    fn split_mut_cuts_at_the_ranges() {
        let mut b: Vec<u8> = (0..10).collect();
        let parts = split_mut(&mut b, &[1..3, 3..3, 5..10]);
        assert_eq!(parts.len(), 3);
        assert_eq!(&*parts[0], &[1, 2]);
        assert!(parts[1].is_empty());
        assert_eq!(&*parts[2], &[5, 6, 7, 8, 9]);
    }
}
