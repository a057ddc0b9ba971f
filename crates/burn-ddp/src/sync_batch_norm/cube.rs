//! [`SyncBatchNormBackend`] on the `Cube` backend (wgpu, CUDA, …): the CubeCL kernels of
//! `burn-ddp-batchnorm`, or its tensor-op reference when `kernels` is `false`.

use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_ddp_batchnorm::{kernels, tensor_ops};

use super::CombineOptions;
use super::backend::SyncBatchNormBackend;

impl SyncBatchNormBackend for CubeBackend {
    fn sync_bn_stats(x: FloatTensor<Self>, use_kernels: bool) -> FloatTensor<Self> {
        if use_kernels {
            kernels::stats(x)
        } else {
            tensor_ops::stats::<Self>(x)
        }
    }

    fn sync_bn_combine(
        gathered: FloatTensor<Self>,
        local: FloatTensor<Self>,
        running_mean: FloatTensor<Self>,
        running_var: FloatTensor<Self>,
        options: CombineOptions,
        use_kernels: bool,
    ) -> FloatTensor<Self> {
        if use_kernels {
            kernels::combine(gathered, local, running_mean, running_var, options)
        } else {
            tensor_ops::combine::<Self>(gathered, local, running_mean, running_var, options)
        }
    }

    fn sync_bn_normalize(
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        use_kernels: bool,
    ) -> FloatTensor<Self> {
        if use_kernels {
            kernels::normalize(x, params, gamma, beta)
        } else {
            tensor_ops::normalize::<Self>(x, params, gamma, beta)
        }
    }

    fn sync_bn_grad_sums(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        use_kernels: bool,
    ) -> FloatTensor<Self> {
        if use_kernels {
            kernels::grad_sums(grad, x, params)
        } else {
            tensor_ops::grad_sums::<Self>(grad, x, params)
        }
    }

    fn sync_bn_grad_input(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        sums: FloatTensor<Self>,
        use_kernels: bool,
    ) -> FloatTensor<Self> {
        if use_kernels {
            kernels::grad_input(grad, x, params, gamma, sums)
        } else {
            tensor_ops::grad_input::<Self>(grad, x, params, gamma, sums)
        }
    }
}
