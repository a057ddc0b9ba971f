//! Gradient buckets all-reduced by NCCL on CUDA device memory (feature `cuda`).
//!
//! **Status: run on one GPU, never on two.** CI builds and links this path against Burn 0.22.1 /
//! CubeCL 0.11.3 (`cargo xtask ci`) and `cargo xtask ptx-check` assembles its kernels; `cargo
//! xtask gpu-check` has run it on one H200 (ranks sharing that GPU, and NCCL in a world of one).
//! NCCL between two GPUs or two hosts has not run yet: use [`NcclPolicy::Disabled`] (or
//! `DDP_NCCL=off`) if in doubt.
//!
//! # How the buckets travel
//!
//! [`crate::GradientSynchronizer`] plans buckets exactly as on the host path; on a CUDA device
//! it:
//!
//! 1. flattens each bucket's gradients (zeros where this rank has none) and concatenates them
//!    on the device with Burn tensor ops (`Tensor::cat`), in f32;
//! 2. resolves each concatenated tensor to its CubeCL tensor: `Tensor::try_into_primitive` on
//!    Burn's `Cube` backend (`Fusion<CubeBackend>`), then the fusion client's
//!    `resolve_tensor_float::<CubeBackend>`, which runs the queued fused operations;
//! 3. makes sure each buffer is the bucket's own: contiguous, one f32 per element, and not
//!    shared with another tensor (`CubeTensor::can_mut`); otherwise it copies it first;
//! 4. orders the streams, once for all buckets: `Device::sync` (the fusion execution stream
//!    has finished the kernels that wrote them), then CubeCL's `get_resource` for each buffer
//!    (which also makes the calling thread's CubeCL stream wait for the buffer's producer
//!    stream and keeps the allocation in place while held) and `client.sync()` on that stream;
//! 5. all-reduces every buffer in place with NCCL (`ncclAvg`: the mean over ranks) in **one
//!    NCCL group call** on the NCCL group's own stream, so NCCL runs the buckets back to back
//!    without a host round trip between them; the call returns once NCCL has finished
//!    (ddp-comm's watchdog waits on an event with the collective timeout), so no Burn kernel
//!    queued afterwards can read a buffer before the result is in it;
//! 6. hands the buffers back to Fusion as new tensors (the same registration
//!    `float_from_data` makes) and slices them per parameter with tensor ops.
//!
//! SyncBatchNorm's all-gather of its statistics and all-reduce of its backward sums take the
//! same steps 2–6 for one buffer each (see `sync_batch_norm`'s module docs).
//!
//! A rank that fails before its NCCL call (a tensor on the wrong device, a CUDA fault while
//! staging) returns its error at once; the other ranks are then inside the collective and
//! fail with ddp-comm's timeout (`DDP_TIMEOUT_SECS`) instead of a hang. Agreeing first over the
//! host group would cost a host round trip per call, which this path exists to avoid.
//!
//! The presence bitmap and the choice of path travel over the host process group, as before.
//!
//! # Choosing the path
//!
//! [`crate::Ddp`] creates one NCCL communicator per rank at initialisation when every rank can
//! (its device is CUDA, libcuda and libnccl load — checked before cudarc could panic); the
//! ranks agree on that over the host group, so either all or none use NCCL. Each
//! synchronisation then takes the device path only when every rank's gradients are on that
//! CUDA device (voted in the presence exchange), and the host path otherwise. The choice is
//! logged once.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use burn::backend::fusion::{Client as FusionClient, FusionTensor, NoOp, stream::StreamId};
use burn::backend::ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
use burn::backend::{Cube, DispatchDevice, TensorMetadata};
use burn::tensor::{DType, Device, Tensor};
use burn_cubecl::{
    CubeBackend, fusion::FusionCubeRuntime, kernel::into_contiguous, tensor::CubeTensor,
};
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use ddp_comm::{Collectives, Compression, GroupOptions, LaunchEnv, ReduceOp};
use ddp_nccl::{DeviceBuffer, DeviceElement, NcclGroup, NcclOptions, check_libraries};

use crate::comm::{self, SharedGroup};
use crate::error::{DdpError, Result};

pub use super::policy::{NCCL_POLICY_VAR, NcclPolicy};

