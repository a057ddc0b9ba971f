//! The collective algorithms behind [`ProcessGroup`]'s public calls: the header exchange that
//! checks every rank called the same thing, and the ring / chain schedules driven by the
//! progress engine.

use super::*;
use compression::Half;
use shards::Shards;

impl ProcessGroup {
    pub(super) fn header<T: Element>(
        &self,
        kind: Kind,
        seq: u64,
        len: usize,
        root: usize,
        op: u8,
    ) -> Header {
        Header {
            kind,
            op,
            inline: false,
            elem: std::mem::size_of::<T>() as u8,
            seq,
            len: len as u64,
            root: root as u32,
            dtype: element::dtype_tag::<T>(),
            dtype_name: T::NAME,
        }
    }

    pub(super) fn waiting(&self) -> Waiting {
        Waiting {
            timeout: self.timeout,
            spin: self.mesh.as_ref().is_some_and(|m| m.spin),
        }
    }

    /// The node layout when this group is node-aware and `pays` says the node-aware path of
    /// a call sends fewer bytes across; `None` for the flat path.
    pub(super) fn nodes_where(
        &self,
        pays: impl Fn(&super::nodes::Nodes) -> bool,
    ) -> Option<super::nodes::Nodes> {
        self.mesh
            .as_ref()
            .filter(|m| m.node_aware)
            .and_then(|m| m.nodes.clone())
            .filter(|n| pays(n))
    }

    /// This rank's view of one collective's data round.
    pub(super) fn round<'a>(&self, wait: &'a Waiting, what: &'a str) -> direct::Round<'a> {
        direct::Round {
            rank: self.rank,
            world: self.world_size,
            wait,
            what,
        }
    }

    pub(super) fn what(&self, hdr: &Header) -> String {
        format!(
            "{} #{} on rank {} ({} × {})",
            hdr.kind.name(),
            hdr.seq,
            self.rank,
            hdr.len,
            hdr.dtype_name
        )
    }

    /// Sends `hdr` (+ `inline` payload) to every peer, receives theirs, and checks they agree.
    pub(super) fn exchange(&mut self, hdr: &Header, inline: &[u8]) -> Result<()> {
        let what = self.what(hdr);
        let wait = self.waiting();
        let (rank, world) = (self.rank, self.world_size);
        let bytes = hdr.encode();
        let m = self.mesh_mut();
        let mut ops: Vec<Op<'_>> = Vec::with_capacity(2 * world);
        for p in (0..world).filter(|&p| p != rank) {
            ops.push(Op::Send {
                peer: p,
                hdr: Some(bytes),
                data: inline,
                done: 0,
            });
        }
        for (p, msg) in m.msgs.iter_mut().enumerate() {
            if p != rank {
                msg.reset();
                ops.push(Op::Msg { peer: p, msg });
            }
        }
        drive(&mut m.links, &mut ops, &wait, &what)?;
        drop(ops);
        for p in (0..world).filter(|&p| p != rank) {
            let theirs = self.peer_header(p)?;
            if !agrees(hdr, &theirs) {
                return Err(CommError::Mismatch(format!(
                    "rank {p} called {} but rank {rank} called {}: the ranks made different \
                     calls. Most often one rank took a different number of steps or batches \
                     (a batch size or a data loader of its own): every rank must call the \
                     collectives in the same order, as the same number of batches from \
                     burn-ddp's ShardedDataLoader gives",
                    describe(&theirs, None),
                    describe(hdr, Some(hdr.dtype_name))
                )));
            }
        }
        Ok(())
    }

    pub(super) fn peer_header(&mut self, p: usize) -> Result<Header> {
        let m = self.mesh_mut();
        m.msgs[p].header().ok_or_else(|| {
            CommError::io(
                "collective header",
                Some(p),
                std::io::Error::new(std::io::ErrorKind::InvalidData, "garbled header"),
            )
        })
    }

