//! The driver API entry points the stand-in exports (`cuInit`, `cuModuleLoadData`,
//! `cuLaunchKernel`, …), with the C signatures of `cuda.h`.
//!
//! # Safety
//! Every function here has the contract of the CUDA driver function of the same name: the
//! caller passes valid out-pointers, NUL-terminated strings and handles this library returned.
//! Handles are pointers to objects this library leaks on purpose (a module lives for the
//! process), so a stale handle never dangles.

#![allow(clippy::missing_safety_doc)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};

use crate::launch::{self, Launch};
use crate::ptxas::{self, Assembled, Resources};
use crate::{device, record};

/// `CUresult`.
pub type CuResult = c_uint;
/// `CUdeviceptr`.
pub type DevicePtr = u64;
/// An opaque handle (`CUcontext`, `CUstream`, `CUevent`, `CUmodule`, `CUfunction`).
pub type Handle = *mut c_void;

/// `CUDA_SUCCESS`.
pub const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const NOT_INITIALIZED: CuResult = 3;
/// `CUDA_ERROR_INVALID_DEVICE`.
pub const INVALID_DEVICE: CuResult = 101;
/// `CUDA_ERROR_INVALID_IMAGE`.
pub const INVALID_IMAGE: CuResult = 200;
/// `CUDA_ERROR_INVALID_PTX`.
pub const INVALID_PTX: CuResult = 218;
/// `CUDA_ERROR_INVALID_HANDLE`.
pub const INVALID_HANDLE: CuResult = 400;
/// `CUDA_ERROR_NOT_FOUND`.
pub const NOT_FOUND: CuResult = 500;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: CuResult = 801;

/// The line the first `cuInit` of a process prints on stderr.
pub const BANNER: &str = "cuda-standin: this libcuda.so is a CUDA driver STAND-IN without a GPU \
     (an H200 as reported, memory on the host): PTX is assembled by ptxas, kernels never run, \
     every result computed under it is meaningless";

static INIT: Once = Once::new();
static INITIALISED: AtomicBool = AtomicBool::new(false);
/// The primary context's handle (one per process; all devices share it).
static CONTEXT: u8 = 0;
static CURRENT: AtomicBool = AtomicBool::new(false);

fn device_count() -> c_int {
    std::env::var("CUDA_STANDIN_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn valid_device(dev: c_int) -> bool {
    (0..device_count()).contains(&dev)
}

/// Writes `value` through `out` (`CUDA_ERROR_INVALID_VALUE` for a null pointer).
unsafe fn put<T>(out: *mut T, value: T) -> CuResult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer of the caller (the driver's contract).
    unsafe { out.write(value) };
    SUCCESS
}

/// Copies `text` into the caller's buffer of `len` bytes, NUL-terminated and cut to fit.
unsafe fn put_str(out: *mut c_char, len: c_int, text: &str) -> CuResult {
    let Ok(len) = usize::try_from(len) else {
        return INVALID_VALUE;
    };
    if out.is_null() || len == 0 {
        return INVALID_VALUE;
    }
    let n = text.len().min(len - 1);
    // SAFETY: the caller's buffer holds `len` bytes; we write `n + 1 <= len`.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), out, n);
        out.add(n).write(0);
    }
    SUCCESS
}

fn new_handle() -> Handle {
    Box::into_raw(Box::new(0u64)).cast()
}

// ------------------------------------------------------------------------------------------
// Initialisation, devices, contexts
// ------------------------------------------------------------------------------------------

/// `cuInit`: prints [`BANNER`] once per process.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(_flags: c_uint) -> CuResult {
    INIT.call_once(|| {
        eprintln!("{BANNER}");
        INITIALISED.store(true, Ordering::SeqCst);
    });
    SUCCESS
}

/// `cuDriverGetVersion`: [`device::DRIVER_VERSION`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CuResult {
    unsafe { put(version, device::DRIVER_VERSION) }
}

/// `cuDeviceGetCount`: `CUDA_STANDIN_DEVICES` (default 1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    if !INITIALISED.load(Ordering::SeqCst) {
        return NOT_INITIALIZED;
    }
    unsafe { put(count, device_count()) }
}

/// `cuDeviceGet`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CuResult {
    if !INITIALISED.load(Ordering::SeqCst) {
        return NOT_INITIALIZED;
    }
    if !valid_device(ordinal) {
        return INVALID_DEVICE;
    }
    unsafe { put(dev, ordinal) }
}