/// An NCCL communicator shared by everything in this process that uses it.
pub type SharedNccl = Arc<Mutex<NcclGroup>>;

/// The process-wide NCCL communicator ([`crate::Ddp`] installs it when every rank can use
/// NCCL).
static INSTALLED: OnceLock<SharedNccl> = OnceLock::new();

/// Makes `nccl` the process-wide NCCL communicator. Returns the installed one; if one was
/// installed before, `nccl` is dropped and the earlier one is returned with `false`.
pub(crate) fn install(nccl: SharedNccl) -> (SharedNccl, bool) {
    let mut fresh = false;
    let g = INSTALLED.get_or_init(|| {
        fresh = true;
        nccl
    });
    (g.clone(), fresh)
}

/// The process-wide NCCL communicator, if [`crate::Ddp`] installed one.
pub fn installed() -> Option<SharedNccl> {
    INSTALLED.get().cloned()
}

/// Locks a shared NCCL group, recovering from a poisoned mutex (the group tracks its errors).
pub(crate) fn lock(g: &SharedNccl) -> MutexGuard<'_, NcclGroup> {
    g.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CUDA ordinal of `device` when it is a CubeCL CUDA device (autodiff or not).
pub fn cuda_ordinal(device: &Device) -> Option<usize> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cubecl::Device::Cuda(d)) => Some(d.index),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// Why this rank can't use NCCL for `device`, or `Ok(ordinal)`.
fn local_capability(device: &Device, policy: NcclPolicy) -> std::result::Result<usize, String> {
    if policy == NcclPolicy::Disabled {
        return Err("disabled (NcclPolicy::Disabled)".into());
    }
    let ordinal = cuda_ordinal(device)
        .ok_or_else(|| format!("the device {device:?} is not a CUDA device"))?;
    check_libraries().map_err(|e| e.to_string())?;
    Ok(ordinal)
}

/// Max-all-reduces `[ok, !ok]` over the host group: `true` when every rank said `ok`.
fn all_agree(group: &SharedGroup, ok: bool) -> Result<bool> {
    let mut votes = [u8::from(ok), u8::from(!ok)];
    comm::lock(group).all_reduce(&mut votes, ReduceOp::Max)?;
    Ok(votes[0] == 1 && votes[1] == 0)
}

/// Creates this rank's NCCL communicator for gradient sync on `device`, when every rank can.
///
/// Every rank must call it at the same point (it makes host collectives, and NCCL's own
/// rendezvous through the job's store). Returns `None` in a world of one, with
/// [`NcclPolicy::Disabled`], or — with [`NcclPolicy::Auto`] — when some rank can't use NCCL
/// (logged). Ranks always agree on the outcome.
///
/// # Errors
/// A host collective failed; with [`NcclPolicy::Required`], NCCL unusable on some rank.
pub(crate) fn connect(
    env: &LaunchEnv,
    group: &SharedGroup,
    options: &GroupOptions,
    device: &Device,
    policy: NcclPolicy,
) -> Result<Option<SharedNccl>> {
    let (rank, world_size) = {
        let g = comm::lock(group);
        (g.rank(), g.world_size())
    };
    if world_size == 1 {
        return connect_alone(device, policy);
    }
    let unusable = |why: String| -> Result<Option<SharedNccl>> {
        if policy == NcclPolicy::Required {
            return Err(DdpError::NcclUnavailable(why));
        }
        tracing::info!(
            rank,
            "gradient sync stays on the host process group (no NCCL): {why}"
        );
        Ok(None)
    };

    // Round 1: can every rank try? (A rank that can't must not leave the others waiting
    // in NCCL's rendezvous until its timeout.)
    let capability = local_capability(device, policy);
    let everyone = all_agree(group, capability.is_ok())?;
    let ordinal = match (capability, everyone) {
        (Ok(ordinal), true) => ordinal,
        (Err(why), _) => return unusable(format!("rank {rank}: {why}")),
        (Ok(_), false) => return unusable("another rank can't use NCCL (see its log)".into()),
    };

    // Round 2: create the communicator (collective), then agree that it worked everywhere.
    let opts = NcclOptions {
        device: Some(ordinal),
        ..NcclOptions::from(options)
    };
    let created = {
        let mut g = comm::lock(group);
        match g.store() {
            Some(store) => NcclGroup::init(env, store, &opts),
            None => Err(ddp_comm::CommError::InvalidArgument(
                "the process group has no rendezvous store to share the NCCL id through".into(),
            )),
        }
    };
    let everyone = all_agree(group, created.is_ok())?;
    match (created, everyone) {
        (Ok(nccl), true) => {
            tracing::info!(
                rank,
                world_size,
                device = ordinal,
                nccl = %nccl.nccl_version(),
                "gradient buckets will be all-reduced by NCCL on CUDA device memory"
            );
            Ok(Some(Arc::new(Mutex::new(nccl))))
        }
        (Err(e), _) => unusable(format!("rank {rank}: creating the NCCL communicator: {e}")),
        (Ok(mut nccl), false) => {
            // Peers failed: don't leave a half-connected communicator to a clean destroy.
            nccl.abort();
            unusable("another rank failed to create its NCCL communicator (see its log)".into())
        }
    }
}

