//! Optimizer state sharded across ranks (ZeRO stage 1): [`crate::DdpOptimizer::sharded`].
//!
//! Every rank keeps the whole model and computes the whole gradient, but the optimizer state
//! (Adam's two moments, SGD's momentum) of each parameter lives on one rank only, its
//! *owner* ([`assign_owners`]: largest parameters first, each to the least-loaded rank).
//! After backward a step is:
//!
//! 1. the gradients are **reduce-scattered** to their owners: laid out owner by owner, in
//!    buckets that hold a part of every owner's gradients, each averaged over all ranks by
//!    [`ddp_comm::ProcessGroup::reduce_scatter_compressed`] and kept only by its owner. The
//!    group sums every element in rank order, as its all-reduce does, so an owner's gradients
//!    are bitwise those [`crate::DdpOptimizer::new`] averages (bf16/fp16 wire compression
//!    applies here as there). Where every pair of ranks shares memory, the buckets are
//!    all-reduced instead and each rank keeps its own: there that costs less than the copies
//!    into owner-major buckets. On the NCCL device path the owner-major buckets are packed and
//!    reduce-scattered in device memory (NCCL's reduce order is its own: see docs/zero.md);
//! 2. each rank steps the wrapped Burn optimizer with its own gradients only, so the
//!    optimizer creates and updates state only for its own parameters;
//! 3. the updated parameters go from their owners to every rank as raw bytes in their own
//!    dtype: a large f32 parameter broadcast in its own buffer, the others all-gathered in
//!    buckets ([`ddp_comm::ProcessGroup::all_gather_into`], shards of any sizes), so every rank
//!    ends the step with bitwise the owner's values. On the NCCL device path they are
//!    all-gathered in device memory as f32 (`gather_on_device.rs`).
//!
//! For an element-wise optimizer (SGD with or without momentum and weight decay, Adam,
//! AdamW, …) the arithmetic of each parameter is the unsharded one, run on its owner: the
//! training is bitwise the same as with [`crate::DdpOptimizer::new`] on the host group (NCCL's
//! reduction order is its own: there it is not promised). Burn's gradient clipping
//! (`with_grad_clipping`) clips each parameter's gradient by its own value or norm and is
//! therefore exact too. Clipping by the *global* norm of all gradients
//! ([`crate::DdpOptimizer::with_global_norm_clipping`], PyTorch's `clip_grad_norm_`) needs one
//! more all-reduce, of each owner's per-parameter sums of squares, and is bitwise the unsharded
//! clipping too (`clip.rs`). What does not fit is an optimizer whose update mixes
//! parameters (Muon's orthogonalisation, L-BFGS): it needs every parameter's state on one rank
//! — use the unsharded optimizer for those.
//!
//! What is not sharded: the parameters and the gradients stay whole on every rank (that is
//! ZeRO stages 2 and 3). The traffic is a reduce-scatter of the gradients plus an all-gather
//! of the parameters per step: what one all-reduce moves.
//!
//! **Checkpoints** ([`crate::checkpoint::Checkpointer`]) hold the whole state in today's
//! format: on save the shards are gathered to rank 0 and merged (keyed by rank 0's parameter
//! ids), so a sharded run resumes unsharded, an unsharded run resumes sharded, and either
//! resumes at another world size; on load each rank keeps the entries of the parameters it
//! owns under the new world size.
//!
//! **Live recovery**: when the program recovers live ([`crate::Ddp::recovers_live`]), each rank
//! also keeps a copy of its predecessor's shard after every step (`redundancy.rs`: each rank
//! sends its shard to its successor, point to point), so that a lost rank's shard lives on in
//! its successor.
//!
//! The module holds the whole sharded path: the owners ([`assign_owners`], `plan.rs`), the
//! owner-major layout of what moves (`owner_streams.rs`), the gradients' reduce-scatter to
//! their owners (`owned_gradients.rs`, over the gradient synchroniser's slots and buckets), the
//! parameters' gather (`gather.rs`), the state's merge and split for checkpoints
//! (`state.rs`) and live recovery's copies (`redundancy.rs`). [`crate::DdpOptimizer`] only chooses between it and the unsharded step.