/// `cuDeviceGetAttribute`: see [`device::attribute`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    dev: c_int,
) -> CuResult {
    if !valid_device(dev) {
        return INVALID_DEVICE;
    }
    unsafe { put(value, device::attribute(attrib)) }
}

/// `cuDeviceGetName`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    if !valid_device(dev) {
        return INVALID_DEVICE;
    }
    unsafe { put_str(name, len, device::NAME) }
}

/// `cuDeviceGetPCIBusId`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(
    bus_id: *mut c_char,
    len: c_int,
    dev: c_int,
) -> CuResult {
    if !valid_device(dev) {
        return INVALID_DEVICE;
    }
    unsafe { put_str(bus_id, len, &format!("0000:{:02x}:00.0", 0x19 + dev)) }
}

/// `cuDeviceGetUuid` (and `_v2`): a fixed UUID per device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: c_int) -> CuResult {
    if !valid_device(dev) {
        return INVALID_DEVICE;
    }
    let mut bytes = *b"cuda-standin-\0\0\0";
    bytes[15] = dev as u8;
    unsafe { put(uuid, bytes) }
}

/// `cuDeviceGetUuid_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) -> CuResult {
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

/// `cuDeviceTotalMem_v2`: [`device::TOTAL_MEMORY`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CuResult {
    if !valid_device(dev) {
        return INVALID_DEVICE;
    }
    unsafe { put(bytes, device::TOTAL_MEMORY) }
}

fn context() -> Handle {
    (&raw const CONTEXT).cast_mut().cast()
}

/// `cuDevicePrimaryCtxRetain`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: c_int) -> CuResult {
    if !INITIALISED.load(Ordering::SeqCst) {
        return NOT_INITIALIZED;
    }
    if !valid_device(dev) {
        return INVALID_DEVICE;
    }
    unsafe { put(ctx, context()) }
}

/// `cuDevicePrimaryCtxRelease_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(_dev: c_int) -> CuResult {
    SUCCESS
}

/// `cuCtxSetCurrent`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CuResult {
    CURRENT.store(!ctx.is_null(), Ordering::SeqCst);
    SUCCESS
}

/// `cuCtxGetCurrent`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Handle) -> CuResult {
    let c = if CURRENT.load(Ordering::SeqCst) {
        context()
    } else {
        std::ptr::null_mut()
    };
    unsafe { put(ctx, c) }
}

/// `cuCtxPushCurrent_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: Handle) -> CuResult {
    unsafe { cuCtxSetCurrent(ctx) }
}

/// `cuCtxPopCurrent_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut Handle) -> CuResult {
    if !ctx.is_null() {
        unsafe { ctx.write(context()) };
    }
    SUCCESS
}

/// `cuCtxGetDevice`: device 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CuResult {
    unsafe { put(dev, 0) }
}

/// `cuCtxSynchronize`: nothing runs, so nothing to wait for.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CuResult {
    SUCCESS
}

/// `cuCtxGetStreamPriorityRange`: 0 (least) to -5 (greatest), as on Hopper.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CuResult {
    if !least.is_null() {
        unsafe { least.write(0) };
    }
    if !greatest.is_null() {
        unsafe { greatest.write(-5) };
    }
    SUCCESS
}

/// `cuCtxSetLimit`: accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetLimit(_limit: c_int, _value: usize) -> CuResult {
    SUCCESS
}

// ------------------------------------------------------------------------------------------
// Streams and events: everything is complete as soon as it is enqueued.
// ------------------------------------------------------------------------------------------

/// `cuStreamCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut Handle, _flags: c_uint) -> CuResult {
    unsafe { put(stream, new_handle()) }
}

/// `cuStreamCreateWithPriority`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut Handle,
    _flags: c_uint,
    _priority: c_int,
) -> CuResult {
    unsafe { put(stream, new_handle()) }
}

/// `cuStreamDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(_stream: Handle) -> CuResult {
    SUCCESS
}

/// `cuStreamSynchronize`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(_stream: Handle) -> CuResult {
    SUCCESS
}

/// `cuStreamQuery`: always complete.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(_stream: Handle) -> CuResult {
    SUCCESS
}

/// `cuStreamWaitEvent`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(
    _stream: Handle,
    _event: Handle,
    _flags: c_uint,
) -> CuResult {
    SUCCESS
}