/// Live recovery, on a survivor once its host `group` re-formed with a lost rank's replacement:
/// aborts `nccl`'s communicator and creates the next one with every rank of the group (the
/// replacement creates its first in [`rejoin`]), sharing its id through the group's store.
/// Everything holding `nccl` uses the new communicator.
///
/// # Errors
/// The group has no store; creating the communicator failed (the old one stays aborted).
pub(crate) fn recreate(
    group: &SharedGroup,
    options: &GroupOptions,
    nccl: &SharedNccl,
) -> Result<()> {
    let mut g = comm::lock(group);
    let store = g.store().ok_or_else(no_store)?;
    let mut n = lock(nccl);
    let opts = NcclOptions {
        device: Some(n.device_ordinal()),
        ..NcclOptions::from(options)
    };
    n.recreate(store, &opts)?;
    Ok(())
}

/// Live recovery, on a replacement that joined the running host `group`: creates its NCCL
/// communicator on `device` together with the survivors' [`recreate`], and installs it.
///
/// # Errors
/// This rank cannot use NCCL on `device`; the group has no store; creating the communicator
/// failed.
pub(crate) fn rejoin(
    env: &LaunchEnv,
    group: &SharedGroup,
    options: &GroupOptions,
    device: &Device,
) -> Result<SharedNccl> {
    let ordinal = local_capability(device, NcclPolicy::Required).map_err(|why| {
        DdpError::NcclUnavailable(format!(
            "the running job's ranks use NCCL, but this replacement cannot: {why}"
        ))
    })?;
    let opts = NcclOptions {
        device: Some(ordinal),
        ..NcclOptions::from(options)
    };
    let created = {
        let mut g = comm::lock(group);
        let store = g.store().ok_or_else(no_store)?;
        NcclGroup::init(env, store, &opts)?
    };
    tracing::info!(
        rank = created.rank(),
        device = ordinal,
        "joined the running job's NCCL communicator in place of a lost rank"
    );
    Ok(install(Arc::new(Mutex::new(created))).0)
}

/// The error of a process group without a rendezvous store.
fn no_store() -> DdpError {
    DdpError::Comm(ddp_comm::CommError::InvalidArgument(
        "the process group has no rendezvous store to share the NCCL id through".into(),
    ))
}

/// A world of one: a one-rank communicator with [`NcclPolicy::Required`], otherwise none.
fn connect_alone(device: &Device, policy: NcclPolicy) -> Result<Option<SharedNccl>> {
    if policy != NcclPolicy::Required {
        return Ok(None);
    }
    let ordinal = local_capability(device, policy).map_err(DdpError::NcclUnavailable)?;
    let opts = NcclOptions {
        device: Some(ordinal),
        ..NcclOptions::default()
    };
    let nccl = NcclGroup::single(&opts).map_err(|e| {
        DdpError::NcclUnavailable(format!("creating a one-rank NCCL communicator: {e}"))
    })?;
    tracing::info!(
        device = ordinal,
        nccl = %nccl.nccl_version(),
        "world of one with NcclPolicy::Required: gradient buckets and SyncBatchNorm statistics \
         go through a one-rank NCCL communicator"
    );
    Ok(Some(Arc::new(Mutex::new(nccl))))
}