    pub(super) fn all_reduce_impl<T: Element>(
        &mut self,
        seq: u64,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.world_size;
        if n == 1 {
            return Ok(());
        }
        let sz = std::mem::size_of::<T>();
        let mut hdr = self.header::<T>(Kind::AllReduce, seq, buf.len(), 0, op_code(op));
        hdr.inline = std::mem::size_of_val(buf) * (n - 1) <= INLINE_BYTES;
        if hdr.inline {
            self.exchange(&hdr, bytemuck::cast_slice(buf))?;
            let everything = 0..buf.len();
            self.reduce_inline(buf, everything, op);
            return Ok(());
        }
        // `root` of an all-reduce header says which algorithm runs: every rank must agree.
        let nodes = self.nodes_where(|_| true);
        hdr.root = u32::from(nodes.is_some());
        self.exchange(&hdr, &[])?;
        let what = self.what(&hdr);
        let wait = self.waiting();
        let round = self.round(&wait, &what);
        if let Some(nodes) = nodes {
            return hierarchical::all_reduce(self.mesh_mut(), &round, &nodes, buf, op);
        }
        // The direct reduce-scatter of even shards (every element summed in rank order, as on
        // the inline path), then a ring all-gather of the reduced shards.
        let shards = Shards::even(buf.len(), n);
        direct::reduce_scatter(self.mesh_mut(), &round, buf, &shards, op)?;
        self.gather_ring(
            &hdr,
            bytemuck::cast_slice_mut(buf),
            &shards.byte_offsets(sz),
        )
    }

    /// Reduces `buf[range]` from every rank's whole buffer sent inline in its header (this
    /// rank's from `buf` itself) in rank order, so every rank computes the same values.
    pub(super) fn reduce_inline<T: Element>(
        &mut self,
        buf: &mut [T],
        range: std::ops::Range<usize>,
        op: ReduceOp,
    ) {
        let (rank, n) = (self.rank, self.world_size);
        let bytes = direct::bytes_of(&range, std::mem::size_of::<T>());
        let m = self.mesh_mut();
        m.scratch.clear();
        m.scratch
            .extend_from_slice(bytemuck::cast_slice(&buf[range.clone()]));
        let dst = &mut buf[range];
        let first: &[u8] = if rank == 0 {
            &m.scratch
        } else {
            &m.msgs[0].payload[bytes.clone()]
        };
        bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(first);
        for p in 1..n {
            let src: &[u8] = if p == rank {
                &m.scratch
            } else {
                &m.msgs[p].payload[bytes.clone()]
            };
            element::reduce_into(dst, src, op);
        }
        if op == ReduceOp::Mean {
            element::divide(dst, n);
        }
    }