/// `cuLaunchHostFunc`: calls `f(data)` at once (the stream is always idle).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchHostFunc(
    _stream: Handle,
    f: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CuResult {
    match f {
        Some(f) => {
            unsafe { f(data) };
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

/// `cuEventCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut Handle, _flags: c_uint) -> CuResult {
    unsafe { put(event, new_handle()) }
}

/// `cuEventRecord`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(_event: Handle, _stream: Handle) -> CuResult {
    SUCCESS
}

/// `cuEventRecordWithFlags`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecordWithFlags(
    _event: Handle,
    _stream: Handle,
    _flags: c_uint,
) -> CuResult {
    SUCCESS
}

/// `cuEventSynchronize`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(_event: Handle) -> CuResult {
    SUCCESS
}

/// `cuEventQuery`: always complete.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(_event: Handle) -> CuResult {
    SUCCESS
}

/// `cuEventElapsedTime`: 0 ms (nothing ran).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    _start: Handle,
    _end: Handle,
) -> CuResult {
    unsafe { put(ms, 0.0) }
}

/// `cuEventDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(_event: Handle) -> CuResult {
    SUCCESS
}

// ------------------------------------------------------------------------------------------
// Memory: "device" memory is host memory, so a device pointer is a host address.
// ------------------------------------------------------------------------------------------

fn allocations() -> &'static Mutex<BTreeMap<u64, usize>> {
    static A: OnceLock<Mutex<BTreeMap<u64, usize>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(BTreeMap::new()))
}

static ALLOCATED: AtomicU64 = AtomicU64::new(0);

/// Zeroed, page-aligned memory that is committed only when touched.
fn map(bytes: usize) -> Option<u64> {
    let len = bytes.max(1);
    if (ALLOCATED.load(Ordering::SeqCst) as usize).saturating_add(len) > device::TOTAL_MEMORY {
        return None;
    }
    // SAFETY: an anonymous private mapping; no file, no fixed address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let addr = p as u64;
    allocations()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(addr, len);
    ALLOCATED.fetch_add(len as u64, Ordering::SeqCst);
    Some(addr)
}

fn unmap(addr: u64) -> CuResult {
    let len = allocations()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&addr);
    match len {
        Some(len) => {
            // SAFETY: `addr..addr+len` is a mapping `map` made and nothing else frees.
            unsafe { libc::munmap(addr as *mut c_void, len) };
            ALLOCATED.fetch_sub(len as u64, Ordering::SeqCst);
            SUCCESS
        }
        None if addr == 0 => SUCCESS,
        None => INVALID_VALUE,
    }
}

/// `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, bytes: usize) -> CuResult {
    match map(bytes) {
        Some(addr) => unsafe { put(dptr, addr) },
        None => OUT_OF_MEMORY,
    }
}

/// `cuMemAllocAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut DevicePtr,
    bytes: usize,
    _stream: Handle,
) -> CuResult {
    unsafe { cuMemAlloc_v2(dptr, bytes) }
}

/// `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> CuResult {
    unmap(dptr)
}

/// `cuMemFreeAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: DevicePtr, _stream: Handle) -> CuResult {
    unmap(dptr)
}

/// `cuMemAllocHost_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CuResult {
    match map(bytes) {
        Some(addr) => unsafe { put(pp, addr as *mut c_void) },
        None => OUT_OF_MEMORY,
    }
}

/// `cuMemHostAlloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CuResult {
    unsafe { cuMemAllocHost_v2(pp, bytes) }
}

/// `cuMemFreeHost`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CuResult {
    unmap(p as u64)
}

/// `cuMemHostRegister_v2`: host memory is already "device" memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    _p: *mut c_void,
    _bytes: usize,
    _flags: c_uint,
) -> CuResult {
    SUCCESS
}

/// `cuMemHostUnregister`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostUnregister(_p: *mut c_void) -> CuResult {
    SUCCESS
}

/// `cuMemGetInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    let used = ALLOCATED.load(Ordering::SeqCst) as usize;
    unsafe {
        put(free, device::TOTAL_MEMORY.saturating_sub(used));
        put(total, device::TOTAL_MEMORY)
    }
}

unsafe fn copy(dst: *mut u8, src: *const u8, bytes: usize) -> CuResult {
    if bytes == 0 {
        return SUCCESS;
    }
    if dst.is_null() || src.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: both ranges are the caller's (host or stand-in device memory, one address space).
    unsafe { std::ptr::copy(src, dst, bytes) };
    SUCCESS
}