fn buffer_err(what: &str, msg: impl std::fmt::Display) -> DdpError {
    DdpError::TensorData {
        what: what.into(),
        msg: msg.to_string(),
    }
}

/// A raw CUDA device pointer (cudarc's `CUdeviceptr`).
type DevicePtr = ddp_nccl::cudarc::driver::sys::CUdeviceptr;

/// Replaces the f32 tensor `packed` (on `nccl`'s CUDA device) by its element-wise reduction
/// (`op`) over all ranks, all-reduced by NCCL in device memory; see the [module docs](self)
/// for the steps. Every rank must call it with the same length, in the same order.
///
/// # Errors
/// The tensor is not an f32 CubeCL CUDA tensor on the group's device, its buffer could not be
/// reached or the device reported a fault, or the NCCL call failed (the group is then
/// broken).
pub(crate) fn all_reduce(
    nccl: &mut NcclGroup,
    packed: Tensor<1>,
    op: ReduceOp,
) -> Result<Tensor<1>> {
    let mut out = all_reduce_many(nccl, vec![packed], op)?;
    Ok(out.pop().expect("one tensor in, one out"))
}

/// [`all_reduce`] of several f32 tensors at once: one device synchronisation, then one NCCL
/// group call that reduces every buffer back to back on NCCL's stream, and one wait. Every
/// rank must pass the same number of tensors with the same lengths, in the same order.
///
/// # Errors
/// As [`all_reduce`].
pub(crate) fn all_reduce_many(
    nccl: &mut NcclGroup,
    tensors: Vec<Tensor<1>>,
    op: ReduceOp,
) -> Result<Vec<Tensor<1>>> {
    all_reduce_many_as(nccl, tensors, op, Compression::None)
}

/// [`all_reduce_many`] with the f32 tensors on the wire as `compression` says: cast to bf16 or
/// fp16 on the device, all-reduced by NCCL's native 16-bit all-reduce (which, like PyTorch's
/// compression hooks, keeps its partial sums in 16 bits between ring steps), cast back to f32.
/// The buffers go to NCCL through [`Collectives::all_reduce_many`], one NCCL group call.
pub(crate) fn all_reduce_many_as(
    nccl: &mut NcclGroup,
    tensors: Vec<Tensor<1>>,
    op: ReduceOp,
    compression: Compression,
) -> Result<Vec<Tensor<1>>> {
    let dtype = wire_dtype(compression);
    let tensors = tensors.into_iter().map(|t| in_dtype(t, dtype)).collect();
    let reduced = on_device_buffers(
        nccl,
        tensors,
        dtype,
        "all-reduced tensor (NCCL path)",
        |nccl, buffers| {
            let mut views: Vec<DeviceBuffer> = buffers
                .iter()
                // SAFETY: per `on_device_buffers`' contract for every (pointer, length) pair
                // of `dtype` values; the buffers are distinct allocations (`exclusive_buffer`).
                .map(|&(ptr, len)| unsafe {
                    DeviceBuffer::from_raw(ptr, len, DeviceElement::of(compression))
                })
                .collect();
            let mut refs: Vec<&mut DeviceBuffer> = views.iter_mut().collect();
            Collectives::all_reduce_many(nccl, &mut refs, op, compression)
        },
    )?;
    Ok(reduced
        .into_iter()
        .map(|t| in_dtype(t, DType::F32))
        .collect())
}

/// Reduces the f32 tensor `packed` (one shard per rank in rank order, rank `p`'s of
/// `counts[p]` values) across ranks with NCCL in device memory, values on the wire as
/// `compression` says, and returns it with this rank's shard reduced (the rest unspecified),
/// through [`Collectives::reduce_scatter`].
///
/// # Errors
/// As [`all_reduce`]; `counts` that do not fit.
pub(crate) fn reduce_scatter(
    nccl: &mut NcclGroup,
    packed: Tensor<1>,
    counts: &[usize],
    op: ReduceOp,
    compression: Compression,
) -> Result<Tensor<1>> {
    let dtype = wire_dtype(compression);
    let mut out = on_device_buffers(
        nccl,
        vec![in_dtype(packed, dtype)],
        dtype,
        "reduce-scattered tensor (NCCL path)",
        |nccl, buffers| {
            let &[(ptr, len)] = buffers else {
                unreachable!("one tensor in");
            };
            // SAFETY: per `on_device_buffers`' contract: `ptr` holds `len` values of `dtype`.
            let mut buf =
                unsafe { DeviceBuffer::from_raw(ptr, len, DeviceElement::of(compression)) };
            Collectives::reduce_scatter(nccl, &mut buf, counts, op, compression)
        },
    )?;
    Ok(in_dtype(
        out.pop().expect("one tensor in, one out"),
        DType::F32,
    ))
}

