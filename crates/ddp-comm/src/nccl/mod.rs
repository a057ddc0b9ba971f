//! Collectives on NVIDIA GPU memory through NCCL (feature `nccl`).
//!
//! [`NcclGroup`] is one NCCL communicator per rank process, on the CUDA device `LOCAL_RANK`
//! (or [`NcclOptions::device`]). It runs all-reduce (sum, mean, max, min), broadcast,
//! all-gather and barrier on device buffers — cudarc's [`CudaSlice`], [`CudaView`] /
//! [`CudaViewMut`], or raw device pointers for memory owned by another library — and offers
//! host-slice helpers that stage through the device.
//!
//! - **Rendezvous**: rank 0 asks NCCL for a unique id and publishes it in the job's
//!   rendezvous store ([`crate::store`]); the other ranks read it ([`rendezvous`]).
//! - **No hangs**: communicators are created in NCCL's non-blocking mode and every call polls
//!   for completion with the group's timeout while watching NCCL's asynchronous errors
//!   (`ncclCommGetAsyncError`). A dead or stalled peer therefore gives a
//!   [`CommError::Timeout`] (or NCCL's remote error) instead of a hang; the communicator is
//!   then aborted (`ncclCommAbort`) and the group is broken: later calls return
//!   [`CommError::Poisoned`]. Errors map to the same [`CommError`] the TCP transport uses.
//! - **No panics on machines without CUDA**: cudarc loads `libcuda`/`libnccl` at run time
//!   and panics when they are missing, so every constructor first calls [`check_libraries`]
//!   and returns `libcuda not found …` / `libnccl not found …` errors. See [`library`] for
//!   where the libraries are searched (and the `libnccl.so` link that pip's NCCL needs).
//!
//! Every rank must call the collectives in the same order with matching lengths, as with the
//! TCP [`crate::ProcessGroup`].
//!
//! ```no_run
//! use std::time::Duration;
//! use ddp_comm::{LaunchEnv, ProcessGroup, GroupOptions, ReduceOp, StoreClient};
//! use ddp_comm::nccl::{NcclGroup, NcclOptions};
//! # fn main() -> Result<(), ddp_comm::CommError> {
//! let env = LaunchEnv::from_env()?;
//! // The TCP group serves the rendezvous store on rank 0; NCCL shares its id through it.
//! let _pg = ProcessGroup::init(&env, GroupOptions::default())?;
//! let mut nccl = NcclGroup::connect(&env, &NcclOptions::default())?;
//!
//! let stream = nccl.stream().clone();
//! let mut grads = stream.clone_htod(&vec![1.0f32; 1 << 20]).unwrap();
//! nccl.all_reduce(&mut grads, ReduceOp::Mean)?;
//!
//! let mut host = vec![env.rank as f64; 4];
//! nccl.all_reduce_host(&mut host, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```

mod comm;
mod device;
pub mod library;
pub mod rendezvous;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nccl::NcclType;
use cudarc::nccl::sys::{self, ncclComm_t, ncclRedOp_t, ncclResult_t};

/// The cudarc this transport is built on, so callers allocate buffers with the same version.
pub use cudarc;
pub use cudarc::driver::{CudaView, CudaViewMut};
pub use device::{check_cuda_device, cuda_device_for_local_rank, visible_cuda_devices};
pub use library::{Libraries, MIN_NCCL_VERSION, NcclVersion, check_libraries};

use self::comm::{InitFailure, RawComm, cuda_error};
use crate::env::LaunchEnv;
use crate::error::{CommError, Result};
use crate::group::{GroupOptions, ReduceOp};
use crate::store::StoreClient;

/// The variable that overrides the default collective timeout, in seconds (shared with the TCP
/// process group).
pub const TIMEOUT_VAR: &str = "DDP_TIMEOUT_SECS";

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL moves and reduces on the device: `f32`, `f64`, `i32`, `i64`, `u8`.
pub trait NcclElement:
    NcclType + DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + fmt::Debug + 'static + sealed::Sealed
{
    /// A short name for messages ("f32", …).
    const NAME: &'static str;
}

macro_rules! nccl_element {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl NcclElement for $t {
            const NAME: &'static str = stringify!($t);
        }
    )*};
}
nccl_element!(f32, f64, i32, i64, u8);