/// `cuMemcpyHtoD_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: DevicePtr,
    src: *const c_void,
    bytes: usize,
) -> CuResult {
    unsafe { copy(dst as *mut u8, src.cast(), bytes) }
}

/// `cuMemcpyHtoDAsync_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: DevicePtr,
    src: *const c_void,
    bytes: usize,
    _stream: Handle,
) -> CuResult {
    unsafe { copy(dst as *mut u8, src.cast(), bytes) }
}

/// `cuMemcpyDtoH_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: DevicePtr,
    bytes: usize,
) -> CuResult {
    unsafe { copy(dst.cast(), src as *const u8, bytes) }
}

/// `cuMemcpyDtoHAsync_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: DevicePtr,
    bytes: usize,
    _stream: Handle,
) -> CuResult {
    unsafe { copy(dst.cast(), src as *const u8, bytes) }
}

/// `cuMemcpyDtoD_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: DevicePtr, src: DevicePtr, bytes: usize) -> CuResult {
    unsafe { copy(dst as *mut u8, src as *const u8, bytes) }
}

/// `cuMemcpyDtoDAsync_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    _stream: Handle,
) -> CuResult {
    unsafe { copy(dst as *mut u8, src as *const u8, bytes) }
}

/// `cuMemcpyAsync` (unified addressing: any pointer to any pointer).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    _stream: Handle,
) -> CuResult {
    unsafe { copy(dst as *mut u8, src as *const u8, bytes) }
}

/// `CUDA_MEMCPY2D`, as in `cuda.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Memcpy2D {
    /// Source column offset in bytes.
    pub src_x_in_bytes: usize,
    /// Source row.
    pub src_y: usize,
    /// `CUmemorytype` of the source (1 host, 2 device, 3 array, 4 unified).
    pub src_memory_type: c_uint,
    /// Source host pointer.
    pub src_host: *const c_void,
    /// Source device pointer.
    pub src_device: DevicePtr,
    /// Source array (unsupported).
    pub src_array: Handle,
    /// Source row pitch in bytes.
    pub src_pitch: usize,
    /// Destination column offset in bytes.
    pub dst_x_in_bytes: usize,
    /// Destination row.
    pub dst_y: usize,
    /// `CUmemorytype` of the destination.
    pub dst_memory_type: c_uint,
    /// Destination host pointer.
    pub dst_host: *mut c_void,
    /// Destination device pointer.
    pub dst_device: DevicePtr,
    /// Destination array (unsupported).
    pub dst_array: Handle,
    /// Destination row pitch in bytes.
    pub dst_pitch: usize,
    /// Bytes per row.
    pub width_in_bytes: usize,
    /// Rows.
    pub height: usize,
}

/// The base address of one side of a 2-D copy (`None`: an array, which is unsupported).
fn base(memory_type: c_uint, host: u64, device: u64) -> Option<u64> {
    match memory_type {
        1 => Some(host),
        2 | 4 => Some(device),
        _ => None,
    }
}

/// `cuMemcpy2D_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy2D_v2(p: *const Memcpy2D) -> CuResult {
    if p.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's descriptor.
    let c = unsafe { *p };
    let (Some(src), Some(dst)) = (
        base(c.src_memory_type, c.src_host as u64, c.src_device),
        base(c.dst_memory_type, c.dst_host as u64, c.dst_device),
    ) else {
        return NOT_SUPPORTED;
    };
    if c.width_in_bytes > c.src_pitch.max(c.width_in_bytes)
        || c.width_in_bytes > c.dst_pitch.max(c.width_in_bytes)
    {
        return INVALID_VALUE;
    }
    for row in 0..c.height {
        let s = src + (c.src_x_in_bytes + (c.src_y + row) * c.src_pitch) as u64;
        let d = dst + (c.dst_x_in_bytes + (c.dst_y + row) * c.dst_pitch) as u64;
        let r = unsafe { copy(d as *mut u8, s as *const u8, c.width_in_bytes) };
        if r != SUCCESS {
            return r;
        }
    }
    SUCCESS
}

/// `cuMemcpy2DAsync_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy2DAsync_v2(p: *const Memcpy2D, _stream: Handle) -> CuResult {
    unsafe { cuMemcpy2D_v2(p) }
}