    /// The 16-bit inline path: every rank sends its whole buffer rounded to `h` in its
    /// header; this rank reduces `buf[range]` from the `n` rounded contributions in rank
    /// order ([`compression::reduce_chunk`]: f32 accumulation, one rounding).
    pub(super) fn reduce_inline_half(
        &mut self,
        hdr: &Header,
        buf: &mut [f32],
        range: std::ops::Range<usize>,
        h: Half,
        div: Option<usize>,
    ) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        let mut wire = std::mem::take(&mut self.mesh_mut().half);
        wire.resize(2 * buf.len(), 0);
        compression::encode(h, buf, &mut wire);
        let res = self.exchange(hdr, &wire);
        let m = self.mesh_mut();
        if res.is_ok() {
            let at = direct::bytes_of(&range, 2);
            let terms: Vec<&[u8]> = (0..n)
                .map(|p| {
                    if p == rank {
                        &wire[at.clone()]
                    } else {
                        &m.msgs[p].payload[at.clone()]
                    }
                })
                .collect();
            m.scratch.resize(at.len(), 0);
            compression::reduce_chunk(h, &mut buf[range], &terms, div, &mut m.scratch);
        }
        m.half = wire;
        res
    }

    /// The 16-bit all-reduce behind [`ProcessGroup::all_reduce_compressed`] (whose rustdoc
    /// describes the algorithm): a direct reduce-scatter of 16-bit chunks into f32
    /// accumulators, one rounding, a ring all-gather of the 16-bit results.
    pub(super) fn all_reduce_compressed_impl(
        &mut self,
        seq: u64,
        buf: &mut [f32],
        op: ReduceOp,
        h: Half,
    ) -> Result<()> {
        let n = self.world_size;
        if n == 1 {
            return Ok(());
        }
        let len = buf.len();
        let r = self.rank;
        let div = (op == ReduceOp::Mean).then_some(n);
        let hdr = Header {
            kind: Kind::AllReduceCompressed,
            op: op_code(op),
            inline: 2 * len * (n - 1) <= INLINE_BYTES,
            elem: 2,
            seq,
            len: len as u64,
            root: 0,
            dtype: element::tag_of(h.name(), 2),
            dtype_name: h.name(),
        };
        if hdr.inline {
            let everything = 0..len;
            return self.reduce_inline_half(&hdr, buf, everything, h, div);
        }
        // `root` says which algorithm runs: every rank must agree.
        let nodes = self.nodes_where(super::nodes::Nodes::compressed_chain_pays);
        let mut hdr = hdr;
        hdr.root = u32::from(nodes.is_some());
        self.exchange(&hdr, &[])?;
        let what = self.what(&hdr);
        let wait = self.waiting();
        if let Some(nodes) = nodes {
            let round = self.round(&wait, &what);
            let mut wire = std::mem::take(&mut self.mesh_mut().half);
            let res = hierarchical::all_reduce_compressed(
                self.mesh_mut(),
                &round,
                &nodes,
                buf,
                op,
                h,
                &mut wire,
            );
            self.mesh_mut().half = wire;
            return res;
        }
        let plan = SegmentPlan {
            rank: r,
            world: n,
            div,
            h,
        };
        let mesh = self.mesh_mut();
        for segment in buf.chunks_mut(COMPRESSED_SEGMENT) {
            compressed_segment(mesh, &plan, segment, &wait, &what)?;
        }
        Ok(())
    }

    pub(super) fn broadcast_impl(
        &mut self,
        mut hdr: Header,
        bytes: &mut [u8],
        root: usize,
    ) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        hdr.inline = self.rank == root && bytes.len() <= INLINE_BYTES;
        let small = bytes.len() <= INLINE_BYTES;
        self.exchange(&hdr, if hdr.inline { bytes } else { &[] })?;
        if small {
            if self.rank != root {
                let m = self.mesh_mut();
                bytes.copy_from_slice(&m.msgs[root].payload);
            }
            return Ok(());
        }
        self.chain(bytes, root)
    }

    /// Pipelined chain broadcast from `root` along the ring order.
    pub(super) fn chain(&mut self, bytes: &mut [u8], root: usize) -> Result<()> {
        let n = self.world_size;
        let r = self.rank;
        let what = format!(
            "broadcast #{} on rank {r} ({} bytes)",
            self.seq,
            bytes.len()
        );
        let wait = self.waiting();
        let pos = (r + n - root) % n;
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let links = &mut self.mesh_mut().links;
        let mut ops = [if pos == 0 {
            Op::Send {
                peer: next,
                hdr: None,
                data: bytes,
                done: 0,
            }
        } else if pos == n - 1 {
            Op::Recv {
                peer: prev,
                dst: bytes,
                done: 0,
            }
        } else {
            Op::Relay {
                from: prev,
                to: next,
                buf: bytes,
                got: 0,
                sent: 0,
            }
        }];
        drive(links, &mut ops, &wait, &what)
    }

    pub(super) fn all_gather_impl<T: Element>(
        &mut self,
        mut hdr: Header,
        input: &[u8],
        lens: &[usize],
        output: &mut [T],
    ) -> Result<()> {
        let n = self.world_size;
        let r = self.rank;
        let sz = std::mem::size_of::<T>();
        let offs: Vec<usize> = std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, &l| {
                *acc += l * sz;
                Some(*acc)
            }))
            .collect();
        let out: &mut [u8] = bytemuck::cast_slice_mut(output);
        copy::copy(&mut out[offs[r]..offs[r + 1]], input);
        if n == 1 {
            return Ok(());
        }
        hdr.inline = input.len() <= INLINE_BYTES;
        self.exchange(&hdr, if hdr.inline { input } else { &[] })?;
        self.gather_ring(&hdr, out, &offs)
    }

    /// Ring all-gather of the chunks `out[offs[c]..offs[c+1]]`; chunks a rank already sent
    /// inline in its header are copied from there and skipped by the ring.
    pub(super) fn gather_ring(
        &mut self,
        hdr: &Header,
        out: &mut [u8],
        offs: &[usize],
    ) -> Result<()> {
        let n = self.world_size;
        let r = self.rank;
        let mut inline = vec![false; n];
        inline[r] = hdr.inline;
        for p in (0..n).filter(|&p| p != r) {
            let h = self.peer_header(p)?;
            inline[p] = h.inline;
            if h.inline {
                let m = self.mesh_mut();
                out[offs[p]..offs[p + 1]].copy_from_slice(&m.msgs[p].payload);
            }
        }
        if inline.iter().all(|&i| i) {
            return Ok(());
        }
        let what = self.what(hdr);
        let wait = self.waiting();
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let items = (0..n - 1)
            .map(|s| {
                let c = (r + 2 * n - s - 1) % n;
                engine::RingItem {
                    range: if inline[c] {
                        offs[c]..offs[c]
                    } else {
                        offs[c]..offs[c + 1]
                    },
                }
            })
            .collect();
        let first = if inline[r] {
            offs[r]..offs[r]
        } else {
            offs[r]..offs[r + 1]
        };
        let links = &mut self.mesh_mut().links;
        let pipe = engine::RingPipe::new(prev, next, out, first, items);
        drive(links, &mut [Op::Ring(pipe)], &wait, &what)
    }

    pub(super) fn all_gather_varlen_impl<T: Element>(
        &mut self,
        mut hdr: Header,
        input: &[T],
    ) -> Result<Vec<Vec<T>>> {
        let n = self.world_size;
        let r = self.rank;
        let sz = std::mem::size_of::<T>();
        let inp: &[u8] = bytemuck::cast_slice(input);
        hdr.inline = inp.len() <= INLINE_BYTES;
        self.exchange(&hdr, if hdr.inline { inp } else { &[] })?;
        let mut lens = vec![0usize; n];
        for (p, l) in lens.iter_mut().enumerate() {
            *l = if p == r {
                input.len()
            } else {
                self.peer_header(p)?.len as usize
            };
        }
        let total: usize = lens.iter().sum();
        let mut flat: Vec<T> = vec![T::zeroed(); total];
        let offs: Vec<usize> = std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, &l| {
                *acc += l * sz;
                Some(*acc)
            }))
            .collect();
        {
            let out: &mut [u8] = bytemuck::cast_slice_mut(&mut flat);
            copy::copy(&mut out[offs[r]..offs[r + 1]], inp);
            self.gather_ring(&hdr, out, &offs)?;
        }
        let mut res = Vec::with_capacity(n);
        let mut start = 0;
        for l in lens {
            res.push(flat[start..start + l].to_vec());
            start += l;
        }
        Ok(res)
    }
}