/// Enqueues one in-place `ncclAllReduce` of `len` elements at `ptr` on stream `s`.
///
/// # Safety
/// `ptr` must address `len` elements of `T` in device memory of `comm`'s device, valid until
/// the reduction has run.
unsafe fn enqueue_all_reduce_in_place<T: NcclElement>(
    ptr: cudarc::driver::sys::CUdeviceptr,
    len: usize,
    op: ReduceOp,
    comm: ncclComm_t,
    s: sys::cudaStream_t,
) -> ncclResult_t {
    // SAFETY: per this function's contract.
    unsafe {
        sys::ncclAllReduce(
            ptr as *const _,
            ptr as *mut _,
            len,
            T::as_nccl_type(),
            nccl_op(op),
            comm,
            s,
        )
    }
}

/// NCCL's operation for a [`ReduceOp`]. `Mean` is `ncclAvg`: for floats a pre-multiplied sum,
/// for integers a sum followed by an integer division (truncating, like Rust's `/`).
fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Mean => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

/// Settings for [`NcclGroup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOptions {
    /// Deadline of every collective (default 300 s, like the TCP group).
    pub timeout: Duration,
    /// Deadline for the rendezvous and the communicator's creation, i.e. for every rank to
    /// arrive (default 120 s).
    pub init_timeout: Duration,
    /// CUDA device ordinal; `None` uses `LOCAL_RANK` (device 0 for [`NcclGroup::single`]),
    /// or device 0 when the rank sees exactly one device (`CUDA_VISIBLE_DEVICES` set per rank).
    pub device: Option<usize>,
    /// Prefix of the rendezvous store keys (default `nccl`); groups created in the same order
    /// on every rank may share it.
    pub store_prefix: String,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(300),
            init_timeout: Duration::from_secs(120),
            device: None,
            store_prefix: "nccl".into(),
        }
    }
}

impl NcclOptions {
    /// The defaults, with the collective timeout read from `DDP_TIMEOUT_SECS` when set.
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] naming the variable when it is not a positive integer.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`NcclOptions::from_env`] with variables from `lookup` (for tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut opts = NcclOptions::default();
        if let Some(v) = lookup(TIMEOUT_VAR) {
            let secs: u64 = v.trim().parse().ok().filter(|s| *s > 0).ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "environment variable {TIMEOUT_VAR}={v:?} is not a positive number of seconds"
                ))
            })?;
            opts.timeout = Duration::from_secs(secs);
        }
        Ok(opts)
    }
}

impl From<&GroupOptions> for NcclOptions {
    /// The TCP group's deadlines: `timeout` for collectives, `connect_timeout` for creation.
    fn from(g: &GroupOptions) -> Self {
        NcclOptions {
            timeout: g.timeout,
            init_timeout: g.connect_timeout,
            ..NcclOptions::default()
        }
    }
}

/// One rank's NCCL communicator, its CUDA stream and a watchdog deadline for every call.
///
/// Collectives take `&mut self`: one call at a time, each returning once its result is in
/// the buffer (the stream is idle again). Device buffers must live on this group's device;
/// work queued on them on other cudarc streams is waited for (cudarc's event tracking).
pub struct NcclGroup {
    // Field order is drop order: the communicator goes before the memory and the stream.
    comm: RawComm,
    scratch: CudaSlice<f32>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    rank: usize,
    world_size: usize,
    device: usize,
    timeout: Duration,
    version: NcclVersion,
    broken: Option<String>,
}

impl fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .field("nccl", &self.version.to_string())
            .field("timeout", &self.timeout)
            .field("broken", &self.broken)
            .finish()
    }
}

// A group may be moved to (and used from) another thread, e.g. behind a `Mutex`.
const _: () = {
    fn assert_send<T: Send>() {}
    let _ = assert_send::<NcclGroup>;
};

/// Which CUDA device a rank uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeviceChoice {
    /// Set in [`NcclOptions::device`].
    Explicit(usize),
    /// `LOCAL_RANK`, unless exactly one device is visible (a launcher that gives each rank
    /// its own GPU through `CUDA_VISIBLE_DEVICES`, e.g. `srun --gpus-per-task=1`): then 0.
    LocalRank(usize),
}

