//! [`NcclGroup`]: the safe API over one NCCL communicator (creation, device collectives, the
//! one body each collective's variants share). It calls NCCL only through the
//! [`result`](super::result) layer and the watchdog in `comm`. The raw-pointer variants (for
//! memory owned by other libraries) are in `raw`, the host-slice helpers in `host`.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::comm::{InitFailure, RawComm, cuda_error};
use super::device::{DeviceChoice, visible_cuda_devices};
use super::element::{NcclElement, nccl_op};
use super::library::{NcclVersion, check_libraries};
use super::options::NcclOptions;
use super::rendezvous;
use super::result::{self, CommPtr, NcclError, Progress, StreamPtr};
use ddp_comm::ReduceOp;
use ddp_comm::env::LaunchEnv;
use ddp_comm::error::{CommError, Result};
use ddp_comm::store::StoreClient;

pub(crate) mod collectives;
mod host;
mod raw;
mod shards;

/// One rank's NCCL communicator, its CUDA stream and a watchdog deadline for every call.
///
/// Collectives take `&mut self`: one call at a time, each returning once its result is in
/// the buffer (the stream is idle again). Device buffers must live on this group's device;
/// work queued on them on other cudarc streams is waited for (cudarc's event tracking).
pub struct NcclGroup {
    // Field order is drop order: the communicator goes before the memory and the stream.
    comm: RawComm,
    /// The barrier's one-element buffer (`None` only while a barrier uses it).
    scratch: Option<CudaSlice<f32>>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    rank: usize,
    world_size: usize,
    device: usize,
    timeout: Duration,
    version: NcclVersion,
    broken: Option<String>,
    /// NCCL calls so far (the flight recorder's call numbers of this group).
    calls: u64,
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
    /// `MASTER_ADDR:MASTER_PORT` with the job's secret (`DDP_JOB_TOKEN`, or the one
    /// [`ddp_comm::ProcessGroup::init`] resolved for a single-host job without it). The store must be served already —
    /// [`ddp_comm::ProcessGroup::init`] serves it on rank 0. A world of one needs no store.
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
        // The job's secret as the process group resolved it (DDP_JOB_TOKEN, or a single-host
        // job's secret file).
        let mut store = ddp_comm::job_auth::JobAuth::for_client(env)?.connect(opts.init_timeout)?;
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
        ddp_comm::gpu_hosts::check(|var| std::env::var(var).ok())
            .map_err(CommError::InvalidArgument)?;
        let device = device.resolve(visible_cuda_devices()?)?;
        if let Some(host) = ddp_comm::gpu_hosts::emulated_host() {
            tracing::info!(rank, device, host = %host, "NCCL rank on an emulated GPU host");
        }
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
            result::get_unique_id().map_err(|e| e.into_comm("ncclGetUniqueId", Duration::ZERO))
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
            scratch: Some(scratch),
            stream,
            ctx,
            rank,
            world_size,
            device,
            timeout: opts.timeout,
            version: libs.nccl_version,
            broken: None,
            calls: 0,
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

