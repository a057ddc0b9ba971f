//! The element types NCCL moves and reduces, and NCCL's name for each [`ReduceOp`].

use std::fmt;

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::NcclType;
use cudarc::nccl::sys::ncclRedOp_t;

use ddp_comm::ReduceOp;

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL moves and reduces on the device: `f32`, `f64`, `i32`, `i64`, `u8`,
/// and the 16-bit floats `half::bf16` and `half::f16` (compressed gradients).
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
nccl_element!(f32, f64, i32, i64, u8, half::bf16, half::f16);

/// NCCL's operation for a [`ReduceOp`] in a communicator of `world` ranks. `Mean` is
/// `ncclAvg`: for floats a pre-multiplied sum, for integers a sum followed by an integer
/// division (truncating, like Rust's `/`).
///
/// In a world of one, `Mean` is `ncclSum` (the same values: `x / 1 = x`). NCCL 2.28.3 on an
/// H200 (driver 580, CUDA 13.0) left the last of 4099 f64 values unwritten by an out-of-place
/// one-rank `ncclAvg` (the GPU check's first run, 2026-12-04), while `ncclSum` copied them all.
pub(crate) fn nccl_op(op: ReduceOp, world: usize) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Mean if world == 1 => ncclRedOp_t::ncclSum,
        ReduceOp::Mean => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_ops_map_to_ncclavg_for_mean_except_in_a_world_of_one() {
        assert_eq!(nccl_op(ReduceOp::Sum, 2), ncclRedOp_t::ncclSum);
        assert_eq!(nccl_op(ReduceOp::Mean, 2), ncclRedOp_t::ncclAvg);
        assert_eq!(nccl_op(ReduceOp::Max, 2), ncclRedOp_t::ncclMax);
        assert_eq!(nccl_op(ReduceOp::Min, 2), ncclRedOp_t::ncclMin);
        assert_eq!(nccl_op(ReduceOp::Mean, 1), ncclRedOp_t::ncclSum);
        assert_eq!(<f32 as NcclElement>::NAME, "f32");
        assert_eq!(<i64 as NcclElement>::NAME, "i64");
    }
}
