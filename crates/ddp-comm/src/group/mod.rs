//! The process group: collectives across the ranks of a job.
//!
//! # Design
//! - **Rendezvous**: rank 0 serves the [`StoreServer`] at `MASTER_ADDR:MASTER_PORT` for the
//!   group's lifetime. Every rank binds a listener on the interface that reaches the master,
//!   publishes its address and host identity (host name + boot id) in the store, and connects
//!   to every other rank (full mesh; the handshake presents the job token).
//! - **Transports**: every pair of ranks has a TCP connection. Ranks on the same host also
//!   share a pair of memory rings (`/dev/shm`, unlinked once mapped) that carry all their data;
//!   TCP then only tells whether the peer is alive.
//! - **Protocol**: every collective starts with a 32-byte header (kind, element type, length,
//!   reduce op, root, call number) sent to every peer and checked, so mismatched calls fail with
//!   [`CommError::Mismatch`] on every rank. Small payloads travel inside that first message
//!   (one round: the latency path); large ones then use bandwidth-optimal algorithms — a ring
//!   reduce-scatter + all-gather for all-reduce, a ring for all-gather, a pipelined chain for
//!   broadcast — with sends, receives and reductions overlapping in one progress loop.
//! - **Determinism**: every element is reduced in the same order on every rank's behalf and the
//!   result is copied, so all ranks get bitwise identical results.
//! - **Failures**: every wait has a deadline. Any error poisons the group and breaks all its
//!   links (FIN on TCP, a closed flag on the rings), so every other rank fails quickly too.
//!   A ring closed this way carries the rank that caused it, so ranks that only see the
//!   cascade still name the culprit (over TCP they name the neighbour that gave up).
//!   The collective timeout bounds each stall (no byte moved), not a whole transfer.
//!
//! # Environment
//! - `DDP_TIMEOUT_SECS`, `DDP_CONNECT_TIMEOUT_SECS`, `DDP_SHARED_MEMORY=0`: defaults of
//!   [`GroupOptions`].
//! - `DDP_HOST_ID`: overrides the host identity (ranks with equal ids use shared memory);
//!   tests use it to emulate several hosts on one machine.
//! - `DDP_SHM_RING_KIB`: size of each shared-memory ring (default 512 KiB).

mod copy;
mod element;
mod engine;
mod link;
mod mesh;
mod shm;

use std::time::{Duration, Instant};

use crate::env::LaunchEnv;
use crate::error::{CommError, Result};
use crate::store::{PrefixStore, Store, StoreClient, StoreServer, keys};

use engine::{HDR, Header, Kind, Msg, Op, Waiting, drive, op_code, op_name};
use link::Link;
use mesh::{MeshConfig, PeerInfo};

/// A reduction for [`ProcessGroup::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size (integer division for integer types).
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// A type the collectives move and reduce: `f32`, `f64`, `i64`, `i32`, `u8`.
pub trait Element: bytemuck::Pod + Send + Sync + PartialOrd + std::fmt::Debug + 'static {
    /// A short name used in mismatch errors ("f32", …).
    const NAME: &'static str;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// `a / n` (for [`ReduceOp::Mean`]).
    fn div_count(a: Self, n: usize) -> Self;
}

/// Settings for [`ProcessGroup::init`].
#[derive(Debug, Clone, PartialEq)]
pub struct GroupOptions {
    /// Deadline of every collective and of each wait inside it (default 300 s, or the value of
    /// `DDP_TIMEOUT_SECS`).
    pub timeout: Duration,
    /// Deadline for the rendezvous: reaching the store and all peers (default 60 s).
    pub connect_timeout: Duration,
    /// Use shared memory between ranks on the same host (default true).
    pub shared_memory: bool,
}