/// `t` in `dtype`: itself when it already is (no cast, no new tensor).
fn in_dtype(t: Tensor<1>, dtype: DType) -> Tensor<1> {
    if t.dtype() == dtype { t } else { t.cast(dtype) }
}

/// Gathers every rank's shard of the f32 tensor `buf` (rank `p`'s of `counts[p]` values, in
/// rank order) into every rank's copy, with NCCL in device memory, through
/// [`Collectives::all_gather_into`].
///
/// # Errors
/// As [`all_reduce`]; `counts` that do not fit.
pub(crate) fn all_gather_into(
    nccl: &mut NcclGroup,
    buf: Tensor<1>,
    counts: &[usize],
) -> Result<Tensor<1>> {
    let mut out = on_device_buffers(
        nccl,
        vec![buf],
        DType::F32,
        "all-gathered shards (NCCL path)",
        |nccl, buffers| {
            let &[(ptr, len)] = buffers else {
                unreachable!("one tensor in");
            };
            // SAFETY: per `on_device_buffers`' contract: `ptr` holds `len` f32 values.
            let mut view = unsafe { DeviceBuffer::from_raw(ptr, len, DeviceElement::F32) };
            Collectives::all_gather_into(nccl, &mut view, counts)
        },
    )?;
    Ok(out.pop().expect("one tensor in, one out"))
}

/// The dtype of the values NCCL reduces for `compression`.
fn wire_dtype(compression: Compression) -> DType {
    match compression {
        Compression::Bf16 => DType::BF16,
        Compression::Fp16 => DType::F16,
        _ => DType::F32,
    }
}

/// All-gathers every rank's f32 tensor `local` (the same length `n` on every rank, on
/// `nccl`'s CUDA device) into one `[W · n]` tensor in rank order, by NCCL in device memory.
///
/// The output buffer is allocated by Burn, this rank's slot filled with `local`, and
/// [`Collectives::all_gather_into`] fills the others.
///
/// # Errors
/// As [`all_reduce`].
pub(crate) fn all_gather(nccl: &mut NcclGroup, local: Tensor<1>) -> Result<Tensor<1>> {
    let (rank, world) = (nccl.rank(), nccl.world_size());
    let [n] = local.dims();
    let device = local.device();
    let slots = Tensor::<1>::zeros([world * n], (&device, DType::F32))
        .slice_assign(burn::tensor::s![rank * n..(rank + 1) * n], local);
    let mut out = on_device_buffers(
        nccl,
        vec![slots],
        DType::F32,
        "all-gathered tensor (NCCL path)",
        |nccl, buffers| {
            let &[(ptr, total)] = buffers else {
                unreachable!("one tensor in");
            };
            debug_assert_eq!(total, world * n);
            // SAFETY: per `on_device_buffers`' contract: `ptr` holds `world · n` f32 values.
            let mut buf = unsafe { DeviceBuffer::from_raw(ptr, total, DeviceElement::F32) };
            Collectives::all_gather_into(nccl, &mut buf, &vec![n; world])
        },
    )?;
    Ok(out.pop().expect("one tensor in, one out"))
}

/// One tensor on its way to NCCL (a handful live for one call, so their size doesn't matter).
#[allow(clippy::large_enum_variant)]
enum Staged {
    /// Nothing to hand over (no elements).
    Empty(Tensor<1>),
    /// A CubeCL buffer of the tensor's own, and the fusion client to hand it back to.
    Buffer(FusionClient<FusionCubeRuntime>, CubeTensor),
}