impl DeviceChoice {
    fn from_options(opts: &NcclOptions, local_rank: usize) -> Self {
        match opts.device {
            Some(d) => DeviceChoice::Explicit(d),
            None => DeviceChoice::LocalRank(local_rank),
        }
    }

    fn resolve(self, visible: usize) -> Result<usize> {
        match self {
            DeviceChoice::Explicit(d) if d < visible => Ok(d),
            DeviceChoice::Explicit(d) => Err(CommError::InvalidArgument(format!(
                "CUDA device {d} requested (NcclOptions::device) but only {visible} device(s) \
                 are visible (CUDA_VISIBLE_DEVICES={})",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
            ))),
            // Only this rank's own device is checked here; `cuda_device_for_local_rank`
            // checks the whole node before any work starts.
            DeviceChoice::LocalRank(r) => device::device_for_local_rank(r, r + 1, visible),
        }
    }
}

/// Where a new group's unique id comes from.
enum IdSource<'a> {
    /// Made locally (world size 1).
    Local,
    /// Exchanged through the rendezvous store.
    Store(&'a mut StoreClient),
}

impl NcclGroup {
    /// Joins the NCCL group of the job described by `env`, sharing the unique id through
    /// `store` (a client of the job's rendezvous store: `StoreClient::connect(
    /// &env.master_endpoint(), env.job_token.as_deref(), …)`).
    ///
    /// Every rank must call it; it returns once all `WORLD_SIZE` ranks have joined, or fails
    /// after [`NcclOptions::init_timeout`] with a [`CommError::Timeout`] naming a rank that
    /// never arrived.
    ///
    /// # Errors
    /// Missing libraries (see [`check_libraries`]), a device ordinal beyond the visible
    /// devices, store errors, NCCL errors, the timeout above.
    pub fn init(env: &LaunchEnv, store: &mut StoreClient, opts: &NcclOptions) -> Result<Self> {
        Self::create(
            env.rank,
            env.world_size,
            DeviceChoice::from_options(opts, env.local_rank),
            IdSource::Store(store),
            opts,
        )
    }

    /// Like [`NcclGroup::init`], connecting its own client to the job's store at
    /// `MASTER_ADDR:MASTER_PORT` with the job token. The store must be served already —
    /// [`crate::ProcessGroup::init`] serves it on rank 0. A world of one needs no store.
    pub fn connect(env: &LaunchEnv, opts: &NcclOptions) -> Result<Self> {
        // Check first: a machine without CUDA should hear about that, not about the store.
        check_libraries()?;
        if env.world_size == 1 {
            return Self::create(
                0,
                1,
                DeviceChoice::from_options(opts, env.local_rank),
                IdSource::Local,
                opts,
            );
        }
        let mut store = StoreClient::connect(
            &env.master_endpoint(),
            env.job_token.as_deref(),
            opts.init_timeout,
        )?;
        Self::init(env, &mut store, opts)
    }

    /// A group of one rank on device [`NcclOptions::device`] (default 0), without a store.
    /// Its collectives are real NCCL calls on the device (the results equal the inputs).
    pub fn single(opts: &NcclOptions) -> Result<Self> {
        Self::create(
            0,
            1,
            DeviceChoice::from_options(opts, 0),
            IdSource::Local,
            opts,
        )
    }