    /// Replaces this rank's communicator by a new one over the same ranks and device, for a
    /// group whose lost rank was replaced by a new process (live recovery): aborts the current
    /// communicator (a collective still waiting on the lost rank returns), then creates the next
    /// one through `store` as [`NcclGroup::init`] does, with the replacement (which calls
    /// `init`: its rank's generation counter goes on from the lost process's, so every rank
    /// meets in the same generation). Every rank of the group must take part. Keeps this
    /// group's collective timeout.
    ///
    /// # Errors
    /// As [`NcclGroup::init`]; the group then stays aborted.
    pub fn recreate(&mut self, store: &mut StoreClient, opts: &NcclOptions) -> Result<()> {
        self.abort();
        let timeout = self.timeout;
        let fresh = Self::create(
            self.rank,
            self.world_size,
            DeviceChoice::Explicit(self.device),
            IdSource::Store(store),
            opts,
        )?;
        *self = fresh;
        self.timeout = timeout;
        tracing::info!(
            rank = self.rank,
            world_size = self.world_size,
            "NCCL communicator re-created after a lost rank"
        );
        Ok(())
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
    /// failure aborts the communicator and breaks the group. With tracing on (`DDP_TRACE`,
    /// see [`ddp_comm::trace`]) the call is a `collective` span, from its enqueueing to its
    /// completion on the device, named `op` (`all_reduce`, `broadcast`, …), with args `call`
    /// (`what`), `transport` (`nccl`), `world` and `device`.
    fn collective(
        &mut self,
        op: &'static str,
        what: &str,
        call: impl FnOnce(CommPtr, StreamPtr) -> std::result::Result<Progress, NcclError>,
    ) -> Result<()> {
        let _span = ddp_comm::trace::span(op, "collective")
            .arg_with("call", || what.to_string())
            .arg("transport", "nccl")
            .arg("world", self.world_size)
            .arg("device", self.device);
        self.usable()?;
        // The flight recorder sees the host side: from the enqueueing to the completion.
        self.calls += 1;
        let ticket = ddp_comm::doctor::recorder::issue("nccl", op, "-", 0, self.calls);
        let start = Instant::now();
        let deadline = start + self.timeout;
        let result = self.run_and_wait(what, start, deadline, call);
        if let Some(t) = ticket {
            ddp_comm::doctor::recorder::finish(t, result.is_err());
        }
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
        call: impl FnOnce(CommPtr, StreamPtr) -> std::result::Result<Progress, NcclError>,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        let raw_stream = self.stream.cu_stream() as StreamPtr;
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

    /// The one all-reduce every variant runs: `len` elements of `T` from `src` into `dst`.
    ///
    /// # Safety
    /// `src` and `dst` (equal for in place) must address `len` elements of `T` in device
    /// memory of this group's device, valid and untouched by other work until this returns.
    unsafe fn run_all_reduce<T: NcclElement>(
        &mut self,
        op_name: &'static str,
        what: &str,
        src: CUdeviceptr,
        dst: CUdeviceptr,
        len: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let red_op = nccl_op(op, self.world_size());
        self.collective(op_name, what, |comm, s| {
            // SAFETY: per this function's contract.
            unsafe {
                result::all_reduce(
                    src as *const _,
                    dst as *mut _,
                    len,
                    T::as_nccl_type(),
                    red_op,
                    comm,
                    s,
                )
            }
        })
    }

    /// The one in-place broadcast every variant runs.
    ///
    /// # Safety
    /// As for [`NcclGroup::run_all_reduce`]; `root` is checked by the caller.
    unsafe fn run_broadcast<T: NcclElement>(
        &mut self,
        what: &str,
        ptr: CUdeviceptr,
        len: usize,
        root: usize,
    ) -> Result<()> {
        self.collective("broadcast", what, |comm, s| {
            // SAFETY: per this function's contract.
            unsafe {
                result::broadcast(
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

    /// The one all-gather every variant runs: `len` elements from `src` on every rank into
    /// `dst` (`len * world_size` elements).
    ///
    /// # Safety
    /// As for [`NcclGroup::run_all_reduce`], with those lengths.
    unsafe fn run_all_gather<T: NcclElement>(
        &mut self,
        what: &str,
        src: CUdeviceptr,
        len: usize,
        dst: CUdeviceptr,
    ) -> Result<()> {
        self.collective("all_gather", what, |comm, s| {
            // SAFETY: per this function's contract.
            unsafe {
                result::all_gather(
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
        // SAFETY: `ptr` holds `len` elements of T on this group's device; the buffer is
        // borrowed mutably until the call completed (the collective waits).
        unsafe { self.run_all_reduce::<T>("all_reduce", &what, ptr, ptr, len, op) }
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
        // SAFETY: both pointers hold `len` elements on this device, borrowed for the call.
        unsafe { self.run_all_reduce::<T>("all_reduce", &what, src, dst, len, op) }
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
        // SAFETY: `ptr` holds `len` elements on this device, borrowed for the call.
        unsafe { self.run_broadcast::<T>(&what, ptr, len, root) }
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
        // SAFETY: `src` holds `len`, `dst` holds `len * world_size` elements on this device,
        // both borrowed for the call.
        unsafe { self.run_all_gather::<T>(&what, src, len, dst) }
    }

    /// Returns once every rank has called it (a one-element all-reduce on the device).
    pub fn barrier(&mut self) -> Result<()> {
        let stream = Arc::clone(&self.stream);
        // Taken out for the call, so that its write record lives until the collective is done,
        // as in the other collectives.
        let mut scratch = self
            .scratch
            .take()
            .expect("the barrier buffer is only taken during a barrier");
        let result = {
            let (ptr, _record) = scratch.device_ptr_mut(&stream);
            // SAFETY: the group's own one-element scratch buffer on this device, borrowed
            // mutably until the collective completed.
            unsafe { self.run_all_reduce::<f32>("barrier", "barrier", ptr, ptr, 1, ReduceOp::Sum) }
        };
        self.scratch = Some(scratch);
        result
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
