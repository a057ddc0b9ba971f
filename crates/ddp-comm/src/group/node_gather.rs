//! The node-aware all-gather of shards ([`super::ProcessGroup::all_gather_into`] across hosts
//! with several ranks each): what crosses the network is each node's block once per other
//! node, `S·(k−1)/k` per node for even shards (`k` nodes), where the flat ring sends
//! `S·(N−1)/N` across every node boundary whatever the ranks per node (7/8 S at 2 × 4 against
//! 1/2 S).
//!
//! Node `j`'s **block** is its ranks' shards, contiguous in the buffer. It is cut into `C`
//! **pieces** (`C` = the fewest ranks any node has, as the node-aware all-reduce's channels),
//! and piece `c` travels to the other nodes through their local rank `c`, its **owner**
//! there:
//!
//! 1. **Across, and the own node's shards.** Every rank sends the part of its shard that falls
//!    in piece `c` of its block to piece `c`'s owner on every other node, and its whole shard
//!    to its own node's other ranks (shared memory). Every pair of ranks exchanges at most
//!    one message, so all of it is one round.
//! 2. **Inside.** For each other node in turn, every owner sends the piece it received to its
//!    node's other ranks.
//!
//! Nothing is added, so the result is the flat all-gather's, byte for byte. A shard that
//! travelled in the call's header (a small one) is already everywhere and is not sent again.

use std::ops::Range;

use super::Mesh;
use super::direct::Round;
use super::engine::{Op, drive};
use super::nodes::Nodes;
use super::shards::Shards;
use crate::error::Result;

/// The node-aware all-gather of `buf` (after the header exchange): rank `p`'s shard is
/// `buf[offs[p]..offs[p + 1]]` (bytes); `inline[p]` says it came with the header and every
/// rank has it already. On return every rank's `buf` holds every shard.
pub(super) fn all_gather_into(
    mesh: &mut Mesh,
    round: &Round<'_>,
    nodes: &Nodes,
    buf: &mut [u8],
    offs: &[usize],
    inline: &[bool],
) -> Result<()> {
    let layout = Layout {
        nodes,
        offs,
        inline,
    };
    let me = round.rank;
    let home = nodes.node_of(me);
    exchange(mesh, round, buf, &layout.across_and_home(me))?;
    let k = nodes.count();
    for t in 1..k {
        let from = (home + t) % k;
        exchange(mesh, round, buf, &layout.inside(me, from))?;
    }
    Ok(())
}

/// The shards and the node layout.
struct Layout<'a> {
    nodes: &'a Nodes,
    offs: &'a [usize],
    inline: &'a [bool],
}

/// One message of a round: `range` of the buffer goes from `from` to `to`.
struct Message {
    range: Range<usize>,
    from: usize,
    to: usize,
}

impl Layout<'_> {
    fn shard(&self, p: usize) -> Range<usize> {
        self.offs[p]..self.offs[p + 1]
    }

    /// Piece `c` of node `j`'s block.
    fn piece(&self, j: usize, c: usize) -> Range<usize> {
        let ranks = self.nodes.ranks(j);
        let block = self.offs[ranks.start]..self.offs[ranks.end];
        let r = Shards::even(block.len(), self.nodes.channels()).range(c);
        block.start + r.start..block.start + r.end
    }

    /// Round 1's messages to or from `me`: every rank's share of each piece of its block to
    /// that piece's owners on the other nodes, and its shard to its own node's other ranks.
    fn across_and_home(&self, me: usize) -> Vec<Message> {
        let nodes = self.nodes;
        let mut out = Vec::new();
        for j in 0..nodes.count() {
            for p in nodes.ranks(j).filter(|&p| !self.inline[p]) {
                let shard = self.shard(p);
                for q in nodes.ranks(j).filter(|&q| q != p) {
                    out.push(Message {
                        range: shard.clone(),
                        from: p,
                        to: q,
                    });
                }
                for c in 0..nodes.channels() {
                    let piece = self.piece(j, c);
                    let part = shard.start.max(piece.start)..shard.end.min(piece.end);
                    if part.is_empty() {
                        continue;
                    }
                    for m in (0..nodes.count()).filter(|&m| m != j) {
                        out.push(Message {
                            range: part.clone(),
                            from: p,
                            to: nodes.owner(m, c),
                        });
                    }
                }
            }
        }
        out.retain(|m| (m.from == me || m.to == me) && !m.range.is_empty());
        out
    }

    /// Round 2's messages on `me`'s node for node `from`'s block: each owner's piece to the
    /// node's other ranks.
    fn inside(&self, me: usize, from: usize) -> Vec<Message> {
        let nodes = self.nodes;
        let home = nodes.node_of(me);
        let mut out = Vec::new();
        for c in 0..nodes.channels() {
            let owner = nodes.owner(home, c);
            let piece = self.piece(from, c);
            for q in nodes.ranks(home).filter(|&q| q != owner) {
                out.push(Message {
                    range: piece.clone(),
                    from: owner,
                    to: q,
                });
            }
        }
        out.retain(|m| (m.from == me || m.to == me) && !m.range.is_empty());
        out
    }
}