    fn create(
        rank: usize,
        world_size: usize,
        device: DeviceChoice,
        ids: IdSource<'_>,
        opts: &NcclOptions,
    ) -> Result<Self> {
        let libs = check_libraries()?;
        if world_size == 0 || rank >= world_size {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank} is out of range for a world of {world_size}"
            )));
        }
        let device = device.resolve(visible_cuda_devices()?)?;
        let ctx = CudaContext::new(device)
            .map_err(|e| cuda_error(&format!("creating a context on device {device}"), e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error("creating a stream", e))?;
        let scratch = stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| cuda_error("allocating the barrier buffer", e))?;

        let start = Instant::now();
        let make_id = || -> Result<[u8; rendezvous::ID_BYTES]> {
            let id = cudarc::nccl::Id::new()
                .map_err(|e| comm::nccl_error("ncclGetUniqueId", e.0, Duration::ZERO))?;
            Ok(id.internal().map(|c| c as u8))
        };
        let (id, mut store, generation) = match ids {
            IdSource::Local => (make_id()?, None, 0),
            IdSource::Store(store) => {
                let ex = rendezvous::exchange_unique_id(
                    store,
                    &opts.store_prefix,
                    rank,
                    world_size,
                    opts.init_timeout,
                    make_id,
                )?;
                (ex.id, Some(store), ex.generation)
            }
        };

        ctx.bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        let deadline = start + opts.init_timeout;
        let comm = match RawComm::init(&id, rank, world_size, deadline) {
            Ok(c) => c,
            Err(InitFailure::Error(e)) => return Err(e),
            Err(InitFailure::TimedOut(after)) => {
                let missing: Vec<usize> = match store.as_mut() {
                    Some(s) => {
                        rendezvous::missing_ranks(s, &opts.store_prefix, generation, world_size)
                    }
                    None => Vec::new(),
                };
                let detail = if missing.is_empty() {
                    "every rank reached the rendezvous; one of them is stuck in NCCL's setup \
                     (network: check NCCL_SOCKET_IFNAME; run with NCCL_DEBUG=INFO)"
                        .to_string()
                } else {
                    format!("rank(s) {missing:?} never reached the rendezvous")
                };
                return Err(CommError::Timeout {
                    op: format!(
                        "creating the NCCL communicator of {world_size} ranks on device {device} \
                         ({detail})"
                    ),
                    peer: missing.first().copied(),
                    after,
                });
            }
        };
        tracing::info!(
            rank,
            world_size,
            device,
            nccl = %libs.nccl_version,
            took_ms = start.elapsed().as_millis() as u64,
            "NCCL communicator ready"
        );
        Ok(NcclGroup {
            comm,
            scratch,
            stream,
            ctx,
            rank,
            world_size,
            device,
            timeout: opts.timeout,
            version: libs.nccl_version,
            broken: None,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The CUDA device ordinal this group runs on.
    pub fn device_ordinal(&self) -> usize {
        self.device
    }

    /// The stream the collectives run on (allocate and copy buffers with it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context (the device's primary context, shared with other libraries).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The loaded NCCL library's version.
    pub fn nccl_version(&self) -> NcclVersion {
        self.version
    }

    /// The deadline of each collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the deadline of later collectives.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Why the group is broken, if an earlier call failed or [`NcclGroup::abort`] was called.
    pub fn broken_reason(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Aborts the communicator (`ncclCommAbort`); later calls return [`CommError::Poisoned`].
    /// Use it to stop collectives on this rank when another part of the job failed.
    pub fn abort(&mut self) {
        self.comm.abort();
        if self.broken.is_none() {
            self.broken = Some("the NCCL communicator was aborted by the caller".into());
        }
    }

    fn usable(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(CommError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    fn check_buffer(&self, stream: &Arc<CudaStream>, what: &str) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(CommError::InvalidArgument(format!(
                "{what}: the buffer lives on CUDA device {} but this NCCL group runs on device {}",
                stream.context().ordinal(),
                self.device
            )));
        }
        Ok(())
    }

    fn check_root(&self, root: usize, what: &str) -> Result<()> {
        if root >= self.world_size {
            return Err(CommError::InvalidArgument(format!(
                "{what}: root rank {root} is out of range for a world of {}",
                self.world_size
            )));
        }
        Ok(())
    }

    /// Runs one NCCL call on the group's stream and waits for it under the watchdog. Any
    /// failure aborts the communicator and breaks the group.
    fn collective(
        &mut self,
        what: &str,
        call: impl FnOnce(ncclComm_t, sys::cudaStream_t) -> ncclResult_t,
    ) -> Result<()> {
        self.usable()?;
        let start = Instant::now();
        let deadline = start + self.timeout;
        let result = self.run_and_wait(what, start, deadline, call);
        if let Err(e) = &result {
            self.comm.abort();
            self.broken = Some(format!("rank {}: {e}", self.rank));
            tracing::error!(
                rank = self.rank,
                "NCCL {what} failed, communicator aborted: {e}"
            );
        }
        result
    }

    fn run_and_wait(
        &mut self,
        what: &str,
        start: Instant,
        deadline: Instant,
        call: impl FnOnce(ncclComm_t, sys::cudaStream_t) -> ncclResult_t,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        let raw_stream = self.stream.cu_stream() as sys::cudaStream_t;
        self.comm
            .enqueue(what, deadline, start, |c| call(c, raw_stream))?;
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_error(&format!("recording an event after {what}"), e))?;
        self.comm.wait_event(&event, what, deadline, start)?;
        self.ctx
            .check_err()
            .map_err(|e| cuda_error(&format!("after {what}"), e))
    }

    /// Reduces `buf` element-wise across ranks, in place; every rank gets the result.
    pub fn all_reduce<T: NcclElement, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_buffer(buf.stream(), "all_reduce")?;
        let len = buf.len();
        let stream = Arc::clone(&self.stream);
        let (ptr, _record) = buf.device_ptr_mut(&stream);
        let what = format!("all_reduce({op:?}, {len} x {})", T::NAME);
        self.collective(&what, |comm, s| {
            // SAFETY: `ptr` holds `len` elements of T on this group's device; the buffer is
            // borrowed mutably until the call completed (collective waits).
            unsafe { enqueue_all_reduce_in_place::<T>(ptr, len, op, comm, s) }
        })
    }

    /// Reduces `input` across ranks into `output` (same length), leaving `input` unchanged.
    pub fn all_reduce_into<T: NcclElement, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        input: &S,
        output: &mut R,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_buffer(input.stream(), "all_reduce_into (input)")?;
        self.check_buffer(output.stream(), "all_reduce_into (output)")?;
        let len = input.len();
        if output.len() != len {
            return Err(CommError::InvalidArgument(format!(
                "all_reduce_into: output holds {} elements but input holds {len}",
                output.len()
            )));
        }
        let stream = Arc::clone(&self.stream);
        let (src, _read) = input.device_ptr(&stream);
        let (dst, _write) = output.device_ptr_mut(&stream);
        let what = format!("all_reduce({op:?}, {len} x {})", T::NAME);
        self.collective(&what, |comm, s| {
            // SAFETY: both pointers hold `len` elements on this device, borrowed for the call.
            unsafe {
                sys::ncclAllReduce(
                    src as *const _,
                    dst as *mut _,
                    len,
                    T::as_nccl_type(),
                    nccl_op(op),
                    comm,
                    s,
                )
            }
        })
    }

    /// Copies `root`'s `buf` into every rank's `buf` (lengths must match on every rank).
    pub fn broadcast<T: NcclElement, B: DevicePtrMut<T>>(
        &mut self,
        buf: &mut B,
        root: usize,
    ) -> Result<()> {
        self.check_root(root, "broadcast")?;
        self.check_buffer(buf.stream(), "broadcast")?;
        let len = buf.len();
        let stream = Arc::clone(&self.stream);
        let (ptr, _record) = buf.device_ptr_mut(&stream);
        let what = format!("broadcast(root {root}, {len} x {})", T::NAME);
        self.collective(&what, |comm, s| {
            // SAFETY: `ptr` holds `len` elements on this device, borrowed for the call.
            unsafe {
                sys::ncclBroadcast(
                    ptr as *const _,
                    ptr as *mut _,
                    len,
                    T::as_nccl_type(),
                    root as std::ffi::c_int,
                    comm,
                    s,
                )
            }
        })
    }

    /// Gathers equal-length `input`s from every rank into `output`
    /// (`output.len() == input.len() * world_size`), in rank order.
    pub fn all_gather<T: NcclElement, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        input: &S,
        output: &mut R,
    ) -> Result<()> {
        self.check_buffer(input.stream(), "all_gather (input)")?;
        self.check_buffer(output.stream(), "all_gather (output)")?;
        let len = input.len();
        let want = len.checked_mul(self.world_size).ok_or_else(|| {
            CommError::InvalidArgument("all_gather: output length overflows".into())
        })?;
        if output.len() != want {
            return Err(CommError::InvalidArgument(format!(
                "all_gather: output holds {} elements but input ({len}) x world size ({}) = {want}",
                output.len(),
                self.world_size
            )));
        }
        let stream = Arc::clone(&self.stream);
        let (src, _read) = input.device_ptr(&stream);
        let (dst, _write) = output.device_ptr_mut(&stream);
        let what = format!("all_gather({len} x {} per rank)", T::NAME);
        self.collective(&what, |comm, s| {
            // SAFETY: `src` holds `len`, `dst` holds `len * world_size` elements on this
            // device, both borrowed for the call.
            unsafe {
                sys::ncclAllGather(
                    src as *const _,
                    dst as *mut _,
                    len,
                    T::as_nccl_type(),
                    comm,
                    s,
                )
            }
        })
    }

    /// Returns once every rank has called it (a one-element all-reduce on the device).
    pub fn barrier(&mut self) -> Result<()> {
        let stream = Arc::clone(&self.stream);
        let ptr = {
            let (ptr, _record) = self.scratch.device_ptr_mut(&stream);
            ptr
        };
        self.collective("barrier", |comm, s| {
            // SAFETY: the group's own one-element scratch buffer on this device.
            unsafe {
                sys::ncclAllReduce(
                    ptr as *const _,
                    ptr as *mut _,
                    1,
                    sys::ncclDataType_t::ncclFloat32,
                    ncclRedOp_t::ncclSum,
                    comm,
                    s,
                )
            }
        })
    }

    /// Makes the group's stream wait for the work queued so far on `other` (a stream of
    /// another library on the same device, e.g. the one that computed gradients), without
    /// blocking the host.
    ///
    /// # Safety
    /// `other` must be a valid stream of this group's CUDA context (or NULL, the legacy
    /// default stream).
    pub unsafe fn wait_for_stream(&self, other: cudarc::driver::sys::CUstream) -> Result<()> {
        let event = self
            .ctx
            .new_event(None)
            .map_err(|e| cuda_error("creating an event", e))?;
        // SAFETY: the event is live; `other` is valid per the caller.
        unsafe { cudarc::driver::result::event::record(event.cu_event(), other) }
            .map_err(|e| cuda_error("recording an event on the foreign stream", e))?;
        self.stream
            .wait(&event)
            .map_err(|e| cuda_error("waiting for the foreign stream", e))
    }

    /// [`NcclGroup::all_reduce`] on memory owned elsewhere (e.g. a Burn/CubeCL CUDA tensor).
    ///
    /// # Safety
    /// `ptr` must address `len` elements of `T` in device memory of this group's device, stay
    /// valid and untouched by other work until this returns, and hold its final input: work on
    /// other streams that writes it must be finished or ordered before this group's stream
    /// (see [`NcclGroup::wait_for_stream`]).
    pub unsafe fn all_reduce_raw<T: NcclElement>(
        &mut self,
        ptr: cudarc::driver::sys::CUdeviceptr,
        len: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let what = format!("all_reduce({op:?}, {len} x {} raw)", T::NAME);
        self.collective(&what, |comm, s| {
            // SAFETY: per this function's contract.
            unsafe { enqueue_all_reduce_in_place::<T>(ptr, len, op, comm, s) }
        })
    }

    /// [`NcclGroup::all_reduce_raw`] over several buffers at once: one NCCL group call
    /// (`ncclGroupStart` … `ncclGroupEnd`), so NCCL runs the reductions back to back on its
    /// stream and the host waits once for all of them. Every rank must pass the same number of
    /// buffers with the same lengths, in the same order. No buffers: returns at once.
    ///
    /// # Safety
    /// As for [`NcclGroup::all_reduce_raw`], for every `(pointer, length)` pair; the buffers
    /// must not overlap.
    pub unsafe fn all_reduce_many_raw<T: NcclElement>(
        &mut self,
        buffers: &[(cudarc::driver::sys::CUdeviceptr, usize)],
        op: ReduceOp,
    ) -> Result<()> {
        if buffers.is_empty() {
            return Ok(());
        }
        let total: usize = buffers.iter().map(|&(_, len)| len).sum();
        let what = format!(
            "all_reduce({op:?}, {} buffers, {total} x {} raw)",
            buffers.len(),
            T::NAME
        );
        self.collective(&what, |comm, s| {
            // SAFETY: per this function's contract; every call between start and end is
            // deferred to `ncclGroupEnd`, which is always reached once the group started.
            unsafe {
                let started = sys::ncclGroupStart();
                if started != ncclResult_t::ncclSuccess {
                    return started;
                }
                let mut first_error = ncclResult_t::ncclSuccess;
                for &(ptr, len) in buffers {
                    let r = enqueue_all_reduce_in_place::<T>(ptr, len, op, comm, s);
                    let failed =
                        !matches!(r, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress);
                    if failed && first_error == ncclResult_t::ncclSuccess {
                        first_error = r;
                    }
                }
                let ended = sys::ncclGroupEnd();
                if first_error != ncclResult_t::ncclSuccess {
                    first_error
                } else {
                    ended
                }
            }
        })
    }

    /// [`NcclGroup::broadcast`] on memory owned elsewhere.
    ///
    /// # Safety
    /// As for [`NcclGroup::all_reduce_raw`].
    pub unsafe fn broadcast_raw<T: NcclElement>(
        &mut self,
        ptr: cudarc::driver::sys::CUdeviceptr,
        len: usize,
        root: usize,
    ) -> Result<()> {
        self.check_root(root, "broadcast")?;
        let what = format!("broadcast(root {root}, {len} x {} raw)", T::NAME);
        self.collective(&what, |comm, s| {
            // SAFETY: per this function's contract.
            unsafe {
                sys::ncclBroadcast(
                    ptr as *const _,
                    ptr as *mut _,
                    len,
                    T::as_nccl_type(),
                    root as std::ffi::c_int,
                    comm,
                    s,
                )
            }
        })
    }

    /// [`NcclGroup::all_gather`] on memory owned elsewhere: `input` holds `len` elements,
    /// `output` `len * world_size`.
    ///
    /// # Safety
    /// As for [`NcclGroup::all_reduce_raw`], for both pointers; they must not overlap unless
    /// `input` is this rank's slot of `output` (NCCL's in-place all-gather).
    pub unsafe fn all_gather_raw<T: NcclElement>(
        &mut self,
        input: cudarc::driver::sys::CUdeviceptr,
        len: usize,
        output: cudarc::driver::sys::CUdeviceptr,
    ) -> Result<()> {
        let what = format!("all_gather({len} x {} per rank, raw)", T::NAME);
        self.collective(&what, |comm, s| {
            // SAFETY: per this function's contract.
            unsafe {
                sys::ncclAllGather(
                    input as *const _,
                    output as *mut _,
                    len,
                    T::as_nccl_type(),
                    comm,
                    s,
                )
            }
        })
    }

    /// [`NcclGroup::all_reduce`] on a host slice, staged through device memory.
    /// An empty slice returns at once (it must be empty on every rank).
    pub fn all_reduce_host<T: NcclElement>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.usable()?;
        if buf.is_empty() {
            return Ok(());
        }
        let stream = Arc::clone(&self.stream);
        let mut dev = stream
            .clone_htod(buf)
            .map_err(|e| cuda_error("copying to the device", e))?;
        self.all_reduce(&mut dev, op)?;
        self.copy_back(&dev, buf)
    }

    /// [`NcclGroup::broadcast`] on a host slice, staged through device memory.
    pub fn broadcast_host<T: NcclElement>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        self.usable()?;
        self.check_root(root, "broadcast")?;
        if buf.is_empty() {
            return Ok(());
        }
        let stream = Arc::clone(&self.stream);
        let mut dev = stream
            .clone_htod(buf)
            .map_err(|e| cuda_error("copying to the device", e))?;
        self.broadcast(&mut dev, root)?;
        self.copy_back(&dev, buf)
    }

    /// [`NcclGroup::all_gather`] on host slices (`output.len() == input.len() * world_size`),
    /// staged through device memory.
    pub fn all_gather_host<T: NcclElement>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.usable()?;
        if output.len() != input.len().saturating_mul(self.world_size) {
            return Err(CommError::InvalidArgument(format!(
                "all_gather: output holds {} elements but input ({}) x world size ({}) = {}",
                output.len(),
                input.len(),
                self.world_size,
                input.len().saturating_mul(self.world_size)
            )));
        }
        if input.is_empty() {
            return Ok(());
        }
        let stream = Arc::clone(&self.stream);
        let dev_in = stream
            .clone_htod(input)
            .map_err(|e| cuda_error("copying to the device", e))?;
        let mut dev_out = stream
            .alloc_zeros::<T>(output.len())
            .map_err(|e| cuda_error("allocating the gather buffer", e))?;
        self.all_gather(&dev_in, &mut dev_out)?;
        self.copy_back(&dev_out, output)
    }

    fn copy_back<T: NcclElement>(&mut self, dev: &CudaSlice<T>, host: &mut [T]) -> Result<()> {
        // The collective has completed, so this synchronous copy cannot wait on a peer.
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| cuda_error("copying back to the host", e))?;
        self.ctx
            .check_err()
            .map_err(|e| cuda_error("copying back to the host", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_from_env_read_the_timeout_and_reject_bad_values() {
        let o = NcclOptions::from_lookup(|_| None).unwrap();
        assert_eq!(o, NcclOptions::default());
        let o = NcclOptions::from_lookup(|k| (k == TIMEOUT_VAR).then(|| "42".into())).unwrap();
        assert_eq!(o.timeout, Duration::from_secs(42));
        for bad in ["0", "-3", "ten", ""] {
            let err =
                NcclOptions::from_lookup(|k| (k == TIMEOUT_VAR).then(|| bad.into())).unwrap_err();
            assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
            assert!(err.to_string().contains(TIMEOUT_VAR), "{err}");
        }
    }

    #[test]
    fn options_follow_the_tcp_group_deadlines() {
        let g = GroupOptions {
            timeout: Duration::from_secs(7),
            connect_timeout: Duration::from_secs(9),
            ..GroupOptions::default()
        };
        let o = NcclOptions::from(&g);
        assert_eq!(o.timeout, Duration::from_secs(7));
        assert_eq!(o.init_timeout, Duration::from_secs(9));
        assert_eq!(o.store_prefix, "nccl");
    }

    #[test]
    fn device_choice_follows_local_rank_unless_one_device_is_visible() {
        let mut o = NcclOptions::default();
        assert_eq!(DeviceChoice::from_options(&o, 3).resolve(4).unwrap(), 3);
        assert_eq!(DeviceChoice::from_options(&o, 3).resolve(1).unwrap(), 0);
        // Out of range with several devices: a clear error.
        let err = DeviceChoice::from_options(&o, 5).resolve(4).unwrap_err();
        assert!(err.to_string().contains("LOCAL_RANK 5"), "{err}");
        o.device = Some(2);
        assert_eq!(DeviceChoice::from_options(&o, 3).resolve(3).unwrap(), 2);
        let err = DeviceChoice::from_options(&o, 3).resolve(1).unwrap_err();
        assert!(err.to_string().contains("CUDA device 2 requested"), "{err}");
    }

    #[test]
    fn reduce_ops_map_to_ncclavg_for_mean() {
        assert_eq!(nccl_op(ReduceOp::Sum), ncclRedOp_t::ncclSum);
        assert_eq!(nccl_op(ReduceOp::Mean), ncclRedOp_t::ncclAvg);
        assert_eq!(nccl_op(ReduceOp::Max), ncclRedOp_t::ncclMax);
        assert_eq!(nccl_op(ReduceOp::Min), ncclRedOp_t::ncclMin);
        assert_eq!(<f32 as NcclElement>::NAME, "f32");
        assert_eq!(<i64 as NcclElement>::NAME, "i64");
    }

    #[test]
    fn without_cuda_every_constructor_returns_the_library_error() {
        if check_libraries().is_ok() {
            // A CUDA+NCCL machine: the ignored device tests in tests/nccl.rs cover it.
            return;
        }
        let opts = NcclOptions::default();
        let err = NcclGroup::single(&opts).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("libcuda not found") || msg.contains("libnccl not found"),
            "{msg}"
        );
        let env = LaunchEnv::single_process();
        let err = NcclGroup::connect(&env, &opts).unwrap_err();
        assert!(err.to_string().contains("not found"), "{err}");
    }
}
