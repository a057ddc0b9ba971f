//! The process group: collectives across the ranks of a job.
//!
//! API CONTRACT (implementation pending — owner: collectives helper).

use std::time::Duration;

use crate::env::LaunchEnv;
use crate::error::Result;

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
#[derive(Debug, Clone)]
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
    fn default() -> Self {
        GroupOptions {
            timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(60),
            shared_memory: true,
        }
    }
}

/// A group of rank processes that run collectives together.
///
/// Collectives are called by every rank in the same order with matching arguments. Any error
/// (a dead or stalled peer, a mismatch) breaks the group on every rank; later calls return
/// [`crate::CommError::Poisoned`].
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
}

impl ProcessGroup {
    /// Reads the launch environment and joins the group (world size 1 when nothing is set).
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?;
        Self::init(&env, GroupOptions::default())
    }

    /// Joins the group described by `env`: rank 0 serves the store, everyone connects.
    pub fn init(env: &LaunchEnv, opts: GroupOptions) -> Result<Self> {
        let _ = opts;
        if env.world_size == 1 {
            return Ok(Self::single());
        }
        unimplemented!("process group")
    }

    /// A group of one: every collective is a no-op copy.
    pub fn single() -> Self {
        ProcessGroup {
            rank: 0,
            world_size: 1,
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
        let _ = timeout;
    }

    /// Reduces `buf` element-wise across ranks, in place; every rank gets the result.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let _ = (buf, op);
        if self.world_size == 1 {
            return Ok(());
        }
        unimplemented!("all_reduce")
    }

    /// Copies `root`'s `buf` into every rank's `buf` (lengths must match).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        let _ = (buf, root);
        unimplemented!("broadcast")
    }

    /// Gathers equal-length `input`s from every rank into `output` (`len = input.len() *
    /// world_size`), rank order.
    pub fn all_gather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        let _ = (input, output);
        unimplemented!("all_gather")
    }

    /// Gathers `input`s of any lengths from every rank, rank order.
    pub fn all_gather_varlen<T: Element>(&mut self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let _ = input;
        unimplemented!("all_gather_varlen")
    }

    /// Broadcasts a byte message of any length from `root` (others' `bytes` are replaced).
    pub fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        let _ = (bytes, root);
        unimplemented!("broadcast_bytes")
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        unimplemented!("barrier")
    }
}