pub(crate) mod error;
mod gather;
mod gather_on_device;
mod owned_gradients;
mod owner_streams;
mod plan;
mod redundancy;
pub(crate) mod state;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Bytes;

use crate::comm::{self, SharedGroup};
use crate::cuda::DeviceComm;
use crate::error::Result;
use owned_gradients::OwnedGradients;

pub use error::ShardingError;
pub use plan::assign_owners;

use plan::{ShardPlan, layout_fingerprint, trainable_params};
use redundancy::Redundancy;
pub(crate) use redundancy::Snapshot;

/// What a sharded optimizer keeps besides the wrapped optimizer.
#[derive(Debug, Clone)]
pub(crate) struct Sharding {
    group: SharedGroup,
    cap_bytes: usize,
    plan: Option<ShardPlan>,
    /// A whole state loaded from a checkpoint, cut down to the owned parameters at the next
    /// step (when the model, and so the plan, is known).
    pending: Option<Vec<u8>>,
    last: ShardStats,
    /// Live recovery's copies of this rank's shard and its predecessor's (`redundancy.rs`).
    redundancy: Option<Redundancy>,
}

/// What the last step of a sharded optimizer did on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardStats {
    /// Trainable parameters of the model.
    pub params: usize,
    /// Of those, the ones this rank owns.
    pub owned_params: usize,
    /// Bytes of the parameters this rank owns.
    pub owned_bytes: usize,
    /// Bytes of all trainable parameters.
    pub total_bytes: usize,
    /// Parameter all-gather calls of the last step.
    pub gather_buckets: usize,
    /// Bytes this rank sent (its updated parameters) and received (the others') in them.
    pub gather_sent: usize,
    /// See [`Self::gather_sent`].
    pub gather_received: usize,
    /// Time the wrapped optimizer took to step this rank's parameters.
    pub optimizer_step: std::time::Duration,
    /// Time the parameter all-gather took (copies included).
    pub gather: std::time::Duration,
    /// Time live recovery's copies of the shards took (serialising this rank's shard, sending
    /// it to the successor and receiving the predecessor's); zero without live recovery.
    pub shard_copies: std::time::Duration,
}

impl Sharding {
    /// `keep_copies`: keep a copy of the predecessor's shard after every step, for live
    /// recovery (`redundancy.rs`).
    pub(crate) fn new(group: SharedGroup, cap_bytes: usize, keep_copies: bool) -> Self {
        Sharding {
            group,
            cap_bytes: cap_bytes.max(1),
            plan: None,
            pending: None,
            last: ShardStats::default(),
            redundancy: keep_copies.then(Redundancy::default),
        }
    }

    pub(crate) fn last_stats(&self) -> ShardStats {
        self.last
    }

    /// One step after the gradients were reduced to their owners: this rank steps its own
    /// parameters (`owned.grads` holds only theirs, so the optimizer keeps state for them
    /// only), then the updated parameters are all-gathered from their owners. See the
    /// module docs.
    pub(crate) fn step<M: Module>(
        &mut self,
        optim: &mut ModuleOptimizer,
        lr: burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate,
        module: M,
        owned: OwnedGradients,
        device_comm: Option<&DeviceComm>,
    ) -> Result<M> {
        let plan = self
            .plan
            .as_ref()
            .expect("prepared before the gradient sync");
        let stepped = owned.present;
        if let Some(redundancy) = &mut self.redundancy {
            // This step's host all-reduce of which parameters have gradients (made by every
            // rank before its update, on the NCCL path too) finished here: every rank finished
            // the last exchange, so the older copies go before the update makes the new state
            // beside them.
            redundancy.drop_older();
        }
        let t = std::time::Instant::now();
        let module = optim.step(lr, module, owned.grads);
        let optimizer_step = t.elapsed();
        let t = std::time::Instant::now();
        let (module, g) = match device_comm {
            // `on_device` is agreed by every rank: their gradients, and so their parameters,
            // are f32, f16 or bf16 on the communicator's device.
            Some(comm) if owned.on_device => gather_on_device::all_gather_params_on_device(
                module,
                plan,
                &stepped,
                comm,
                self.cap_bytes,
            )?,
            _ => gather::all_gather_params(module, plan, &stepped, &self.group, self.cap_bytes)?,
        };
        let gather = t.elapsed();
        let t = std::time::Instant::now();
        self.copy_shards(optim, 1)?;
        let shard_copies = t.elapsed();
        let plan = self
            .plan
            .as_ref()
            .expect("prepared before the gradient sync");
        let owned: Vec<usize> = (0..plan.params.len()).filter(|&i| plan.owns(i)).collect();
        self.last = ShardStats {
            params: plan.params.len(),
            owned_params: owned.len(),
            owned_bytes: owned.iter().map(|&i| plan.params[i].bytes).sum(),
            total_bytes: plan.params.iter().map(|p| p.bytes).sum(),
            gather_buckets: g.buckets,
            gather_sent: g.sent,
            gather_received: g.received,
            optimizer_step,
            gather,
            shard_copies,
        };
        Ok(module)
    }