/// Steps 2–6 of the [module docs](self): hands the device buffers of the `dtype` tensors (on
/// `nccl`'s device) to `collective` as `(pointer, number of values)` pairs and returns
/// the buffers, with what the collective wrote into them, as new tensors (same order).
///
/// The pointers address buffers that no other tensor shares and that every earlier kernel
/// has finished writing (one device synchronisation for all of them); they stay allocated
/// while `collective` runs, which must return only once NCCL is done with them (ddp-comm's
/// calls do). Tensors without elements are passed through and left out of the pairs.
fn on_device_buffers(
    nccl: &mut NcclGroup,
    tensors: Vec<Tensor<1>>,
    dtype: DType,
    what: &str,
    collective: impl FnOnce(&mut NcclGroup, &[(DevicePtr, usize)]) -> ddp_comm::Result<()>,
) -> Result<Vec<Tensor<1>>> {
    let mut staged = Vec::with_capacity(tensors.len());
    let mut device = None;
    for t in tensors {
        let t = t.inner();
        if t.dtype() != dtype {
            return Err(buffer_err(
                what,
                format!("expected {dtype:?}, got {:?}", t.dtype()),
            ));
        }
        let on = t.device();
        if cuda_ordinal(&on) != Some(nccl.device_ordinal()) {
            return Err(buffer_err(
                what,
                format!(
                    "the tensor lives on {on:?} but the NCCL group runs on CUDA device {}",
                    nccl.device_ordinal()
                ),
            ));
        }
        if t.shape().num_elements() == 0 {
            staged.push(Staged::Empty(t));
            continue;
        }
        device = Some(on);
        // 2. The CubeCL tensor behind the fusion handle (runs the queued fused operations).
        let fused: FusionTensor<FusionCubeRuntime> = t
            .try_into_primitive::<Cube>()
            .map_err(|e| buffer_err(what, format!("not a CubeCL tensor: {e:?}")))?;
        let client = fused.client.clone();
        let cube = client.resolve_tensor_float::<CubeBackend>(fused);
        // 3. A contiguous f32 buffer of exactly its values that no other tensor shares.
        staged.push(Staged::Buffer(client, exclusive_buffer(cube)));
    }
    let Some(device) = device else {
        return Ok(staged
            .into_iter()
            .map(|s| match s {
                Staged::Empty(t) => t,
                Staged::Buffer(..) => unreachable!("no buffer without a device"),
            })
            .collect());
    };

    // 4. Stream order: everything that wrote the buffers has finished before NCCL reads them.
    device
        .sync()
        .map_err(|e| buffer_err(what, format!("device sync before NCCL: {e:?}")))?;
    {
        let mut resources = Vec::new();
        let mut buffers = Vec::new();
        let mut cube_client = None;
        for entry in &staged {
            let Staged::Buffer(_, cube) = entry else {
                continue;
            };
            let numel = cube.shape().num_elements();
            let resource = cube
                .client
                .get_resource::<<CudaRuntime as Runtime>::Server>(cube.handle.clone())
                .map_err(|e| buffer_err(what, format!("CUDA buffer: {e}")))?;
            let (ptr, bytes) = (resource.resource().ptr, resource.resource().size);
            if bytes < (numel * dtype.size()) as u64 {
                return Err(buffer_err(
                    what,
                    format!(
                        "the CUDA buffer holds {bytes} bytes, fewer than {numel} {dtype:?} values"
                    ),
                ));
            }
            buffers.push((ptr, numel));
            resources.push(resource);
            cube_client.get_or_insert_with(|| cube.client.clone());
        }
        if let Some(client) = cube_client {
            cubecl::future::block_on(client.sync())
                .map_err(|e| buffer_err(what, format!("CubeCL stream sync before NCCL: {e}")))?;
        }
        // 5. On NCCL's stream; returns once NCCL finished (or timed out/aborted). `resources`
        // keep the allocations in place until this block ends.
        collective(nccl, &buffers)?;
    }

    // 6. Back into Fusion as fresh tensors.
    Ok(staged
        .into_iter()
        .map(|s| match s {
            Staged::Empty(t) => t,
            Staged::Buffer(client, cube) => {
                Tensor::from_primitive::<Cube>(register_in_fusion(&client, cube))
            }
        })
        .collect())
}

