//! The device the stand-in reports: an NVIDIA H200 (Hopper, sm 9.0) under a CUDA 13.0 driver.
//!
//! The numbers are the ones `cuDeviceGetAttribute` returns on an H200 SXM; attributes not
//! listed read as 0 ("not supported"), which sends cubecl to its plain paths.

/// The driver version reported by `cuDriverGetVersion` (CUDA 13.0): cubecl-cuda picks the PTX
/// version from it (PTX 9.0), so the ptxas used must accept that version.
pub const DRIVER_VERSION: i32 = 13000;

/// The newest PTX ISA version a CUDA 13.0 driver loads (9.0): a module of a newer version fails
/// `cuModuleLoadData` as it would on the device (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`), e.g. the
/// PTX 9.5 of NVRTC 13.5.
pub const MAX_PTX_VERSION: (u32, u32) = (9, 0);

/// The device name reported by `cuDeviceGetName`.
pub const NAME: &str = "NVIDIA H200 (cuda-standin: no GPU, kernels never run)";

/// The architecture ptxas assembles for (`sm_90a`: Hopper with its arch-specific features, what
/// cubecl-cuda targets on an H200).
pub const PTXAS_ARCH: &str = "sm_90a";

/// Global memory reported (the H200's 141 GB, as `cuDeviceTotalMem` gives it).
pub const TOTAL_MEMORY: usize = 150_754_820_096;

/// Threads per block.
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;
/// Block dimensions x, y, z.
pub const MAX_BLOCK_DIM: [u32; 3] = [1024, 1024, 64];
/// Grid dimensions x, y, z.
pub const MAX_GRID_DIM: [u32; 3] = [i32::MAX as u32, 65_535, 65_535];
/// Shared memory per block without opting in (static plus dynamic).
pub const DEFAULT_SHARED_PER_BLOCK: u32 = 48 * 1024;
/// Shared memory per block with `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` (227 KiB).
pub const MAX_SHARED_PER_BLOCK_OPTIN: u32 = 227 * 1024;
/// Shared memory per multiprocessor (228 KiB).
pub const SHARED_PER_SM: u32 = 228 * 1024;
/// 32-bit registers per block (and per multiprocessor).
pub const REGISTERS_PER_BLOCK: u32 = 65_536;
/// Registers per thread at most.
pub const MAX_REGISTERS_PER_THREAD: u32 = 255;
/// Threads in a warp.
pub const WARP_SIZE: u32 = 32;
/// Streaming multiprocessors.
pub const MULTIPROCESSORS: i32 = 132;

/// The value of device attribute `attribute` (the `CUdevice_attribute` number).
pub fn attribute(attribute: i32) -> i32 {
    match attribute {
        1 => MAX_THREADS_PER_BLOCK as i32,
        2..=4 => MAX_BLOCK_DIM[(attribute - 2) as usize] as i32,
        5..=7 => MAX_GRID_DIM[(attribute - 5) as usize] as i32,
        8 => DEFAULT_SHARED_PER_BLOCK as i32,
        9 => 65_536,                      // total constant memory
        10 => WARP_SIZE as i32,           // warp size
        11 => i32::MAX,                   // max pitch
        12 => REGISTERS_PER_BLOCK as i32, // registers per block
        13 => 1_980_000,                  // clock rate, kHz
        14 => 512,                        // texture alignment
        15 => 1,                          // GPU overlap
        16 => MULTIPROCESSORS,
        19 => 1,         // can map host memory
        31 => 1,         // concurrent kernels
        32 => 1,         // ECC
        33 => 0x19,      // PCI bus id
        36 => 2_619_000, // memory clock, kHz
        37 => 6144,      // memory bus width
        38 => 60 * 1024 * 1024,
        39 => 2048, // threads per multiprocessor
        40 => 5,    // async engines
        41 => 1,    // unified addressing
        75 => 9,    // compute capability major
        76 => 0,    // minor
        78 => 1,    // stream priorities
        79 | 80 => 1,
        81 => SHARED_PER_SM as i32,
        82 => REGISTERS_PER_BLOCK as i32,
        83 => 1, // managed memory
        86 => 1,
        95 => 1, // cooperative launch
        97 => MAX_SHARED_PER_BLOCK_OPTIN as i32,
        106 => 32,   // blocks per multiprocessor
        111 => 1024, // reserved shared memory per block
        115 => 1,    // memory pools
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_an_h200() {
        assert_eq!((attribute(75), attribute(76)), (9, 0));
        assert_eq!(attribute(16), 132);
        assert_eq!(attribute(97), 227 * 1024);
        assert_eq!(attribute(1), 1024);
        assert_eq!(attribute(4), 64);
        assert_eq!(attribute(7), 65_535);
        assert_eq!(attribute(10_000), 0);
    }
}
