//! The process group: collectives across the ranks of a job.
//!
//! # Design
//! - **Rendezvous**: rank 0 serves the [`StoreServer`] at `MASTER_ADDR:MASTER_PORT` for the
//!   group's lifetime. Every rank binds a listener on the interface that reaches the master,
//!   publishes its address and host identity (host name + boot id) in the store, and connects
//!   to every other rank (full mesh; the store's handshake proves the job token without
//!   sending it, and the links' hellos are signed by identities published in the store).
//! - **Transports**: every pair of ranks has a stream: TCP between hosts, a Unix socket in a
//!   directory only the job's user can enter between ranks of one host (another local user
//!   cannot connect to it, as they can to a port on loopback). Ranks on the same host also
//!   share a pair of memory rings (`/dev/shm`, unlinked once mapped) that carry all their data;
//!   the stream then only tells whether the peer is alive.
//! - **Protocol**: every collective starts with a 32-byte header (kind, element type, length,
//!   reduce op, root, call number) sent to every peer and checked, so mismatched calls fail with
//!   [`CommError::Mismatch`] on every rank. Small payloads travel inside that first message
//!   (one round: the latency path); large ones then use bandwidth-optimal algorithms — a
//!   direct reduce-scatter (every rank sends each rank its shard) + ring all-gather for
//!   all-reduce, a ring for all-gather, a pipelined chain for broadcast — with sends and
//!   receives to all peers overlapping in one progress loop.
//! - **Determinism**: every element of every reduction is summed **in rank order**
//!   (`x0 + x1 + … + x(n-1)`), on the small and the large path, in [`ProcessGroup::all_reduce`]
//!   and in [`ProcessGroup::reduce_scatter`] with any shard sizes, and the result is copied: all
//!   ranks get bitwise identical results, independent of buffer splits (bucket sizes, shard
//!   layouts).
//! - **Failures**: every wait has a deadline. Any error poisons the group and breaks all its
//!   links (FIN on TCP, a closed flag on the rings), so every other rank fails quickly too.
//!   A ring closed this way carries the rank that caused it, so ranks that only see the
//!   cascade still name the culprit (over TCP they name the neighbour that gave up).
//!   The collective timeout bounds each stall (no byte moved), not a whole transfer.
//!   A poisoned group can be re-formed ([`ProcessGroup::reform`]) with a process that
//!   replaces a lost rank ([`ProcessGroup::rejoin`]), as a new generation of the group.
//!
//! # Environment
//! - `DDP_TIMEOUT_SECS`, `DDP_CONNECT_TIMEOUT_SECS`, `DDP_SHARED_MEMORY=0`: defaults of
//!   [`GroupOptions`].
//! - `DDP_HOST_ID`: overrides the host identity (ranks with equal ids use shared memory);
//!   tests use it to emulate several hosts on one machine.
//! - `DDP_NODE_AWARE=0`: the flat all-reduce across hosts (see
//!   [`ProcessGroup::set_node_aware`]).
//! - `DDP_SHM_RING_KIB`: size of each shared-memory ring (default 512 KiB).
//! - `DDP_TRACE`: records a span per collective (see [`crate::trace`]).
//! - `DDP_PORT_RANGE=LO-HI`: the ports this rank's listener for its peers may take (see
//!   [`crate::port_range`]).
//! - `DDP_JOB_TOKEN`, `DDP_RANK_KEYS`: how the rank authenticates (see [`crate::job_auth`] and
//!   [`crate::env::RANK_KEYS_VAR`]).
//! - `DDP_REJOIN=1`: [`ProcessGroup::from_env`] rejoins a running group in place of a lost
//!   rank ([`ProcessGroup::rejoin`]; `ddprun --recover live` sets it).

mod algorithms;
mod compression;
mod copy;
mod direct;
mod element;
mod engine;
mod header;
mod hello_readers;
mod hierarchical;
mod leftovers;
mod link;
mod local_socket;
pub(crate) mod mesh;
pub use mesh::host_identity;
mod node_gather;
mod nodes;
mod ordered;
mod peer_stream;
mod reform;
mod rendezvous;
mod scatter;
mod shards;
mod shift;
mod shm;
pub use local_socket::remove_local_dirs_of;
pub use shm::remove_segments_of;
mod trace_hooks;

