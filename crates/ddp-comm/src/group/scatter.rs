//! The two halves of an all-reduce as collectives of their own, over shards of any sizes:
//! [`ProcessGroup::reduce_scatter`] (each rank ends with the reduction of its shard) and
//! [`ProcessGroup::all_gather_into`] (each rank contributes its shard, all end with every
//! shard) — what optimizer-state sharding (ZeRO stage 1) runs instead of one all-reduce.

use super::compression::Compression;
use super::direct;
use super::engine::{Header, Kind, NODE_AWARE_OP, op_code};
use super::shards::Shards;
use super::{Element, INLINE_BYTES, ProcessGroup, ReduceOp, element};
use crate::error::{CommError, Result};

impl ProcessGroup {
    /// Reduces `buf` element-wise across ranks, leaving on each rank only **its own shard**
    /// reduced: `buf` holds one shard per rank in rank order, rank `p`'s of `counts[p]`
    /// elements (any sizes, zero included; they add up to `buf.len()`). On return this rank's
    /// shard holds the reduction over all ranks; the rest of `buf` is unchanged, except on the
    /// node-aware path, where it is unspecified.
    ///
    /// Every element is reduced **in rank order**, exactly as [`Self::all_reduce`] reduces it,
    /// so a shard is bitwise the all-reduce's values of those elements, whatever the shard
    /// sizes. Every rank must pass the same `counts`: ranks that differ fail with
    /// [`CommError::Mismatch`] on every rank (a fingerprint of the sizes is in the header), as
    /// do other mismatched calls. Each rank sends and receives `(n-1)/n` of the buffer at
    /// even sizes — half an all-reduce.
    ///
    /// Across hosts with several ranks each ([`Self::set_node_aware`]), where it sends fewer
    /// bytes across (from three ranks per host at two hosts, two at three), a large
    /// reduce-scatter runs as the node-aware all-reduce's chain of nodes, then each finished
    /// value goes from the last host straight to its shard's rank: a host sends one buffer of
    /// partial sums across instead of every rank's pieces for the other hosts' ranks. The
    /// shards are bitwise the same.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), ddp_comm::CommError> {
    /// use ddp_comm::{ProcessGroup, ReduceOp};
    /// let mut pg = ProcessGroup::from_env()?;
    /// // Rank 0 owns the first 3 values, rank 1 the other 5 (two ranks).
    /// let mut grads = vec![1.0f32; 8];
    /// pg.reduce_scatter(&mut grads, &[3, 5], ReduceOp::Mean)?;
    /// let mine = if pg.rank() == 0 { &grads[..3] } else { &grads[3..] };
    /// # let _ = mine;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] when `counts` does not have one size per rank adding up
    /// to `buf.len()`; any failure of the group. Like every failed collective, an error
    /// breaks the group.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        buf: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let _span = self
            .trace_op("reduce_scatter", T::NAME, Some(size_of_val(buf)), None)
            .arg("reduce", super::engine::op_name(op_code(op)));
        self.collective(
            super::Call::new("reduce_scatter", T::NAME, buf.len()),
            |g, seq| {
                let n = g.world_size;
                let shards = Shards::new(counts, buf.len(), n, "reduce_scatter")?;
                if n == 1 {
                    return Ok(());
                }
                let mut hdr = g.header::<T>(
                    Kind::ReduceScatter,
                    seq,
                    buf.len(),
                    shards.fingerprint() as usize,
                    op_code(op),
                );
                hdr.inline = size_of_val(buf) * (n - 1) <= INLINE_BYTES;
                let mine = shards.range(g.rank);
                if hdr.inline {
                    g.exchange(&hdr, bytemuck::cast_slice(buf))?;
                    g.reduce_inline(buf, mine, op);
                    return Ok(());
                }
                // Whether the node-aware path runs travels in the op's high bit: every rank must
                // agree (a mismatch fails the call on every rank).
                let nodes = g.nodes_where(super::nodes::Nodes::reduce_scatter_chain_pays);
                if nodes.is_some() {
                    hdr.op |= NODE_AWARE_OP;
                }
                g.exchange(&hdr, &[])?;
                let what = g.what(&hdr);
                let wait = g.waiting();
                let round = g.round(&wait, &what);
                match nodes {
                    Some(nodes) => super::hierarchical::reduce_scatter(
                        g.mesh_mut(),
                        &round,
                        &nodes,
                        buf,
                        &shards,
                        op,
                    ),
                    None => direct::reduce_scatter(g.mesh_mut(), &round, buf, &shards, op),
                }
            },
        )
    }

    /// [`Self::reduce_scatter`] of f32 values that travel as 16-bit values (`compression`),
    /// with [`Self::all_reduce_compressed`]'s arithmetic: every contribution is rounded to 16
    /// bits, the `n` of them are added in rank order in f32, and the result (divided by `n`
    /// for a mean) is rounded to 16 bits once and decoded. This rank's shard is therefore
    /// bitwise what [`Self::all_reduce_compressed`] gives for those elements.
    ///
    /// [`Compression::None`] is exactly [`Self::reduce_scatter`]. Only [`ReduceOp::Sum`] and
    /// [`ReduceOp::Mean`] are compressed; another op is a [`CommError::InvalidArgument`]. In a
    /// group of one `buf` is left untouched.
    ///
    /// # Errors
    /// As [`Self::reduce_scatter`]; ranks passing different `compression`s fail with
    /// [`CommError::Mismatch`].
    pub fn reduce_scatter_compressed(
        &mut self,
        buf: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        let Some(h) = compression.half() else {
            return self.reduce_scatter(buf, counts, op);
        };
        let _span = self
            .trace_op(
                "reduce_scatter",
                compression.name(),
                Some(2 * buf.len()),
                None,
            )
            .arg("reduce", super::engine::op_name(op_code(op)))
            .arg("wire", compression.name());
        self.collective(
            super::Call::new("reduce_scatter", compression.name(), buf.len()),
            |g, seq| {
                if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                    return Err(CommError::InvalidArgument(format!(
                        "reduce_scatter_compressed with {compression} supports ReduceOp::Sum and \
                     ReduceOp::Mean, not ReduceOp::{op:?} (use reduce_scatter)"
                    )));
                }
                let n = g.world_size;
                let shards = Shards::new(counts, buf.len(), n, "reduce_scatter_compressed")?;
                if n == 1 {
                    return Ok(());
                }
                let (r, len) = (g.rank, buf.len());
                let div = (op == ReduceOp::Mean).then_some(n);
                let hdr = Header {
                    kind: Kind::ReduceScatterCompressed,
                    op: op_code(op),
                    inline: 2 * len * (n - 1) <= INLINE_BYTES,
                    elem: 2,
                    seq,
                    len: len as u64,
                    root: shards.fingerprint(),
                    dtype: element::tag_of(h.name(), 2),
                    dtype_name: h.name(),
                };
                let mine = shards.range(r);
                if hdr.inline {
                    return g.reduce_inline_half(&hdr, buf, mine, h, div);
                }
                g.exchange(&hdr, &[])?;
                let what = g.what(&hdr);
                let wait = g.waiting();
                let round = g.round(&wait, &what);
                let rounds = shards.rounds(4);
                for k in 0..rounds {
                    let pieces = shards.pieces(rounds, k);
                    direct::reduce_round_half(g.mesh_mut(), &round, buf, &pieces, h, div)?;
                }
                Ok(())
            },
        )
    }

    /// Gathers every rank's shard of `buf` into every rank's `buf`: `buf` holds one shard per
    /// rank in rank order, rank `p`'s of `counts[p]` elements (any sizes, adding up to
    /// `buf.len()`); this rank's shard is its input, and on return every shard holds its
    /// rank's values. The other half of [`Self::reduce_scatter`] (a ring all-gather, as in
    /// [`Self::all_reduce`]).
    ///
    /// Across hosts with several ranks on one of them ([`Self::set_node_aware`]), each host's
    /// shards cross the network once per other host, spread over its ranks, and reach the
    /// host's other ranks through shared memory: `S·(k−1)/k` per host for even shards (`k`
    /// hosts), where the ring sends `S·(N−1)/N` across every host boundary. The result is the
    /// same bytes.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), ddp_comm::CommError> {
    /// use ddp_comm::ProcessGroup;
    /// let mut pg = ProcessGroup::from_env()?;
    /// // Two ranks: rank 0 fills the first 3 values, rank 1 the other 5.
    /// let mut params = vec![0.0f32; 8];
    /// let counts = [3, 5];
    /// let mine = if pg.rank() == 0 { 0..3 } else { 3..8 };
    /// params[mine].fill(pg.rank() as f32);
    /// pg.all_gather_into(&mut params, &counts)?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Self::reduce_scatter`]: invalid `counts`, ranks passing different `counts`
    /// ([`CommError::Mismatch`]), any failure of the group.
    pub fn all_gather_into<T: Element>(&mut self, buf: &mut [T], counts: &[usize]) -> Result<()> {
        let own_bytes = counts.get(self.rank).map(|&c| c * std::mem::size_of::<T>());
        let _span = self.trace_op("all_gather_into", T::NAME, own_bytes, None);
        self.collective(super::Call::new("all_gather_into", T::NAME, buf.len()), |g, seq| {
            let n = g.world_size;
            let shards = Shards::new(counts, buf.len(), n, "all_gather_into")?;
            if n == 1 {
                return Ok(());
            }
            let sz = std::mem::size_of::<T>();
            let mine = direct::bytes_of(&shards.range(g.rank), sz);
            let mut hdr = g.header::<T>(
                Kind::AllGatherShards,
                seq,
                counts[g.rank],
                shards.fingerprint() as usize,
                0,
            );
            hdr.inline = mine.len() <= INLINE_BYTES;
            // Whether every shard travels in the headers (then nothing else moves), and
            // whether the node-aware path runs: in the op's high bit, so ranks that disagree
            // fail together.
            let all_inline = counts.iter().all(|&c| c * sz <= INLINE_BYTES);
            let nodes = g
                .nodes_where(super::nodes::Nodes::worth_it)
                .filter(|_| !all_inline);
            if nodes.is_some() {
                hdr.op |= NODE_AWARE_OP;
            }
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
            g.exchange(&hdr, if hdr.inline { &bytes[mine] } else { &[] })?;
            for (p, &count) in counts.iter().enumerate() {
                if p != g.rank && g.peer_header(p)?.len != count as u64 {
                    return Err(CommError::Mismatch(format!(
                        "all_gather_into: rank {p} sent a shard of {} elements, the shard sizes \
                         say {count}",
                        g.peer_header(p)?.len
                    )));
                }
            }
            let offs = shards.byte_offsets(sz);
            let Some(nodes) = nodes else {
                return g.gather_ring(&hdr, bytes, &offs);
            };
            let inline: Vec<bool> = counts.iter().map(|&c| c * sz <= INLINE_BYTES).collect();
            let me = g.rank;
            for p in (0..n).filter(|&p| p != me && inline[p]) {
                bytes[offs[p]..offs[p + 1]].copy_from_slice(&g.mesh_mut().msgs[p].payload);
            }
            let what = g.what(&hdr);
            let wait = g.waiting();
            let round = g.round(&wait, &what);
            super::node_gather::all_gather_into(g.mesh_mut(), &round, &nodes, bytes, &offs, &inline)
        })
    }
}