/// Elements per segment of a compressed all-reduce: each segment is reduced on its own, so the
/// 16-bit image of one segment and its accumulators stay in the CPU caches between the
/// conversions and the transfers (4 MiB of f32 values, 2 MiB on the wire).
const COMPRESSED_SEGMENT: usize = 1 << 20;

/// What every segment of a compressed all-reduce shares.
struct SegmentPlan {
    rank: usize,
    world: usize,
    /// The divisor of a mean.
    div: Option<usize>,
    h: Half,
}

/// One segment of [`ProcessGroup::all_reduce_compressed`] after the header exchange: the
/// direct reduce-scatter of 16-bit chunks into f32 accumulators ([`direct::reduce_round_half`]),
/// one rounding, the ring all-gather of the 16-bit results.
fn compressed_segment(
    mesh: &mut Mesh,
    plan: &SegmentPlan,
    buf: &mut [f32],
    wait: &Waiting,
    what: &str,
) -> Result<()> {
    let SegmentPlan {
        rank: r,
        world: n,
        div,
        h,
    } = *plan;
    let shards = Shards::even(buf.len(), n);
    let pieces: Vec<_> = (0..n).map(|c| shards.range(c)).collect();
    let round = direct::Round {
        rank: r,
        world: n,
        wait,
        what,
    };
    // Afterwards `mesh.half` holds the segment's 16-bit image with this rank's chunk reduced.
    direct::reduce_round_half(mesh, &round, buf, &pieces, h, div)?;
    let Mesh {
        links, half: wire, ..
    } = mesh;
    // All-gather of the 16-bit chunks: send ours, forward each one received.
    let items = (0..n - 1)
        .map(|s| engine::RingItem {
            range: direct::bytes_of(&pieces[(r + 2 * n - s - 1) % n], 2),
        })
        .collect();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let pipe = engine::RingPipe::new(prev, next, wire, direct::bytes_of(&pieces[r], 2), items);
    drive(links, &mut [Op::Ring(pipe)], wait, what)?;
    for c in (0..n).filter(|&c| c != r) {
        compression::decode(
            h,
            &wire[direct::bytes_of(&pieces[c], 2)],
            &mut buf[pieces[c].clone()],
        );
    }
    Ok(())
}