unsafe fn fill<T: Copy>(dst: DevicePtr, value: T, count: usize) -> CuResult {
    if dst == 0 && count > 0 {
        return INVALID_VALUE;
    }
    let p = dst as *mut T;
    for i in 0..count {
        // SAFETY: the caller's device range of `count` elements.
        unsafe { p.add(i).write_unaligned(value) };
    }
    SUCCESS
}

/// `cuMemsetD8_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: DevicePtr, value: u8, count: usize) -> CuResult {
    unsafe { fill(dst, value, count) }
}

/// `cuMemsetD8Async`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: DevicePtr,
    value: u8,
    count: usize,
    _stream: Handle,
) -> CuResult {
    unsafe { fill(dst, value, count) }
}

/// `cuMemsetD32_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: DevicePtr, value: c_uint, count: usize) -> CuResult {
    unsafe { fill(dst, value, count) }
}

/// `cuMemsetD32Async`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32Async(
    dst: DevicePtr,
    value: c_uint,
    count: usize,
    _stream: Handle,
) -> CuResult {
    unsafe { fill(dst, value, count) }
}

/// `cuPointerGetAttribute`: every pointer is "device" memory of device 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: DevicePtr,
) -> CuResult {
    if data.is_null() {
        return INVALID_VALUE;
    }
    match attribute {
        // CU_POINTER_ATTRIBUTE_CONTEXT
        1 => unsafe { put(data.cast::<Handle>(), context()) },
        // MEMORY_TYPE: device
        2 => unsafe { put(data.cast::<c_uint>(), 2) },
        // DEVICE_POINTER, HOST_POINTER
        3 | 4 => unsafe { put(data.cast::<u64>(), ptr) },
        // DEVICE_ORDINAL
        9 => unsafe { put(data.cast::<c_int>(), 0) },
        _ => NOT_SUPPORTED,
    }
}

// ------------------------------------------------------------------------------------------
// Modules and launches: the part that checks something.
// ------------------------------------------------------------------------------------------

/// One entry function of a loaded module.
#[derive(Debug)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// Registers and static shared memory from `ptxas -v`.
    pub resources: Resources,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
    pub max_dynamic_shared: AtomicU32,
    /// Whether a launch of it has been recorded.
    launched: AtomicBool,
}

/// A loaded module: its entry functions.
#[derive(Debug)]
pub struct Module {
    /// The PTX's hash (see [`record::hash`]).
    pub hash: String,
    /// Its entry functions (boxed: a `CUfunction` points at one).
    pub functions: Vec<Box<Function>>,
}

/// Modules assembled in this process, by PTX hash (a second load of the same PTX does not run
/// ptxas again).
fn assembled() -> &'static Mutex<HashMap<String, Arc<Assembled>>> {
    static A: OnceLock<Mutex<HashMap<String, Arc<Assembled>>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(HashMap::new()))
}

static SCRATCH: AtomicU64 = AtomicU64::new(0);

/// Assembles `ptx` (or takes this process's earlier result) and records the module.
fn load_ptx(ptx: &str) -> Result<Module, CuResult> {
    let hash = record::hash(ptx.as_bytes());
    let cached = assembled()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&hash)
        .cloned();
    let result = match cached {
        Some(r) => r,
        None => {
            let (version, target) = ptxas::version_and_target(ptx);
            let refused = ptxas::too_new(&version, device::MAX_PTX_VERSION);
            let r = Arc::new(match (refused, ptxas::ptxas_path()) {
                (Some(why), _) => Assembled::Failed(why),
                (None, None) => Assembled::Failed(
                    "no ptxas: set CUDA_STANDIN_PTXAS or put ptxas on PATH (pip install \
                     nvidia-cuda-nvcc; `cargo xtask ptx-check` finds it)"
                        .into(),
                ),
                (None, Some(ptxas)) => {
                    let scratch =
                        std::env::temp_dir().join(format!("cuda-standin-{}", std::process::id()));
                    let tag = format!("{hash}-{}", SCRATCH.fetch_add(1, Ordering::SeqCst));
                    let r = ptxas::assemble(&ptxas, ptx, device::PTXAS_ARCH, &scratch, &tag);
                    let _ = std::fs::remove_dir(&scratch);
                    r
                }
            });
            let libdevice = if ptxas::links_libdevice(ptx) {
                "libdevice"
            } else {
                "-"
            };
            match r.as_ref() {
                Assembled::Ok(functions) => {
                    let names: Vec<&str> = functions.keys().map(String::as_str).collect();
                    record::line(&[
                        "module",
                        &hash,
                        "ok",
                        &version,
                        &target,
                        libdevice,
                        &record::program(),
                        &names.join(","),
                    ]);
                }
                Assembled::Failed(why) => {
                    record::line(&[
                        "module",
                        &hash,
                        "failed",
                        &version,
                        &target,
                        libdevice,
                        &record::program(),
                        why,
                    ]);
                    record::keep_failed(&hash, ptx, why);
                    eprintln!(
                        "cuda-standin: PTX module {hash} refused (cuModuleLoadData fails with CUDA_ERROR_INVALID_PTX): {why}"
                    );
                }
            }
            assembled()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(hash.clone(), r.clone());
            r
        }
    };
    match result.as_ref() {
        Assembled::Failed(_) => Err(INVALID_PTX),
        Assembled::Ok(functions) => Ok(Module {
            hash,
            functions: functions
                .iter()
                .map(|(name, resources)| {
                    Box::new(Function {
                        name: name.clone(),
                        resources: *resources,
                        max_dynamic_shared: AtomicU32::new(launch::default_max_dynamic_shared(
                            resources,
                        )),
                        launched: AtomicBool::new(false),
                    })
                })
                .collect(),
        }),
    }
}