    /// Makes the plan for `module`'s layout (collective, on the first step and whenever the
    /// layout changes: rank 0's ids are broadcast), loads a pending state's owned part, makes
    /// live recovery's first copies (before the first step), and returns the owner of each
    /// trainable parameter (visit order).
    pub(crate) fn prepare<M: Module>(
        &mut self,
        module: &M,
        optim: &mut ModuleOptimizer,
    ) -> Result<&[usize]> {
        self.plan_for(module)?;
        if let Some(whole) = self.pending.take() {
            let plan = self.plan.as_ref().expect("just made");
            let mine: std::collections::BTreeSet<u64> = (0..plan.params.len())
                .filter(|&i| plan.owns(i))
                .map(|i| plan.params[i].id.val())
                .collect();
            let known: std::collections::BTreeSet<u64> =
                plan.params.iter().map(|p| p.id.val()).collect();
            let in_state = state::ids_in(&whole)?;
            let unmatched = in_state.difference(&known).count();
            if unmatched > 0 {
                return Err(ShardingError::StateDoesNotFit {
                    unmatched,
                    total: in_state.len(),
                }
                .into());
            }
            let shard = state::transform(&[&whole], |id| mine.contains(&id).then_some(id))?;
            load_shard(optim, shard)?;
        }
        if self.redundancy.as_ref().is_some_and(Redundancy::is_empty) {
            self.copy_shards(optim, 0)?;
        }
        Ok(&self.plan.as_ref().expect("made above").owners)
    }

    /// Makes the plan for `module`'s layout when there is none or the layout changed
    /// (collective then: rank 0's ids are broadcast).
    fn plan_for<M: Module>(&mut self, module: &M) -> Result<()> {
        let params = trainable_params(module);
        let fingerprint = layout_fingerprint(&params);
        if self
            .plan
            .as_ref()
            .is_some_and(|p| p.fingerprint == fingerprint)
        {
            return Ok(());
        }
        let (rank, world_size) = {
            let g = comm::lock(&self.group);
            (g.rank(), g.world_size())
        };
        // Ids travel as i64 bit patterns (the group's integer element).
        let mut ids: Vec<i64> = params.iter().map(|p| p.id.val() as i64).collect();
        if world_size > 1 {
            comm::lock(&self.group).broadcast(&mut ids, 0)?;
        }
        let root_ids: Vec<u64> = ids.into_iter().map(|id| id as u64).collect();
        let sizes: Vec<usize> = params.iter().map(|p| p.bytes).collect();
        let owners = assign_owners(&sizes, world_size);
        let plan = ShardPlan {
            rank,
            world_size,
            params,
            root_ids,
            owners,
            fingerprint,
        };
        tracing::debug!(
            owned_bytes = ?plan.owned_bytes(),
            "optimizer state sharded over {world_size} rank(s)"
        );
        if let Some(redundancy) = &mut self.redundancy {
            let mine: Vec<u64> = plan.params.iter().map(|p| p.id.val()).collect();
            redundancy.learn_ids(&self.group, &mine)?;
        }
        self.plan = Some(plan);
        Ok(())
    }

