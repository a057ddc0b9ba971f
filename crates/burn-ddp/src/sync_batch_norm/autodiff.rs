//! The `Autodiff` implementation of [`SyncBatchNormBackend`]: the forward operations pass
//! through, and the backward pass makes the one cross-rank all-reduce of `[Σdy, Σdy·(x−μ)]`.

use burn::backend::{
    TensorMetadata,
    autodiff::{
        Autodiff, NodeId,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    tensor::FloatTensor,
};
use burn::tensor::Shape;

use super::backend::SyncBatchNormBackend;
use burn_ddp_batchnorm::CombineOptions;
use burn_ddp_batchnorm::tensor_ops;

#[derive(Debug)]
struct SyncBatchNormBackward;

impl<B: SyncBatchNormBackend> Backward<B, 3> for SyncBatchNormBackward {
    // x and γ are checkpointed; the channel parameters come from the forward pass.
    type State = (NodeId, NodeId, FloatTensor<B>, bool);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, gamma_state, params, kernels) = ops.state;
        let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
        let gamma: FloatTensor<B> = checkpointer.retrieve_node_output(gamma_state);
        let channels = params.shape()[1];
        let row = |t: FloatTensor<B>, r: usize| tensor_ops::row_of::<B>(t, r, channels);
        let invstd = row(params.clone(), 2);

        // Local Σdy and Σdy·(x − μ) in f32 (zero on a rank without samples), on the device.
        let local = if x.shape().num_elements() > 0 {
            B::sync_bn_grad_sums(grad.clone(), x.clone(), params.clone(), kernels)
        } else {
            B::float_zeros(
                Shape::new([2, channels]),
                &x.device(),
                burn::tensor::FloatDType::F32,
            )
        };

        // γ and β: local gradients (averaged across ranks by DDP like any parameter), in the
        // dtype γ and β had in the forward pass (the input's; see `SyncBatchNorm::forward`).
        let param_dtype = gamma.dtype();
        if let Some(node) = node_gamma {
            let g = B::float_mul(row(local.clone(), 1), invstd.clone());
            grads.register::<B>(node.id, tensor_ops::to_dtype::<B>(g, param_dtype));
        }
        if let Some(node) = node_beta {
            let g = row(local.clone(), 0);
            grads.register::<B>(node.id, tensor_ops::to_dtype::<B>(g, param_dtype));
        }

        if let Some(node) = node_x {
            // One all-reduce of the 2C sums: every rank's input gradient depends on all samples.
            let global = super::exchange::Exchange::current()
                .all_reduce_sum::<B>(local)
                .unwrap_or_else(|e| {
                    // The autodiff backward pass can't return errors; the collective is broken
                    // on every rank, so every rank stops with this message (or, inside
                    // `Ddp::catch_lost_peer`, unwinds there on a lost peer).
                    let e = super::error::unwind_if_lost_peer(e);
                    tracing::error!(
                        "SyncBatchNorm backward: all-reduce of the per-channel sums failed: {e}"
                    );
                    panic!("SyncBatchNorm backward: all-reduce of the per-channel sums failed: {e}")
                });
            let dx = if x.shape().num_elements() > 0 {
                B::sync_bn_grad_input(grad, x, params, gamma, global, kernels)
            } else {
                grad
            };
            grads.register::<B>(node.id, dx);
        }
    }
}

impl<B: SyncBatchNormBackend, C: CheckpointStrategy> SyncBatchNormBackend for Autodiff<B, C> {
    fn sync_bn_stats(x: FloatTensor<Self>, kernels: bool) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_stats(x.into_primitive(), kernels))
    }

    fn sync_bn_combine(
        gathered: FloatTensor<Self>,
        local: FloatTensor<Self>,
        running_mean: FloatTensor<Self>,
        running_var: FloatTensor<Self>,
        options: CombineOptions,
        kernels: bool,
    ) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_combine(
            gathered.into_primitive(),
            local.into_primitive(),
            running_mean.into_primitive(),
            running_var.into_primitive(),
            options,
            kernels,
        ))
    }

    fn sync_bn_normalize(
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        let params = params.into_primitive();
        match SyncBatchNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let gamma_state = prep.checkpoint(&gamma);
                let output = B::sync_bn_normalize(
                    x.into_primitive(),
                    params.clone(),
                    gamma.into_primitive(),
                    beta.into_primitive(),
                    kernels,
                );
                prep.finish((x_state, gamma_state, params, kernels), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::sync_bn_normalize(
                x.into_primitive(),
                params,
                gamma.into_primitive(),
                beta.into_primitive(),
                kernels,
            )),
        }
    }

    fn sync_bn_grad_sums(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_grad_sums(
            grad.into_primitive(),
            x.into_primitive(),
            params.into_primitive(),
            kernels,
        ))
    }

    fn sync_bn_grad_input(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        sums: FloatTensor<Self>,
        kernels: bool,
    ) -> FloatTensor<Self> {
        FloatTensor::<Self>::new(B::sync_bn_grad_input(
            grad.into_primitive(),
            x.into_primitive(),
            params.into_primitive(),
            gamma.into_primitive(),
            sums.into_primitive(),
            kernels,
        ))
    }
}