/// Whether two ranks' headers describe the same call.
fn agrees(a: &Header, b: &Header) -> bool {
    let same_len = !matches!(
        a.kind,
        Kind::AllGatherVarlen | Kind::BroadcastBytes | Kind::AllGatherShards | Kind::ShiftBytes
    );
    a.kind == b.kind
        && a.seq == b.seq
        && a.dtype == b.dtype
        && a.elem == b.elem
        && a.op == b.op
        && a.root == b.root
        && (!same_len || a.len == b.len)
}

fn describe(h: &Header, dtype_name: Option<&str>) -> String {
    let dtype = dtype_name
        .or_else(|| element::name_of_tag(h.dtype))
        .map_or_else(|| format!("type #{:08x}", h.dtype), str::to_string);
    let mut s = format!("{}(", h.kind.name());
    match h.kind {
        Kind::Barrier => {}
        Kind::AllReduce => {
            s += &format!("{} × {dtype}, {}", h.len, op_name(h.op));
            if h.root == 1 {
                s += ", node-aware";
            }
        }
        Kind::AllReduceCompressed => {
            s += &format!("{} × f32 as {dtype}, {}", h.len, op_name(h.op));
            if h.root == 1 {
                s += ", node-aware";
            }
        }
        Kind::Broadcast | Kind::BroadcastBytes => {
            s += &format!("{} × {dtype}, root {}", h.len, h.root)
        }
        Kind::AllGather | Kind::AllGatherVarlen => s += &format!("{} × {dtype}", h.len),
        Kind::ShiftBytes => s += &format!("{} × {dtype} to the next rank", h.len),
        Kind::ReduceScatter => {
            s += &format!(
                "{} × {dtype}, {}, shard sizes #{:08x}",
                h.len,
                op_name(h.op),
                h.root
            );
            if h.op & NODE_AWARE_OP != 0 {
                s += ", node-aware";
            }
        }
        Kind::ReduceScatterCompressed => {
            s += &format!(
                "{} × f32 as {dtype}, {}, shard sizes #{:08x}",
                h.len,
                op_name(h.op),
                h.root
            )
        }
        Kind::AllGatherShards => {
            s += &format!("own shard {} × {dtype}, shard sizes #{:08x}", h.len, h.root);
            if h.op & NODE_AWARE_OP != 0 {
                s += ", node-aware";
            }
        }
    }
    s += &format!(") as call #{}", h.seq);
    s
}
