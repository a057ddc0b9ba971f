//! Each rank's own buffers, kept by every rank so that a replacement gets its own back: the
//! non-trainable tensors of a model (plain BatchNorm's running statistics) differ from rank to
//! rank, since each rank's forward sees only its own batch, and the source of a hand-over has
//! only its own.
//!
//! Under live recovery [`crate::recovery::LiveTraining`] gathers every rank's buffers after each
//! step's forward and backward, **before** the gradient synchronisation (`RankBuffers::gather`).
//! A rank finishes step `k`'s synchronisation only once every rank has entered it, so every
//! survivor of a loss holds every rank's buffers as of the forward of any step that some rank
//! finished; the two latest gathers are kept, since a sharded optimizer (ZeRO-1) may go back a
//! step. After the hand-over, the lowest rank that holds the set for the step the group agreed
//! on broadcasts it, and every rank loads its own (`RankBuffers::restore`).
//!
//! The cost is one all-gather per step of the buffers' bytes (BatchNorm: 2 values per channel;
//! 38 KiB per rank for ResNet-18), only for models that have buffers and only under live
//! recovery. Trainable parameters are not touched: they come from the source.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_ddp_checkpoint::{pack_buffers, restore_buffers};

use crate::comm;
use crate::context::Ddp;
use crate::error::{DdpError, Result};

/// Every rank's buffers as of the forward of step `step` (0-based: the model after `step + 1`
/// finished steps holds them).
#[derive(Debug, Clone)]
struct Gathered {
    step: u64,
    by_rank: Vec<Vec<u8>>,
}

/// The buffers of every rank for the two latest steps whose forward this rank gathered.
#[derive(Debug, Default)]
pub(crate) struct RankBuffers {
    latest: Option<Gathered>,
    previous: Option<Gathered>,
}

impl RankBuffers {
    /// Gathers every rank's buffers after the forward of step `step` (collective).
    pub(crate) fn gather<M: Module>(&mut self, ddp: &Ddp, model: &M, step: u64) -> Result<()> {
        let own = pack_buffers(model);
        let by_rank = comm::lock(ddp.group()).all_gather_varlen(&own)?;
        self.keep(Gathered { step, by_rank });
        Ok(())
    }

    fn keep(&mut self, gathered: Gathered) {
        if self
            .latest
            .as_ref()
            .is_some_and(|l| l.step == gathered.step)
        {
            // The same step gathered again (redone after a loss): the newer replaces it.
            self.latest = Some(gathered);
        } else {
            self.previous = self.latest.replace(gathered);
        }
    }

    fn at(&self, step: u64) -> Option<&Gathered> {
        [&self.latest, &self.previous]
            .into_iter()
            .flatten()
            .find(|g| g.step == step)
    }

    /// After a hand-over to `finished` steps: every rank's own buffers as of the forward of
    /// step `finished - 1`, from the lowest rank that holds them, loaded into `model` (whose
    /// parameters came from the source). Collective. With no finished step, or where no rank
    /// holds them (a loss before the first gather), `model` keeps the source's.
    pub(crate) fn restore<M: Module>(&mut self, ddp: &Ddp, model: M, finished: u64) -> Result<M> {
        let Some(step) = finished.checked_sub(1) else {
            return Ok(model);
        };
        let held = self.at(step);
        let mut holders = vec![0u8; ddp.world_size()];
        let mut group = comm::lock(ddp.group());
        group.all_gather(&[u8::from(held.is_some())], &mut holders)?;
        let Some(holder) = holders.iter().position(|&h| h == 1) else {
            tracing::warn!(
                rank = ddp.rank(),
                step,
                "no rank holds the ranks' buffers of this step: the source's are used"
            );
            return Ok(model);
        };
        let mut bytes = match held {
            Some(g) if ddp.rank() == holder => encode(&g.by_rank),
            _ => Vec::new(),
        };
        group.broadcast_bytes(&mut bytes, holder)?;
        drop(group);
        let by_rank = decode(&bytes, ddp.world_size())?;
        let model = restore_buffers(model, &by_rank[ddp.rank()])?;
        self.keep(Gathered { step, by_rank });
        Ok(model)
    }
}

/// Whether `model` has buffers (non-trainable float tensors) to keep.
pub(crate) fn has_buffers<M: Module>(model: &M) -> bool {
    struct Any(bool);
    impl ModuleVisitor for Any {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 |= !param.is_require_grad();
        }
    }
    let mut any = Any(false);
    model.visit(&mut any);
    any.0
}

/// Length-prefixed concatenation of every rank's bytes.
fn encode(by_rank: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in by_rank {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

/// [`encode`]'s inverse, for `world` ranks.
fn decode(mut bytes: &[u8], world: usize) -> Result<Vec<Vec<u8>>> {
    let mut by_rank = Vec::with_capacity(world);
    for _ in 0..world {
        let (len, rest) = bytes
            .split_first_chunk::<8>()
            .ok_or_else(|| mismatch("the ranks' buffers end early".into()))?;
        let len = u64::from_le_bytes(*len) as usize;
        let b = rest
            .get(..len)
            .ok_or_else(|| mismatch("the ranks' buffers end early".into()))?;
        by_rank.push(b.to_vec());
        bytes = &rest[len..];
    }
    Ok(by_rank)
}

fn mismatch(reason: String) -> DdpError {
    DdpError::InvalidSetting {
        setting: "LiveTraining",
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
    use burn::tensor::Device;

    #[derive(Module, Debug)]
    struct Net {
        fc: Linear,
        bn: BatchNorm,
    }

    fn net(device: &Device) -> Net {
        Net {
            fc: LinearConfig::new(3, 4).init(device),
            bn: BatchNormConfig::new(4).init(device),
        }
    }

    #[test]
    fn a_model_has_buffers_when_a_float_tensor_takes_no_gradient() {
        let device = Device::flex().autodiff();
        assert!(has_buffers(&net(&device)));
        assert!(!has_buffers(&LinearConfig::new(3, 4).init(&device)));
    }

    #[test]
    fn every_rank_s_bytes_come_back_in_order() {
        let by_rank = vec![vec![1u8, 2], vec![], vec![3]];
        assert_eq!(decode(&encode(&by_rank), 3).unwrap(), by_rank);
        assert!(decode(&encode(&by_rank)[..5], 3).is_err());
    }

    #[test]
    fn the_two_latest_steps_are_kept() {
        let mut kept = RankBuffers::default();
        let g = |step| Gathered {
            step,
            by_rank: vec![vec![step as u8]],
        };
        kept.keep(g(3));
        kept.keep(g(4));
        kept.keep(g(4));
        assert!(kept.at(3).is_some() && kept.at(4).is_some());
        kept.keep(g(5));
        assert!(kept.at(3).is_none() && kept.at(4).is_some() && kept.at(5).is_some());
    }
}