/// Runs `messages` (each to or from this rank, at most one per peer and direction) as one
/// round on `buf`. The ranges this rank receives are disjoint, and what it sends lies outside
/// them (sent ranges may overlap: its shard to its node, parts of it across).
fn exchange(
    mesh: &mut Mesh,
    round: &Round<'_>,
    buf: &mut [u8],
    messages: &[Message],
) -> Result<()> {
    let mut receives: Vec<&Message> = messages.iter().filter(|m| m.to == round.rank).collect();
    receives.sort_by_key(|m| m.range.start);
    let mut ops: Vec<Op<'_>> = Vec::with_capacity(messages.len());
    // The bytes between the received ranges, read-only, with where each starts.
    let mut gaps: Vec<(usize, &[u8])> = Vec::with_capacity(receives.len() + 1);
    let (mut rest, mut at) = (buf, 0);
    for m in receives {
        let (gap, tail) = std::mem::take(&mut rest).split_at_mut(m.range.start - at);
        let (dst, tail) = tail.split_at_mut(m.range.len());
        gaps.push((at, gap));
        ops.push(Op::Recv {
            peer: m.from,
            dst,
            done: 0,
        });
        rest = tail;
        at = m.range.end;
    }
    gaps.push((at, rest));
    for m in messages.iter().filter(|m| m.from == round.rank) {
        let (start, gap) = gaps
            .iter()
            .find(|(start, gap)| *start <= m.range.start && m.range.end <= start + gap.len())
            .expect("a rank sends only bytes it does not receive in the same round");
        ops.push(Op::Send {
            peer: m.to,
            hdr: None,
            data: &gap[m.range.start - start..m.range.end - start],
            done: 0,
        });
    }
    drive(&mut mesh.links, &mut ops, round.wait, round.what)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank ends with every byte: what it holds, what it receives, once each, and each
    /// message received is sent by its sender (the two sides agree), in rounds where no rank
    /// sends two messages to one peer.
    #[test]
    fn every_byte_reaches_every_rank_once() {
        for sizes in [&[2, 2][..], &[4, 4], &[3, 1], &[2, 1, 3], &[2, 2, 2]] {
            let nodes = Nodes::of_sizes(sizes);
            let world: usize = sizes.iter().sum();
            let counts: Vec<usize> = (0..world).map(|p| 7 * p + 3 * (p % 2)).collect();
            let mut offs = vec![0];
            for c in &counts {
                offs.push(offs.last().unwrap() + c);
            }
            let inline: Vec<bool> = (0..world).map(|p| p == 1).collect();
            let l = Layout {
                nodes: &nodes,
                offs: &offs,
                inline: &inline,
            };
            let total = *offs.last().unwrap();
            let mut rounds: Vec<Vec<Vec<Message>>> =
                vec![(0..world).map(|me| l.across_and_home(me)).collect()];
            for t in 1..nodes.count() {
                rounds.push(
                    (0..world)
                        .map(|me| l.inside(me, (nodes.node_of(me) + t) % nodes.count()))
                        .collect(),
                );
            }
            let mut have: Vec<Vec<u8>> = (0..world)
                .map(|me| {
                    let mut h = vec![0u8; total];
                    for p in 0..world {
                        if p == me || inline[p] {
                            h[l.shard(p)].fill(1);
                        }
                    }
                    h
                })
                .collect();
            for round in &rounds {
                for (me, msgs) in round.iter().enumerate() {
                    for m in msgs.iter().filter(|m| m.to == me) {
                        let sender = &round[m.from];
                        assert!(
                            sender
                                .iter()
                                .any(|s| s.to == me && s.from == m.from && s.range == m.range),
                            "{sizes:?}: rank {me} waits for {:?} from {}",
                            m.range,
                            m.from
                        );
                        assert!(
                            have[m.from][m.range.clone()].iter().all(|&b| b == 1),
                            "{sizes:?}: rank {} sends {:?} before it has it",
                            m.from,
                            m.range
                        );
                    }
                    let mut got: Vec<&Range<usize>> = msgs
                        .iter()
                        .filter(|m| m.to == me)
                        .map(|m| &m.range)
                        .collect();
                    got.sort_by_key(|r| r.start);
                    assert!(
                        got.windows(2).all(|w| w[0].end <= w[1].start),
                        "{sizes:?}: rank {me} receives overlapping ranges"
                    );
                    for m in msgs.iter().filter(|m| m.from == me) {
                        assert!(
                            got.iter()
                                .all(|r| r.end <= m.range.start || m.range.end <= r.start),
                            "{sizes:?}: rank {me} sends {:?}, which it receives",
                            m.range
                        );
                    }
                    let mut peers: Vec<(usize, usize)> =
                        msgs.iter().map(|m| (m.from, m.to)).collect();
                    peers.sort_unstable();
                    let n = peers.len();
                    peers.dedup();
                    assert_eq!(
                        peers.len(),
                        n,
                        "{sizes:?}: two messages of a pair in a round"
                    );
                }
                for (me, msgs) in round.iter().enumerate() {
                    for m in msgs.iter().filter(|m| m.to == me) {
                        have[me][m.range.clone()].fill(1);
                    }
                }
            }
            for (me, h) in have.iter().enumerate() {
                assert!(
                    h.iter().all(|&b| b == 1),
                    "{sizes:?}: rank {me} misses bytes"
                );
            }
        }
    }
}