    /// Live recovery's copies (when kept), as of `advance` more finished steps than the last
    /// copies' (0 before the first step, 1 after a step). Collective.
    fn copy_shards(&mut self, optim: &ModuleOptimizer, advance: u64) -> Result<()> {
        if let Some(redundancy) = &mut self.redundancy {
            let at = redundancy.completed() + advance;
            redundancy.exchange(&self.group, optim, at)?;
        }
        Ok(())
    }

    /// Live recovery: whether this optimizer keeps copies of the shards (the program recovers
    /// live), and the steps it finished.
    pub(crate) fn finished_steps(&self) -> Option<u64> {
        self.redundancy.as_ref().map(Redundancy::completed)
    }

    /// Live recovery: the copies as of `at` finished steps, if still held.
    pub(crate) fn copies_at(&self, at: u64) -> Option<&Snapshot> {
        self.redundancy.as_ref().and_then(|r| r.at(at))
    }

    /// Live recovery, on every rank once the model is the same everywhere: plans again for
    /// `module` (collective), loads `own` (a shard keyed by position, from this rank's copies
    /// or its successor's) into `optim`, and starts the copies again at `finished` steps with
    /// one exchange (collective).
    pub(crate) fn restore<M: Module>(
        &mut self,
        module: &M,
        optim: &mut ModuleOptimizer,
        own: Vec<u8>,
        finished: u64,
    ) -> Result<()> {
        self.plan = None;
        self.pending = None;
        self.plan_for(module)?;
        let plan = self.plan.as_ref().expect("just made");
        let ids: Vec<u64> = plan.params.iter().map(|p| p.id.val()).collect();
        let shard = state::transform(&[&own], |pos| ids.get(pos as usize).copied())?;
        load_shard(optim, shard)?;
        let redundancy = self
            .redundancy
            .as_mut()
            .expect("restore is called for an optimizer that keeps copies");
        redundancy.restart_at(finished);
        redundancy.exchange(&self.group, optim, finished)
    }

    /// Keeps a whole state (from a checkpoint) until the next step.
    pub(crate) fn load_whole(&mut self, whole: Vec<u8>) {
        self.pending = Some(whole);
    }

    /// The whole state on rank 0 (`None` on the others): every rank's shard, keyed by rank
    /// 0's parameter ids, merged. Collective.
    pub(crate) fn gather_whole(&self, optim: &ModuleOptimizer) -> Result<Option<Vec<u8>>> {
        let (rank, world_size) = {
            let g = comm::lock(&self.group);
            (g.rank(), g.world_size())
        };
        // A state loaded but not yet cut down is the whole state on every rank already.
        let mine = match (&self.pending, &self.plan) {
            (Some(whole), _) => {
                if rank == 0 {
                    whole.clone()
                } else {
                    Vec::new()
                }
            }
            (None, Some(plan)) => {
                let own = redundancy::shard_bytes(optim)?.to_vec();
                let to_root: std::collections::HashMap<u64, u64> = plan
                    .params
                    .iter()
                    .zip(&plan.root_ids)
                    .map(|(p, &root)| (p.id.val(), root))
                    .collect();
                state::transform(&[&own], |id| to_root.get(&id).copied())?
            }
            (None, None) => optim
                .into_bytes()
                .map_err(|e| ShardingError::State(format!("this rank's state: {e}")))?
                .to_vec(),
        };
        if world_size == 1 {
            return Ok(Some(mine));
        }
        let parts = comm::lock(&self.group).all_gather_varlen::<u8>(&mine)?;
        if rank != 0 {
            return Ok(None);
        }
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        Ok(Some(state::transform(&parts, Some)?))
    }
}

/// Replaces `optim`'s state by `shard` (burnpack bytes keyed by this process's ids).
fn load_shard(optim: &mut ModuleOptimizer, shard: Vec<u8>) -> Result<()> {
    *optim = optim
        .clone()
        .from_bytes(Bytes::from_bytes_vec(shard))
        .map_err(|e| ShardingError::State(format!("loading this rank's shard: {e}")))?;
    Ok(())
}
