//! The checks the driver makes before it launches a kernel, against the device in
//! [`crate::device`].

use crate::device;
use crate::ptxas::Resources;

/// A kernel launch as `cuLaunchKernel` receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes.
    pub dynamic_shared: u32,
}

/// Why the driver refuses a launch, with the `CUresult` it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// `CUDA_ERROR_INVALID_VALUE` (1) or `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES` (701).
    pub code: u32,
    /// What exceeded which limit.
    pub reason: String,
}

/// `CUDA_ERROR_INVALID_VALUE`.
pub const INVALID_VALUE: u32 = 1;
/// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`.
pub const OUT_OF_RESOURCES: u32 = 701;

/// Checks `launch` of a function with `resources` whose dynamic shared memory may reach
/// `max_dynamic_shared` bytes (its `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
pub fn check(
    launch: &Launch,
    resources: &Resources,
    max_dynamic_shared: u32,
) -> Result<(), Refused> {
    let invalid = |reason: String| {
        Err(Refused {
            code: INVALID_VALUE,
            reason,
        })
    };
    let axes = ["x", "y", "z"].into_iter().enumerate();
    for (i, axis) in axes {
        let (block, grid) = (launch.block[i], launch.grid[i]);
        if block == 0 || block > device::MAX_BLOCK_DIM[i] {
            return invalid(format!(
                "block dimension {axis} = {block} outside 1..={}",
                device::MAX_BLOCK_DIM[i]
            ));
        }
        if grid == 0 || grid > device::MAX_GRID_DIM[i] {
            return invalid(format!(
                "grid dimension {axis} = {grid} outside 1..={}",
                device::MAX_GRID_DIM[i]
            ));
        }
    }
    let threads: u64 = launch.block.iter().map(|&d| u64::from(d)).product();
    if threads > u64::from(device::MAX_THREADS_PER_BLOCK) {
        return invalid(format!(
            "{threads} threads per block > {}",
            device::MAX_THREADS_PER_BLOCK
        ));
    }
    if launch.dynamic_shared > max_dynamic_shared {
        return invalid(format!(
            "{} bytes of dynamic shared memory > the function's limit of {max_dynamic_shared} \
             (static {} bytes; raise it with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, at \
             most {} in all)",
            launch.dynamic_shared,
            resources.shared_bytes,
            device::MAX_SHARED_PER_BLOCK_OPTIN
        ));
    }
    let shared = u64::from(resources.shared_bytes) + u64::from(launch.dynamic_shared);
    if shared > u64::from(device::MAX_SHARED_PER_BLOCK_OPTIN) {
        return invalid(format!(
            "{shared} bytes of shared memory per block (static {} + dynamic {}) > {}",
            resources.shared_bytes,
            launch.dynamic_shared,
            device::MAX_SHARED_PER_BLOCK_OPTIN
        ));
    }
    // Registers are allocated per warp, in units of 8 per thread (256 per warp).
    let warps = threads.div_ceil(u64::from(device::WARP_SIZE));
    let per_thread = u64::from(resources.registers.div_ceil(8) * 8);
    let registers = warps * u64::from(device::WARP_SIZE) * per_thread;
    if registers > u64::from(device::REGISTERS_PER_BLOCK) {
        return Err(Refused {
            code: OUT_OF_RESOURCES,
            reason: format!(
                "{threads} threads × {} registers = {registers} registers per block > {}",
                resources.registers,
                device::REGISTERS_PER_BLOCK
            ),
        });
    }
    Ok(())
}

/// The dynamic shared memory a function may use before `cuFuncSetAttribute` raises it.
pub fn default_max_dynamic_shared(resources: &Resources) -> u32 {
    device::DEFAULT_SHARED_PER_BLOCK.saturating_sub(resources.shared_bytes)
}

/// Checks a `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` value for a function.
pub fn check_max_dynamic_shared(value: i32, resources: &Resources) -> Result<u32, Refused> {
    let limit = device::MAX_SHARED_PER_BLOCK_OPTIN.saturating_sub(resources.shared_bytes);
    match u32::try_from(value) {
        Ok(v) if v <= limit => Ok(v),
        _ => Err(Refused {
            code: INVALID_VALUE,
            reason: format!(
                "max dynamic shared memory {value} > {limit} (227 KiB less {} static)",
                resources.shared_bytes
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(block: [u32; 3], dynamic_shared: u32) -> Launch {
        Launch {
            grid: [4, 1, 1],
            block,
            dynamic_shared,
        }
    }

    const SMALL: Resources = Resources {
        registers: 32,
        shared_bytes: 1024,
    };

    #[test]
    fn a_plain_launch_passes() {
        assert_eq!(check(&launch([256, 1, 1], 0), &SMALL, 47 * 1024), Ok(()));
        assert_eq!(check(&launch([32, 32, 1], 4096), &SMALL, 47 * 1024), Ok(()));
    }

    #[test]
    fn too_many_threads_is_refused() {
        let e = check(&launch([1024, 2, 1], 0), &SMALL, 0).unwrap_err();
        assert_eq!(e.code, INVALID_VALUE);
        assert!(e.reason.contains("2048 threads"), "{}", e.reason);
        assert!(check(&launch([1, 1, 65], 0), &SMALL, 0).is_err());
        assert!(check(&launch([0, 1, 1], 0), &SMALL, 0).is_err());
    }

    #[test]
    fn shared_memory_over_the_opt_in_is_refused() {
        let max = default_max_dynamic_shared(&SMALL);
        assert_eq!(max, 47 * 1024);
        // Over the default without the attribute.
        assert!(check(&launch([128, 1, 1], 64 * 1024), &SMALL, max).is_err());
        // Allowed once raised.
        let raised = check_max_dynamic_shared(100 * 1024, &SMALL).unwrap();
        assert_eq!(
            check(&launch([128, 1, 1], 64 * 1024), &SMALL, raised),
            Ok(())
        );
        // The attribute itself cannot pass 227 KiB in all.
        assert!(check_max_dynamic_shared(227 * 1024, &SMALL).is_err());
    }

    #[test]
    fn registers_times_threads_are_bounded() {
        let heavy = Resources {
            registers: 128,
            shared_bytes: 0,
        };
        assert_eq!(check(&launch([512, 1, 1], 0), &heavy, 0), Ok(()));
        let e = check(&launch([1024, 1, 1], 0), &heavy, 0).unwrap_err();
        assert_eq!(e.code, OUT_OF_RESOURCES);
        // 65 registers round up to 72 per thread: 1024 × 72 > 65 536.
        let odd = Resources {
            registers: 65,
            shared_bytes: 0,
        };
        assert!(check(&launch([1024, 1, 1], 0), &odd, 0).is_err());
    }
}