/// `cuModuleLoadData`: the image must be PTX text; it is assembled by ptxas for `sm_90a`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CuResult {
    if module.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: a PTX image is a NUL-terminated string (the driver's contract for text images).
    let bytes = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_bytes();
    let Ok(ptx) = std::str::from_utf8(bytes) else {
        return INVALID_IMAGE;
    };
    if !ptx.contains(".version") {
        // A cubin or fatbin: the stand-in only takes PTX.
        eprintln!("cuda-standin: cuModuleLoadData got an image that is not PTX text");
        return INVALID_IMAGE;
    }
    match load_ptx(ptx) {
        Ok(m) => unsafe { put(module, Box::into_raw(Box::new(m)).cast()) },
        Err(code) => code,
    }
}

/// `cuModuleLoadDataEx`: as [`cuModuleLoadData`]; the JIT options are ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut Handle,
    image: *const c_void,
    _num_options: c_uint,
    _options: *mut c_int,
    _values: *mut *mut c_void,
) -> CuResult {
    unsafe { cuModuleLoadData(module, image) }
}

/// `cuModuleUnload`: modules live for the process (a stale `CUfunction` never dangles).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(_module: Handle) -> CuResult {
    SUCCESS
}

/// `cuModuleGetFunction`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CuResult {
    if module.is_null() || name.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: a handle cuModuleLoadData returned (leaked, so live) and the caller's C string.
    let (m, name) = unsafe { (&*module.cast::<Module>(), CStr::from_ptr(name)) };
    let name = name.to_string_lossy();
    match m.functions.iter().find(|func| func.name == name) {
        Some(func) => unsafe { put(f, (&raw const **func).cast_mut().cast()) },
        None => NOT_FOUND,
    }
}

fn function<'a>(f: Handle) -> Option<&'a Function> {
    // SAFETY: a handle cuModuleGetFunction returned; its module is never freed.
    (!f.is_null()).then(|| unsafe { &*f.cast::<Function>() })
}

/// `cuFuncGetAttribute`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    f: Handle,
) -> CuResult {
    let Some(func) = function(f) else {
        return INVALID_HANDLE;
    };
    let v = match attrib {
        0 => device::MAX_THREADS_PER_BLOCK as c_int,
        1 => func.resources.shared_bytes as c_int,
        4 => func.resources.registers as c_int,
        5 | 6 => 90,
        8 => func.max_dynamic_shared.load(Ordering::SeqCst) as c_int,
        _ => 0,
    };
    unsafe { put(value, v) }
}

/// `cuFuncSetAttribute`: the dynamic shared memory opt-in is checked and kept; the others are
/// accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncSetAttribute(f: Handle, attrib: c_int, value: c_int) -> CuResult {
    let Some(func) = function(f) else {
        return INVALID_HANDLE;
    };
    if attrib == 8 {
        match launch::check_max_dynamic_shared(value, &func.resources) {
            Ok(v) => func.max_dynamic_shared.store(v, Ordering::SeqCst),
            Err(refused) => {
                refuse(func, &refused.reason);
                return refused.code;
            }
        }
    }
    SUCCESS
}