impl Default for GroupOptions {
    /// The defaults above; `DDP_TIMEOUT_SECS`, `DDP_CONNECT_TIMEOUT_SECS` (seconds, fractions
    /// allowed) and `DDP_SHARED_MEMORY=0` override them when set to valid values.
    fn default() -> Self {
        let secs = |var: &str| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(Duration::from_secs_f64)
        };
        GroupOptions {
            timeout: secs("DDP_TIMEOUT_SECS").unwrap_or(Duration::from_secs(300)),
            connect_timeout: secs("DDP_CONNECT_TIMEOUT_SECS").unwrap_or(Duration::from_secs(60)),
            shared_memory: !matches!(
                std::env::var("DDP_SHARED_MEMORY").as_deref().map(str::trim),
                Ok("0" | "false" | "no" | "off")
            ),
        }
    }
}

/// Payloads up to this many bytes per peer travel inside the header message (one round).
const INLINE_BYTES: usize = 64 * 1024;

/// Which transport a peer link uses (see [`ProcessGroup::transports`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// This rank itself.
    SelfRank,
    /// Shared memory (same host).
    SharedMemory,
    /// TCP.
    Tcp,
}

/// The connections of a group of more than one rank.
struct Mesh {
    links: Vec<Option<Link>>,
    msgs: Vec<Msg>,
    scratch: Vec<u8>,
    spin: bool,
    // Kept alive for the group's lifetime (rank 0 serves, everyone holds a client).
    store: StoreClient,
    _server: Option<StoreServer>,
}

/// A group of rank processes that run collectives together.
///
/// Collectives are called by every rank in the same order with matching arguments. Any error
/// (a dead or stalled peer, a mismatch) breaks the group on every rank; later calls return
/// [`crate::CommError::Poisoned`].
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    seq: u64,
    poisoned: Option<String>,
    mesh: Option<Mesh>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("calls", &self.seq)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

