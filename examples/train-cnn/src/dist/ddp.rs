//! The [`Cluster`] backed by burn-ddp: the rank processes of a job launched by `ddprun`,
//! torchrun or Slurm.

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Device;
use burn_ddp::{Ddp, DdpOptimizer};
use ddp_comm::ReduceOp;

use super::{Cluster, DistError, StepOptimizer};

fn err(e: impl std::fmt::Display) -> DistError {
    DistError(e.to_string())
}

/// A rank of a burn-ddp job.
pub struct DdpCluster {
    ddp: Ddp,
    device: Device,
    /// Shard the optimizer state across the ranks (`DdpOptimizer::sharded`).
    shard_optimizer: bool,
}

impl std::fmt::Debug for DdpCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpCluster")
            .field("rank", &self.ddp.rank())
            .field("world_size", &self.ddp.world_size())
            .finish()
    }
}

impl DdpCluster {
    /// Joins the job described by the launch environment (a world of one without it) and
    /// trains on `backend`'s device, with gradients on the wire as `compression` says
    /// (`None`: `DDP_COMPRESSION` decides).
    pub fn from_env(
        backend: Backend,
        compression: Option<ddp_comm::Compression>,
    ) -> Result<Self, DistError> {
        let builder = burn_ddp::Ddp::builder();
        let builder = match compression {
            Some(c) => builder.compression(c),
            None => builder,
        };
        let builder = match backend {
            Backend::Auto => builder,
            Backend::Cpu => builder.device(Device::flex()),
            #[cfg(feature = "wgpu")]
            Backend::Wgpu => builder.device(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(not(feature = "wgpu"))]
            Backend::Wgpu => {
                return Err(DistError(
                    "--backend wgpu needs train-cnn built with `--features wgpu`".into(),
                ));
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda => builder.cuda(),
            #[cfg(not(feature = "cuda"))]
            Backend::Cuda => {
                return Err(DistError(
                    "--backend cuda needs train-cnn built with `--features cuda` \
                     (cargo xtask train --gpus N does this)"
                        .into(),
                ));
            }
        };
        let ddp = builder.init().map_err(err)?;
        let device = ddp.device().clone().autodiff();
        Ok(Self {
            ddp,
            device,
            shard_optimizer: false,
        })
    }

    /// Shards the optimizer state across the ranks (ZeRO stage 1, `DdpOptimizer::sharded`):
    /// the same training, each rank holding the state of its own parameters only.
    pub fn with_sharded_optimizer(mut self, shard: bool) -> Self {
        self.shard_optimizer = shard;
        self
    }
}

/// Which device each rank trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Backend {
    /// CUDA device `LOCAL_RANK` when built with `cuda` and a CUDA device is usable, else the
    /// CPU (with a warning when built with `cuda`).
    #[default]
    Auto,
    /// The CPU backend (Flex).
    Cpu,
    /// wgpu's default adapter (build with `--features wgpu`).
    Wgpu,
    /// CUDA device `LOCAL_RANK` (build with `--features cuda`); an error without one.
    Cuda,
}

impl StepOptimizer for DdpOptimizer {
    fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
    ) -> Result<M, DistError> {
        self.try_step(lr, module, grads).map_err(err)
    }

    fn last_sync(&self) -> Option<burn_ddp::SyncStats> {
        Some(self.last_sync_stats())
    }
}

impl Cluster for DdpCluster {
    type Optimizer = DdpOptimizer;

    fn rank(&self) -> usize {
        self.ddp.rank()
    }

    fn world_size(&self) -> usize {
        self.ddp.world_size()
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn broadcast_model<M: Module>(&mut self, model: M) -> Result<M, DistError> {
        self.ddp.replicate_model(model).map_err(err)
    }

    fn optimizer(&mut self, inner: ModuleOptimizer) -> DdpOptimizer {
        if self.shard_optimizer {
            DdpOptimizer::sharded(&self.ddp, inner)
        } else {
            DdpOptimizer::new(&self.ddp, inner)
        }
    }

    fn all_reduce_sum(&mut self, values: &mut [f64]) -> Result<(), DistError> {
        self.ddp
            .with_group(|pg| pg.all_reduce(values, ReduceOp::Sum))
            .map_err(err)
    }

    fn group(&self) -> &burn_ddp::comm::SharedGroup {
        self.ddp.group()
    }

    fn barrier(&mut self) -> Result<(), DistError> {
        self.ddp.barrier().map_err(err)
    }
}