/// `cube` itself when it is contiguous (packed strides from its first element) and no other
/// tensor shares its handle, otherwise a fresh contiguous copy.
///
/// Slack after the elements (allocations are rounded up) or an offset into a larger
/// allocation is fine: NCCL gets the resource's pointer, which includes the offset, and the
/// element count; the caller checks that the resource holds that many values.
fn exclusive_buffer(cube: CubeTensor) -> CubeTensor {
    let cube = into_contiguous(cube);
    if cube.can_mut() && cube.is_contiguous() {
        cube
    } else {
        // `copy` launches into a new allocation (the clone inside keeps `cube` read-only).
        let copy = cube.copy();
        drop(cube);
        copy
    }
}

/// Registers a CubeCL tensor with the fusion client as an initialised tensor (what
/// `Fusion::float_from_data` does with a freshly uploaded one).
fn register_in_fusion(
    client: &FusionClient<FusionCubeRuntime>,
    cube: CubeTensor,
) -> FusionTensor<FusionCubeRuntime> {
    let shape = cube.shape();
    let dtype = cube.dtype;
    let handle = <CubeBackend as BackendIr>::float_tensor_handle(cube);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            StreamId::current(),
            OperationIr::Init(desc),
            NoOp::<CubeBackend>::new(),
        )
        .output()
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use ddp_nccl::cudarc::driver::result::{memcpy_dtoh_sync, memcpy_htod_sync};

    use super::*;

    fn values(t: &Tensor<1>) -> Vec<f32> {
        t.to_data().convert::<f32>().try_to_vec::<f32>().unwrap()
    }

    /// NCCL in a world of one copies nothing, so it can't show a wrong pointer: this reads and
    /// writes the handed-out device memory directly. Every pointer must address exactly its
    /// tensor's values, and what is written there must come back in the returned tensors, for
    /// a slice at an offset of a shared tensor (copied first), a fresh concatenation (used in
    /// place) and a 2-D tensor whose rows CUDA may pad, reshaped to 1-D.
    #[test]
    #[ignore = "needs CUDA"]
    fn device_buffers_address_the_values_and_hand_back_what_is_written() {
        let device = Device::cuda(0);
        let mut nccl = NcclGroup::single(&NcclOptions {
            device: Some(0),
            ..NcclOptions::default()
        })
        .unwrap();
        let base_values: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let base = Tensor::<1>::from_data(TensorData::new(base_values.clone(), [64]), &device);
        let slice = base.clone().slice(10..30);
        let cat = Tensor::cat(
            vec![base.clone().slice(0..5), Tensor::ones([7], &device)],
            0,
        );
        let grid: Vec<f32> = (0..7 * 13).map(|i| i as f32 * 0.5 - 3.0).collect();
        let pitched = Tensor::<2>::from_data(TensorData::new(grid, [7, 13]), &device).reshape([91]);
        let inputs = vec![slice, cat, pitched];
        let expected: Vec<Vec<f32>> = inputs.iter().map(values).collect();
        let pattern = |len: usize, k: usize| -> Vec<f32> {
            (0..len).map(|i| -(i as f32) - 100.0 * k as f32).collect()
        };
        let seen = std::cell::RefCell::new(Vec::new());
        let out = on_device_buffers(
            &mut nccl,
            inputs,
            DType::F32,
            "test tensor",
            |nccl, buffers| {
                nccl.context().bind_to_thread().unwrap();
                for (k, &(ptr, len)) in buffers.iter().enumerate() {
                    let mut host = vec![0f32; len];
                    // SAFETY: `on_device_buffers` hands out `len` f32 values at `ptr`.
                    unsafe { memcpy_dtoh_sync(&mut host, ptr) }.unwrap();
                    seen.borrow_mut().push(host);
                    // SAFETY: as above; the buffers are the tensors' own.
                    unsafe { memcpy_htod_sync(ptr, &pattern(len, k)) }.unwrap();
                }
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(
            seen.into_inner(),
            expected,
            "device memory differs from the tensors"
        );
        for (k, (t, want)) in out.iter().zip(&expected).enumerate() {
            assert_eq!(
                values(t),
                pattern(want.len(), k),
                "tensor {k} lost the write"
            );
        }
        assert_eq!(
            values(&base),
            base_values,
            "the shared tensor was written in place"
        );
    }
}