impl ProcessGroup {
    /// Reads the launch environment and joins the group (world size 1 when nothing is set).
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?;
        Self::init(&env, GroupOptions::default())
    }

    /// Joins the group described by `env`: rank 0 serves the store, everyone connects.
    pub fn init(env: &LaunchEnv, opts: GroupOptions) -> Result<Self> {
        if env.world_size == 1 {
            let mut pg = Self::single();
            pg.timeout = opts.timeout;
            return Ok(pg);
        }
        let started = Instant::now();
        let deadline = started + opts.connect_timeout;
        let (rank, world) = (env.rank, env.world_size);
        let endpoint = env.master_endpoint();
        let token = env.job_token.as_deref();

        let server = if rank == 0 {
            Some(StoreServer::bind(&endpoint, env.job_token.clone())?)
        } else {
            None
        };
        let mut store =
            StoreClient::connect(&endpoint, token, opts.connect_timeout).map_err(|e| match e {
                CommError::Timeout { after, .. } => CommError::Timeout {
                    op: format!("rendezvous: reaching the store of rank 0 at {endpoint}"),
                    peer: Some(0),
                    after,
                },
                e => e,
            })?;

        let ip = mesh::local_ip_towards(&endpoint)
            .map_err(|e| CommError::io(format!("finding the interface to {endpoint}"), None, e))?;
        let listener = std::net::TcpListener::bind((ip, 0))
            .map_err(|e| CommError::io(format!("binding a listener on {ip}"), None, e))?;
        let me = PeerInfo {
            addr: listener
                .local_addr()
                .map_err(|e| CommError::io("listener address", None, e))?,
            host: mesh::host_identity(),
        };
        let mut ns = PrefixStore::new(&mut store, keys::PROCESS_GROUP);
        ns.set(&keys::peer_addr(rank), &me.encode())?;

        let addr_keys: Vec<String> = (0..world).map(keys::peer_addr).collect();
        let key_refs: Vec<&str> = addr_keys.iter().map(String::as_str).collect();
        // Ranks other than 0 give up a little earlier, while rank 0 still serves the store, so
        // every rank can name the missing ranks itself.
        let margin = if rank == 0 {
            Duration::ZERO
        } else {
            (opts.connect_timeout / 10).min(Duration::from_millis(500))
        };
        let remaining = deadline.saturating_duration_since(Instant::now() + margin);
        if let Err(e) = ns.wait(&key_refs, remaining) {
            if !matches!(e, CommError::Timeout { .. }) {
                return Err(e);
            }
            let mut missing = Vec::new();
            for (r, k) in addr_keys.iter().enumerate() {
                if ns.try_get(k)?.is_none() {
                    missing.push(r);
                }
            }
            if rank == 0 {
                // Keep serving briefly for ranks that started later than us.
                std::thread::sleep(Duration::from_millis(300));
            }
            return Err(CommError::Timeout {
                op: format!(
                    "rendezvous: rank(s) {} of {world} never joined",
                    mesh::list(&missing)
                ),
                peer: missing.first().copied(),
                after: started.elapsed(),
            });
        }
        let mut infos = Vec::with_capacity(world);
        for (r, k) in addr_keys.iter().enumerate() {
            let v = ns.get(k, Duration::from_secs(1))?;
            infos.push(PeerInfo::decode(&v).ok_or_else(|| CommError::Store {
                addr: endpoint.clone(),
                msg: format!("rank {r} published a malformed address"),
            })?);
        }

        let cfg = MeshConfig {
            rank,
            world,
            token,
            shared_memory: opts.shared_memory,
            deadline,
            started,
        };
        let links = mesh::establish(&cfg, listener, &infos)?;
        let local = infos.iter().filter(|i| i.host == me.host).count();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tracing::debug!(
            rank,
            world,
            local,
            "process group ready in {:?}",
            started.elapsed()
        );
        Ok(ProcessGroup {
            rank,
            world_size: world,
            timeout: opts.timeout,
            seq: 0,
            poisoned: None,
            mesh: Some(Mesh {
                links,
                msgs: (0..world).map(|_| Msg::default()).collect(),
                scratch: Vec::new(),
                spin: local <= cores,
                store,
                _server: server,
            }),
        })
    }

    /// A group of one: every collective is a no-op copy.
    pub fn single() -> Self {
        ProcessGroup {
            rank: 0,
            world_size: 1,
            timeout: GroupOptions::default().timeout,
            seq: 0,
            poisoned: None,
            mesh: None,
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Changes the deadline of later collectives.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The deadline of collectives.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The error that broke this group, if any.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    /// How this rank reaches each rank (index = rank).
    pub fn transports(&self) -> Vec<Transport> {
        (0..self.world_size)
            .map(
                |r| match self.mesh.as_ref().and_then(|m| m.links[r].as_ref()) {
                    None => Transport::SelfRank,
                    Some(l) if l.is_shm() => Transport::SharedMemory,
                    Some(_) => Transport::Tcp,
                },
            )
            .collect()
    }

    /// The rendezvous store client (for exchanging extra setup data, e.g. an NCCL id);
    /// `None` in a group of one.
    pub fn store(&mut self) -> Option<&mut StoreClient> {
        self.mesh.as_mut().map(|m| &mut m.store)
    }

    /// Reduces `buf` element-wise across ranks, in place; every rank gets the result.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.collective(|g, seq| g.all_reduce_impl(seq, buf, op))
    }

    /// Copies `root`'s `buf` into every rank's `buf` (lengths must match).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        self.collective(|g, seq| {
            g.check_root(root)?;
            let hdr = g.header::<T>(Kind::Broadcast, seq, buf.len(), root, 0);
            g.broadcast_impl(hdr, bytemuck::cast_slice_mut(buf), root)
        })
    }

    /// Gathers equal-length `input`s from every rank into `output` (`len = input.len() *
    /// world_size`), rank order.
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.collective(|g, seq| {
            if output.len() != input.len() * g.world_size {
                return Err(CommError::InvalidArgument(format!(
                    "all_gather: output has {} elements, expected input length {} × world size {}",
                    output.len(),
                    input.len(),
                    g.world_size
                )));
            }
            let hdr = g.header::<T>(Kind::AllGather, seq, input.len(), 0, 0);
            let n = input.len();
            let lens = vec![n; g.world_size];
            g.all_gather_impl(hdr, bytemuck::cast_slice(input), &lens, output)
        })
    }

    /// Gathers `input`s of any lengths from every rank, rank order.
    pub fn all_gather_varlen<T: Element>(&mut self, input: &[T]) -> Result<Vec<Vec<T>>> {
        self.collective(|g, seq| {
            if g.world_size == 1 {
                return Ok(vec![input.to_vec()]);
            }
            let hdr = g.header::<T>(Kind::AllGatherVarlen, seq, input.len(), 0, 0);
            g.all_gather_varlen_impl(hdr, input)
        })
    }

    /// Broadcasts a byte message of any length from `root` (others' `bytes` are replaced).
    pub fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        self.collective(|g, seq| {
            g.check_root(root)?;
            if g.world_size == 1 {
                return Ok(());
            }
            let len = if g.rank == root { bytes.len() } else { 0 };
            let mut hdr = g.header::<u8>(Kind::BroadcastBytes, seq, len, root, 0);
            let inline = g.rank == root && len <= INLINE_BYTES;
            hdr.inline = inline;
            g.exchange(&hdr, if inline { bytes } else { &[] })?;
            let (root_len, root_inline) = if g.rank == root {
                (len, inline)
            } else {
                let h = g.peer_header(root)?;
                (h.len as usize, h.inline)
            };
            if g.rank != root {
                bytes.clear();
                bytes.resize(root_len, 0);
                if root_inline {
                    let m = g.mesh_mut();
                    bytes.copy_from_slice(&m.msgs[root].payload);
                }
            }
            if !root_inline {
                g.chain(bytes, root)?;
            }
            Ok(())
        })
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        self.collective(|g, seq| {
            if g.world_size == 1 {
                return Ok(());
            }
            let hdr = g.header::<u8>(Kind::Barrier, seq, 0, 0, 0);
            g.exchange(&hdr, &[])
        })
    }

    // ---------------------------------------------------------------------------------------

    /// Runs one collective: refuses on a poisoned group, numbers the call, poisons on error.
    fn collective<R>(&mut self, f: impl FnOnce(&mut Self, u64) -> Result<R>) -> Result<R> {
        if let Some(why) = &self.poisoned {
            return Err(CommError::Poisoned(why.clone()));
        }
        self.seq += 1;
        let seq = self.seq;
        f(self, seq).inspect_err(|e| self.poison(e))
    }

    /// Breaks the group after `err`: later calls fail, and every link is shut so peers fail
    /// quickly instead of waiting for their timeout.
    fn poison(&mut self, err: &CommError) {
        tracing::error!(rank = self.rank, "process group broken: {err}");
        self.poisoned = Some(err.to_string());
        let blame = err.peer();
        if let Some(m) = &self.mesh {
            for l in m.links.iter().flatten() {
                l.abort(blame);
            }
        }
    }

    fn mesh_mut(&mut self) -> &mut Mesh {
        self.mesh
            .as_mut()
            .expect("collectives with world size > 1 have a mesh")
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(CommError::InvalidArgument(format!(
                "root rank {root} is out of range for world size {}",
                self.world_size
            )));
        }
        Ok(())
    }

    fn header<T: Element>(&self, kind: Kind, seq: u64, len: usize, root: usize, op: u8) -> Header {
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

    fn waiting(&self) -> Waiting {
        Waiting {
            timeout: self.timeout,
            spin: self.mesh.as_ref().is_some_and(|m| m.spin),
        }
    }

    fn what(&self, hdr: &Header) -> String {
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
    fn exchange(&mut self, hdr: &Header, inline: &[u8]) -> Result<()> {
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
                    "rank {p} called {} but rank {rank} called {}",
                    describe(&theirs, None),
                    describe(hdr, Some(hdr.dtype_name))
                )));
            }
        }
        Ok(())
    }

    fn peer_header(&mut self, p: usize) -> Result<Header> {
        let m = self.mesh_mut();
        m.msgs[p].header().ok_or_else(|| {
            CommError::io(
                "collective header",
                Some(p),
                std::io::Error::new(std::io::ErrorKind::InvalidData, "garbled header"),
            )
        })
    }

    fn all_reduce_impl<T: Element>(&mut self, seq: u64, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let n = self.world_size;
        if n == 1 {
            return Ok(());
        }
        let sz = std::mem::size_of::<T>();
        let mut hdr = self.header::<T>(Kind::AllReduce, seq, buf.len(), 0, op_code(op));
        hdr.inline = std::mem::size_of_val(buf) * (n - 1) <= INLINE_BYTES;
        if hdr.inline {
            self.exchange(&hdr, bytemuck::cast_slice(buf))?;
            // Reduce in rank order so every rank computes exactly the same values.
            let rank = self.rank;
            let m = self.mesh_mut();
            m.scratch.clear();
            m.scratch.extend_from_slice(bytemuck::cast_slice(buf));
            let first: &[u8] = if rank == 0 {
                &m.scratch
            } else {
                &m.msgs[0].payload
            };
            bytemuck::cast_slice_mut::<T, u8>(buf).copy_from_slice(first);
            for p in 1..n {
                let src: &[u8] = if p == rank {
                    &m.scratch
                } else {
                    &m.msgs[p].payload
                };
                element::reduce_into(buf, src, op);
            }
            if op == ReduceOp::Mean {
                element::divide(buf, n);
            }
            return Ok(());
        }
        self.exchange(&hdr, &[])?;
        let what = self.what(&hdr);
        let wait = self.waiting();
        let r = self.rank;
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let len = buf.len();
        let range = |c: usize| chunk(len, n, c);
        // Reduce-scatter then all-gather as one pipeline: rank r sends its chunk r, then
        // forwards each chunk as soon as it is reduced (or received), so all 2(n-1) steps
        // overlap. After the reduce-scatter rank r holds the full reduction of chunk r+1.
        let mut items = Vec::with_capacity(2 * (n - 1));
        for s in 0..n - 1 {
            items.push(engine::RingItem {
                range: bytes_of(range((r + 2 * n - s - 1) % n), sz),
                reduce: true,
                finish: s == n - 2 && op == ReduceOp::Mean,
            });
        }
        for s in 0..n - 1 {
            items.push(engine::RingItem {
                range: bytes_of(range((r + n - s) % n), sz),
                reduce: false,
                finish: false,
            });
        }
        let links = &mut self.mesh_mut().links;
        let mut pipe = engine::RingPipe::new(
            prev,
            next,
            bytemuck::cast_slice_mut(buf),
            bytes_of(range(r), sz),
            items,
        );
        pipe.reduce = Some((element::reduce_bytes::<T>, op, sz));
        pipe.finish = Some((element::divide_bytes::<T>, n));
        drive(links, &mut [Op::Ring(pipe)], &wait, &what)
    }

    fn broadcast_impl(&mut self, mut hdr: Header, bytes: &mut [u8], root: usize) -> Result<()> {
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
    fn chain(&mut self, bytes: &mut [u8], root: usize) -> Result<()> {
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

    fn all_gather_impl<T: Element>(
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
    fn gather_ring(&mut self, hdr: &Header, out: &mut [u8], offs: &[usize]) -> Result<()> {
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
                    reduce: false,
                    finish: false,
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

    fn all_gather_varlen_impl<T: Element>(
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

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if let Some(m) = &self.mesh {
            for l in m.links.iter().flatten() {
                l.abort(None);
            }
        }
    }
}

/// Element range of chunk `c` of `len` elements split `n` ways.
fn chunk(len: usize, n: usize, c: usize) -> std::ops::Range<usize> {
    let at = |c: usize| ((len as u128 * c as u128) / n as u128) as usize;
    at(c)..at(c + 1)
}

fn bytes_of(r: std::ops::Range<usize>, sz: usize) -> std::ops::Range<usize> {
    r.start * sz..r.end * sz
}

/// Whether two ranks' headers describe the same call.
fn agrees(a: &Header, b: &Header) -> bool {
    let same_len = !matches!(a.kind, Kind::AllGatherVarlen | Kind::BroadcastBytes);
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
        Kind::AllReduce => s += &format!("{} × {dtype}, {}", h.len, op_name(h.op)),
        Kind::Broadcast | Kind::BroadcastBytes => {
            s += &format!("{} × {dtype}, root {}", h.len, h.root)
        }
        Kind::AllGather | Kind::AllGatherVarlen => s += &format!("{} × {dtype}", h.len),
    }
    s += &format!(") as call #{}", h.seq);
    s
}

const _: () = assert!(HDR.is_multiple_of(8));

#[cfg(test)]
mod tests;