/// `cuFuncSetCacheConfig`: accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncSetCacheConfig(_f: Handle, _config: c_int) -> CuResult {
    SUCCESS
}

fn refuse(func: &Function, reason: &str) {
    record::line(&["launch", &func.name, "refused", reason]);
    eprintln!("cuda-standin: launch of {} refused: {reason}", func.name);
}

/// Checks `l` for `f` (see [`launch::check`]); runs nothing.
fn launch(f: Handle, l: Launch) -> CuResult {
    let Some(func) = function(f) else {
        return INVALID_HANDLE;
    };
    match launch::check(
        &l,
        &func.resources,
        func.max_dynamic_shared.load(Ordering::SeqCst),
    ) {
        Ok(()) => {
            if !func.launched.swap(true, Ordering::SeqCst) {
                record::line(&["launch", &func.name, "ok", ""]);
            }
            SUCCESS
        }
        Err(refused) => {
            refuse(func, &refused.reason);
            refused.code
        }
    }
}

/// `cuLaunchKernel`: the launch is checked against the device's limits and not run.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_bytes: c_uint,
    _stream: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    launch(
        f,
        Launch {
            grid: [grid_x, grid_y, grid_z],
            block: [block_x, block_y, block_z],
            dynamic_shared: shared_bytes,
        },
    )
}

/// `CUlaunchConfig`, as in `cuda.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LaunchConfig {
    /// Grid dimensions.
    pub grid: [c_uint; 3],
    /// Block dimensions.
    pub block: [c_uint; 3],
    /// Dynamic shared memory in bytes.
    pub shared_bytes: c_uint,
    /// The stream.
    pub stream: Handle,
    /// Launch attributes (ignored).
    pub attrs: *mut c_void,
    /// How many.
    pub num_attrs: c_uint,
}

/// `cuLaunchKernelEx`: as [`cuLaunchKernel`]; the attributes (clusters, …) are not checked.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    f: Handle,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    if config.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's configuration.
    let c = unsafe { *config };
    launch(
        f,
        Launch {
            grid: c.grid,
            block: c.block,
            dynamic_shared: c.shared_bytes,
        },
    )
}

/// `cuOccupancyMaxActiveBlocksPerMultiprocessor`: what the registers and shared memory allow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    blocks: *mut c_int,
    f: Handle,
    block_size: c_int,
    dynamic_shared: usize,
) -> CuResult {
    let Some(func) = function(f) else {
        return INVALID_HANDLE;
    };
    let threads = block_size.max(1) as u32;
    let regs = (func.resources.registers.div_ceil(8) * 8).max(8) * threads.div_ceil(32) * 32;
    let shared = func.resources.shared_bytes + dynamic_shared as u32;
    let by_regs = device::REGISTERS_PER_BLOCK / regs.max(1);
    let by_shared = device::SHARED_PER_SM.checked_div(shared).unwrap_or(32);
    let by_threads = 2048 / threads;
    unsafe {
        put(
            blocks,
            by_regs.min(by_shared).min(by_threads).min(32) as c_int,
        )
    }
}

// ------------------------------------------------------------------------------------------
// Errors and what the stand-in does not do.
// ------------------------------------------------------------------------------------------

fn error_text(code: CuResult) -> (&'static CStr, &'static CStr) {
    match code {
        SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        INVALID_IMAGE => (
            c"CUDA_ERROR_INVALID_IMAGE",
            c"device kernel image is invalid",
        ),
        INVALID_PTX => (
            c"CUDA_ERROR_INVALID_PTX",
            c"a PTX JIT compilation failed (cuda-standin: ptxas refused the module)",
        ),
        INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        launch::OUT_OF_RESOURCES => (
            c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            c"too many resources requested for launch",
        ),
        NOT_SUPPORTED => (
            c"CUDA_ERROR_NOT_SUPPORTED",
            c"operation not supported (by the cuda-standin)",
        ),
        _ => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
    }
}

/// `cuGetErrorName`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CuResult, name: *mut *const c_char) -> CuResult {
    unsafe { put(name, error_text(code).0.as_ptr()) }
}

/// `cuGetErrorString`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CuResult, text: *mut *const c_char) -> CuResult {
    unsafe { put(text, error_text(code).1.as_ptr()) }
}

/// `cuStreamBeginCapture_v2`: graphs are not supported (cubecl falls back to plain launches).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(_stream: Handle, _mode: c_int) -> CuResult {
    NOT_SUPPORTED
}