use std::time::{Duration, Instant};

use crate::env::LaunchEnv;
use crate::error::{CommError, Result};
use crate::job_auth::JobAuth;
use crate::port_range::PortRange;
use crate::store::{StoreClient, StoreServer};

pub use compression::Compression;
use engine::{HDR, Header, Kind, Msg, NODE_AWARE_OP, Op, Waiting, drive, op_code, op_name};
use link::Link;
use rendezvous::Claim;

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
    /// The ports this rank's listener for its peers may take (default: the value of
    /// `DDP_PORT_RANGE`, read when the group starts; without it, a port the kernel picks).
    pub listen_ports: Option<PortRange>,
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
            listen_ports: None,
            timeout: secs("DDP_TIMEOUT_SECS").unwrap_or(Duration::from_secs(300)),
            connect_timeout: secs("DDP_CONNECT_TIMEOUT_SECS").unwrap_or(Duration::from_secs(60)),
            shared_memory: !matches!(
                std::env::var("DDP_SHARED_MEMORY").as_deref().map(str::trim),
                Ok("0" | "false" | "no" | "off")
            ),
        }
    }
}

/// `DDP_NODE_AWARE`: unset or `1` (the default, on), `0` (off); anything else is an error.
fn node_aware_from_env() -> Result<bool> {
    match std::env::var("DDP_NODE_AWARE").as_deref().map(str::trim) {
        Err(_) | Ok("" | "1" | "true" | "on") => Ok(true),
        Ok("0" | "false" | "off") => Ok(false),
        Ok(other) => Err(CommError::InvalidArgument(format!(
            "DDP_NODE_AWARE={other:?}: expected 0 (the flat all-reduce across hosts) or 1"
        ))),
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
    /// A Unix socket (same host, shared memory off).
    LocalSocket,
    /// TCP (another host).
    Tcp,
}

/// The connections of a group of more than one rank.
struct Mesh {
    links: Vec<Option<Link>>,
    msgs: Vec<Msg>,
    scratch: Vec<u8>,
    /// The staging area of the direct reduce-scatter (8-byte aligned, so that every slot can
    /// be read as elements in place).
    stage: Vec<u64>,
    /// The 16-bit image of the buffer in a compressed all-reduce (reused between calls).
    half: Vec<u8>,
    spin: bool,
    /// The ranks grouped by host when every host's ranks are contiguous.
    nodes: Option<nodes::Nodes>,
    /// Whether large all-reduces take the node-aware path ([`ProcessGroup::set_node_aware`]).
    node_aware: bool,
    /// For each rank, whether it runs on another host than this rank.
    remote: Vec<bool>,
}

/// What a group of several ranks keeps across its generations: the store and how to reach it.
/// It outlives a mesh that broke and a re-forming that failed, so that the next
/// [`ProcessGroup::reform`] can try again.
struct Home {
    // Kept alive for the group's lifetime (rank 0 serves, everyone holds a client).
    store: StoreClient,
    _server: Option<StoreServer>,
    /// Which forming of the group the last mesh was (0: the first; see
    /// [`ProcessGroup::reform`]).
    generation: u64,
    /// The store's address (for messages).
    endpoint: String,
    /// The options the group was formed with (a re-forming uses them again).
    options: GroupOptions,
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
    /// `None` only in a group of one.
    home: Option<Home>,
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
    /// Reads the launch environment and joins the group (world size 1 when nothing is set);
    /// in a process started in place of a lost rank (`DDP_REJOIN=1`, see
    /// [`crate::env::REJOIN_VAR`]), rejoins the running group ([`ProcessGroup::rejoin`]).
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?;
        if crate::env::rejoining() {
            Self::rejoin(&env, GroupOptions::default())
        } else {
            Self::init(&env, GroupOptions::default())
        }
    }

    /// Joins the group described by `env`: rank 0 serves the store (unless the launcher does,
    /// [`crate::env::LAUNCHER_STORE_VAR`]), everyone connects.
    pub fn init(env: &LaunchEnv, opts: GroupOptions) -> Result<Self> {
        // The flight recorder (and the progress file the launcher reads) from the start: a
        // rank stuck before its first collective still reports where it is.
        ddp_doctor::publisher::start();
        if env.world_size == 1 {
            let mut pg = Self::single();
            pg.timeout = opts.timeout;
            return Ok(pg);
        }
        let mut pg = Self::start(env, opts, Claim::In(0))?;
        if let Some(h) = pg.home.as_mut() {
            crate::trace::on_group_ready(pg.rank, pg.world_size, &mut h.store);
        }
        Ok(pg)
    }

    /// Connects to the job's store (rank 0 serves it) and forms this rank's mesh, claiming its
    /// slot as `claim` says.
    fn start(env: &LaunchEnv, opts: GroupOptions, claim: Claim) -> Result<Self> {
        let _span = crate::trace::span("rendezvous", "setup").arg("world", env.world_size);
        let started = Instant::now();
        let (rank, world) = (env.rank, env.world_size);
        let mut auth = JobAuth::for_group(env)?;
        let endpoint = auth.endpoint.clone();

        // Rank 0 serves the store, unless its launcher does (`ddprun --recover live`).
        let server = if rank == 0 && !crate::env::store_served_by_launcher() {
            let server = auth.serve()?;
            server.limit_clients_to_ranks(world);
            // Only now, serving: a job that cannot bind never touches another's secret.
            auth.publish()?;
            Some(server)
        } else {
            None
        };
        let store = auth.connect(opts.connect_timeout)?;
        let timeout = opts.timeout;
        let mut home = Home {
            store,
            _server: server,
            generation: 0,
            endpoint,
            options: opts,
        };
        let mesh = rendezvous::join(rank, world, claim, &mut home, started)?;
        Ok(ProcessGroup {
            rank,
            world_size: world,
            timeout,
            seq: 0,
            poisoned: None,
            mesh: Some(mesh),
            home: Some(home),
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
            home: None,
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
                    Some(l) if l.is_local() => Transport::LocalSocket,
                    Some(_) => Transport::Tcp,
                },
            )
            .collect()
    }

    /// Bytes this rank has sent to its peers so far, over shared memory and TCP together:
    /// collective headers, payloads and padding (not the connection handshakes). 0 in a group
    /// of one. Measures what a collective costs on the wire, e.g. the halving by
    /// [`Self::all_reduce_compressed`].
    pub fn bytes_sent(&self) -> u64 {
        self.mesh
            .as_ref()
            .map_or(0, |m| m.links.iter().flatten().map(Link::bytes_sent).sum())
    }

    /// Bytes this rank has sent to ranks on other hosts so far (what crosses the network; the
    /// part of [`Self::bytes_sent`] that does not stay on this host).
    pub fn bytes_sent_across_hosts(&self) -> u64 {
        self.mesh.as_ref().map_or(0, |m| {
            m.links
                .iter()
                .zip(&m.remote)
                .filter_map(|(l, &remote)| l.as_ref().filter(|_| remote))
                .map(Link::bytes_sent)
                .sum()
        })
    }

    /// Turns the node-aware all-reduce on or off (every rank must pass the same value before
    /// its next all-reduce: a rank that differs fails it with [`CommError::Mismatch`] on every
    /// rank); returns whether it is now on.
    ///
    /// It is on by default (`DDP_NODE_AWARE=0` turns it off) and can only be on when the group
    /// spans several hosts, one of them with several ranks, and each host's ranks are
    /// contiguous (as every launcher numbers them). Then an all-reduce too large for the
    /// one-message path runs as a chain of nodes (shared memory inside a host, one partial sum
    /// per element across each node boundary) instead of the flat direct reduce-scatter and
    /// ring all-gather, whose bytes across hosts grow with the ranks per host. Either way each
    /// element is summed in rank order: the results are bitwise the same, on or off.
    pub fn set_node_aware(&mut self, on: bool) -> bool {
        self.mesh.as_mut().is_some_and(|m| {
            m.node_aware = on && m.nodes.as_ref().is_some_and(nodes::Nodes::worth_it);
            m.node_aware
        })
    }

    /// The ranks of each host, in rank order, when every host's ranks are contiguous (`None`
    /// when they interleave; one range for a group on one host or a group of one).
    pub fn hosts(&self) -> Option<Vec<std::ops::Range<usize>>> {
        match &self.mesh {
            None => Some(std::iter::once(0..self.world_size).collect()),
            Some(m) => m
                .nodes
                .as_ref()
                .map(|n| (0..n.count()).map(|j| n.ranks(j)).collect()),
        }
    }

    /// Whether large all-reduces take the node-aware path ([`Self::set_node_aware`]).
    pub fn node_aware(&self) -> bool {
        self.mesh.as_ref().is_some_and(|m| m.node_aware)
    }

    /// Whether large compressed all-reduces take the node-aware path: [`Self::node_aware`],
    /// and nodes wide enough that it sends fewer bytes across than the flat path (its partial
    /// sums cross in f32, twice the 16-bit wire: from three ranks per node on). Either
    /// way the results are bitwise the same.
    pub fn compressed_node_aware(&self) -> bool {
        self.mesh.as_ref().is_some_and(|m| {
            m.node_aware
                && m.nodes
                    .as_ref()
                    .is_some_and(nodes::Nodes::compressed_chain_pays)
        })
    }

    /// Whether large reduce-scatters take the node-aware path: [`Self::node_aware`], and
    /// nodes wide enough that its chain sends fewer bytes across than the flat path (from three
    /// ranks per node at two nodes, two at three). Either way the shards are bitwise the same.
    /// (Large all-gathers of shards take theirs whenever [`Self::node_aware`].)
    pub fn reduce_scatter_node_aware(&self) -> bool {
        self.mesh.as_ref().is_some_and(|m| {
            m.node_aware
                && m.nodes
                    .as_ref()
                    .is_some_and(nodes::Nodes::reduce_scatter_chain_pays)
        })
    }

    /// The rendezvous store client (for exchanging extra setup data, e.g. an NCCL id);
    /// `None` in a group of one.
    pub fn store(&mut self) -> Option<&mut StoreClient> {
        self.home.as_mut().map(|h| &mut h.store)
    }

    /// Reduces `buf` element-wise across ranks, in place; every rank gets the result.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let _span = self.trace_all_reduce(T::NAME, size_of_val(buf), op);
        self.collective(Call::new("all_reduce", T::NAME, buf.len()), |g, seq| {
            g.all_reduce_impl(seq, buf, op)
        })
    }

    /// [`Self::all_reduce`] of f32 values that travel as 16-bit values (`compression`), which
    /// halves the bytes sent, while every sum is accumulated in f32 and rounded once.
    ///
    /// [`Compression::None`] is exactly [`Self::all_reduce`]. With [`Compression::Bf16`] or
    /// [`Compression::Fp16`] only [`ReduceOp::Sum`] and [`ReduceOp::Mean`] are supported;
    /// another op is a [`CommError::InvalidArgument`] (which, like any failed collective,
    /// breaks the group). In a group of one `buf` is left untouched: nothing is rounded.
    /// Every rank must pass the same `compression`: a rank calling [`Self::all_reduce`] or
    /// another compression against it fails with [`CommError::Mismatch`] on every rank (the
    /// header names the compressed call and its wire type).
    ///
    /// # Algorithm
    /// `buf` is split into `world_size` chunks. Reduce-scatter: every rank sends its chunk
    /// `c`, rounded to 16 bits, straight to rank `c` (each rank sends and receives
    /// `(n-1)/n` of the buffer, as in a ring), and rank `c` adds the `n` rounded
    /// contributions — its own rounded too, so the result does not depend on which rank
    /// reduces an element — decoded in rank order into an f32 accumulator, divides it by
    /// `n` for a mean, and rounds it to 16 bits once ([`Self::reduce_scatter_compressed`]
    /// does the same with shards of any sizes and gives the same bits). All-gather: those 16-bit chunks go round
    /// the ring unchanged and every rank, the chunk's owner included, decodes the same bits,
    /// so all ranks end bitwise identical (and the fixed order makes runs reproducible).
    /// Partial sums are never rounded: a ring reduce-scatter forwarding 16-bit partial sums
    /// (as PyTorch's `bf16_compress_hook` sums in bf16) rounds at every hop, an error that
    /// grows with the world size. Small buffers (at most 64 KiB of 16-bit data per peer)
    /// travel inline in one round: every rank sends its whole rounded buffer to every peer and
    /// each reduces all `n` rounded contributions the same way.
    ///
    /// Across hosts with several ranks each, where [`Self::compressed_node_aware`] says it
    /// sends fewer bytes, the same arithmetic runs as the node-aware chain of nodes: the
    /// rounded contributions summed in rank order in f32 (the partial sums cross hosts in
    /// f32), the result rounded once on the last host and sent on as 16-bit values; the
    /// result is bitwise the flat path's.
    ///
    /// # Error bound
    /// With `u` the format's unit roundoff (2^-8 for bf16, 2^-11 for fp16), `σ` its smallest
    /// positive subnormal (2^-133, 2^-24), `x_p` rank `p`'s element, the exact result `m`
    /// (`Σ x_p`, or `Σ x_p / n` for a mean) and `A` the same of the magnitudes (`Σ |x_p|`, or
    /// `Σ |x_p| / n`), every element satisfies
    ///
    /// `|result − m| ≤ u·|m| + (1 + u)²·(u + n·2^-23)·A + (n + 1)·σ`
    ///
    /// The first term is the one final rounding; the second the rounding of each input to 16
    /// bits and the f32 accumulation, relative to `A`, not growing with `n` beyond the f32
    /// term; the third covers subnormals. Inputs exactly representable in the format drop the
    /// `u` inside the second term: `u·|m| + (1 + u)²·n·2^-23·A + (n + 1)·σ`, one rounding of
    /// the exact result up to f32 accumulation. fp16 holds magnitudes up to 65504 only: larger
    /// inputs or results become ±∞ (scale gradients first). NaN and ±∞ propagate.
    pub fn all_reduce_compressed(
        &mut self,
        buf: &mut [f32],
        op: ReduceOp,
        compression: Compression,
    ) -> Result<()> {
        let Some(h) = compression.half() else {
            return self.all_reduce(buf, op);
        };
        // Bytes on the wire: two per value.
        let _span = self
            .trace_all_reduce(compression.name(), 2 * buf.len(), op)
            .arg("wire", compression.name());
        self.collective(
            Call::new("all_reduce", compression.name(), buf.len()),
            |g, seq| {
                if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                    return Err(CommError::InvalidArgument(format!(
                        "all_reduce_compressed with {compression} supports ReduceOp::Sum and \
                     ReduceOp::Mean, not ReduceOp::{op:?} (use all_reduce)"
                    )));
                }
                g.all_reduce_compressed_impl(seq, buf, op, h)
            },
        )
    }

    /// Copies `root`'s `buf` into every rank's `buf` (lengths must match).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        let _span = self.trace_op("broadcast", T::NAME, Some(size_of_val(buf)), Some(root));
        self.collective(Call::new("broadcast", T::NAME, buf.len()), |g, seq| {
            g.check_root(root)?;
            let hdr = g.header::<T>(Kind::Broadcast, seq, buf.len(), root, 0);
            g.broadcast_impl(hdr, bytemuck::cast_slice_mut(buf), root)
        })
    }

    /// Gathers equal-length `input`s from every rank into `output` (`len = input.len() *
    /// world_size`), rank order.
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        let _span = self.trace_op("all_gather", T::NAME, Some(size_of_val(input)), None);
        self.collective(Call::new("all_gather", T::NAME, input.len()), |g, seq| {
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
        let _span = self.trace_op("all_gather_varlen", T::NAME, Some(size_of_val(input)), None);
        self.collective(
            Call::new("all_gather_varlen", T::NAME, input.len()),
            |g, seq| {
                if g.world_size == 1 {
                    return Ok(vec![input.to_vec()]);
                }
                let hdr = g.header::<T>(Kind::AllGatherVarlen, seq, input.len(), 0, 0);
                g.all_gather_varlen_impl(hdr, input)
            },
        )
    }

    /// Broadcasts a byte message of any length from `root` (others' `bytes` are replaced).
    pub fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        let _span = self.trace_broadcast_bytes(bytes.len(), root);
        self.collective(Call::new("broadcast_bytes", "u8", bytes.len()), |g, seq| {
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

    /// Sends `input` (any length) to the next rank (`rank + 1`, modulo the world size) and
    /// receives the previous rank's into `out` (replaced; its allocation is kept when the
    /// length is unchanged, so a buffer handed back each call is not faulted in again). Every
    /// rank moves its own message once, point to point (a message of 64 KiB or less rides in
    /// the header exchange, which reaches every rank). In a world of one `out` becomes a copy
    /// of `input`.
    pub fn shift_bytes(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let _span = self.trace_op("shift_bytes", "u8", Some(input.len()), None);
        self.collective(Call::new("shift_bytes", "u8", input.len()), |g, seq| {
            if g.world_size == 1 {
                out.clear();
                out.extend_from_slice(input);
                return Ok(());
            }
            let hdr = g.header::<u8>(Kind::ShiftBytes, seq, input.len(), 0, 0);
            g.shift_bytes_impl(hdr, input, out)
        })
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        let _span = self.trace_op("barrier", "-", None, None);
        self.collective(Call::new("barrier", "-", 0), |g, seq| {
            if g.world_size == 1 {
                return Ok(());
            }
            let hdr = g.header::<u8>(Kind::Barrier, seq, 0, 0, 0);
            g.exchange(&hdr, &[])
        })
    }

    // ---------------------------------------------------------------------------------------

    /// Runs one collective: refuses on a poisoned group, numbers the call, notes it in the
    /// flight recorder ([`ddp_doctor::recorder`]) from its issue to its end, poisons on error.
    fn collective<R>(
        &mut self,
        call: Call,
        f: impl FnOnce(&mut Self, u64) -> Result<R>,
    ) -> Result<R> {
        if let Some(why) = &self.poisoned {
            return Err(CommError::Poisoned(why.clone()));
        }
        if self.world_size > 1 && self.mesh.is_none() {
            return Err(CommError::Poisoned(
                "the group has no connections (it was never re-formed after a lost rank)".into(),
            ));
        }
        self.seq += 1;
        let seq = self.seq;
        let ticket = ddp_doctor::recorder::issue("host", call.op, call.dtype, call.count, seq);
        let result = f(self, seq);
        if let Some(t) = ticket {
            ddp_doctor::recorder::finish(t, result.is_err());
        }
        result.inspect_err(|e| self.poison(e))
    }

    /// Breaks the group after `err`: later calls fail, and every link is shut so peers fail
    /// quickly instead of waiting for their timeout.
    fn poison(&mut self, err: &CommError) {
        tracing::error!(rank = self.rank, "process group broken: {err}");
        self.poisoned = Some(err.to_string());
        let blame = err.peer();
        if let Some(peer) = blame {
            // This rank fails on a peer's failure: the launcher names the peer's instead. A
            // peer waited for past the deadline may be alive and hung: the launcher under live
            // recovery kills it, so that it is replaced.
            if matches!(err, CommError::Timeout { .. }) {
                crate::failure_note::note_peer_hung(peer, &err.to_string());
            } else {
                crate::failure_note::note_peer_failure(peer, &err.to_string());
            }
        }
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
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if let Some(m) = &self.mesh {
            for l in m.links.iter().flatten() {
                l.abort(None);
            }
        }
        crate::trace::flush_best_effort();
    }
}

/// What the flight recorder notes of a collective call: the operation, the element type and
/// this rank's element count.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    op: &'static str,
    dtype: &'static str,
    count: usize,
}

impl Call {
    pub(crate) fn new(op: &'static str, dtype: &'static str, count: usize) -> Self {
        Call { op, dtype, count }
    }
}

const _: () = assert!(HDR.is_multiple_of(8));

#[cfg(test)]
pub(crate) mod tests;
