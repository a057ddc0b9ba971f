//! Live recovery of a lost rank: the survivors re-form the group with a replacement process and
//! hand it their state from memory, without a restart and without reading a checkpoint.
//!
//! A loop opts in with [`crate::DdpBuilder::live_recovery`] and runs under `ddprun --recover
//! live`. When a step's gradient synchronisation fails because a peer was lost
//! ([`DdpError::lost_a_peer`]), every survivor calls [`Ddp::recover`] with the model it held
//! before the step and its progress; the replacement, started by the launcher with
//! `DDP_REJOIN=1`, calls it right after `init`. Then:
//!
//! 1. the survivors re-form the process group in its next generation, the replacement in it
//!    ([`ddp_comm::ProcessGroup::reform`] and `rejoin`);
//! 2. every rank says how many optimizer steps it has finished; the **source** is the lowest
//!    rank among those that finished the most. A rank whose all-reduce of step `k` completed
//!    holds every rank's contribution to it, so when the peer died after some survivors
//!    finished step `k` and before others did, the run rolls forward to the end of step `k`;
//!    when none finished it, everyone is at its start (the failed step's update was never
//!    applied: [`crate::DdpOptimizer`] updates only after a synchronisation that succeeded);
//! 3. the source broadcasts its model record, its optimizer state and its [`Progress`] (the
//!    step, and the sharded loader's position) in the checkpoint's own encoding, and every
//!    other rank restores them, so every rank holds the source's state bitwise;
//! 4. the caller redoes the step at the returned progress: the same batch (a pure function of
//!    the seed and the step, or the loader's restored position) on the same parameters gives
//!    the step of the run that never failed, bitwise, since every reduction sums in rank order.
//!
//! A step's forward and backward run inside [`Ddp::catch_lost_peer`] when the model has
//! SyncBatchNorm layers: their exchange runs inside Burn's forward and backward, which cannot
//! return errors, so a lost peer there unwinds to it instead of panicking. A model
//! with running statistics (BatchNorm, SyncBatchNorm) takes a [`StepStart`] before each step: the
//! failed step's forward already updated them, and the step is redone from their values before
//! it. [`Ddp::recover_with`] also hands over the program's own state (its metrics so far).
//!
//! On CUDA ranks whose gradients go through NCCL, the survivors also abort their NCCL
//! communicator after step 1 and create the next one with the replacement's (which creates its
//! own in `init`, right after joining the group); the survivors first tell the group whether
//! the ranks use NCCL (a one-byte max-all-reduce the replacement takes part in).
//!
//! A sharded optimizer (ZeRO-1) recovers from the copies of each shard it keeps when the program
//! recovers live, going back to the step every survivor can reach (`sharded.rs`).
//!
//! Rank 0 is replaced as any rank where the launcher serves the ranks' store (`ddprun --recover
//! live` does); where rank 0 serves it, its loss takes the store and the job restarts.
//! Per-rank BatchNorm statistics of the replaced rank come from the source with
//! [`Ddp::recover`] alone, as after a resume at another world size (SyncBatchNorm's are the same
//! on every rank); [`LiveTraining`] keeps every rank's and gives the replacement its own.
//!
//! [`LiveTraining`] (`live.rs`) does all of the above for a loop: it takes each step, keeps
//! what a recovery needs, recovers and redoes the step; most programs need nothing else.

mod live;
mod rank_buffers;
mod restarted;
mod sharded;
mod step_start;
pub(crate) mod unwind;

pub use live::{LiveStart, LiveTraining, MaybeLostPeer};
pub use restarted::restarted;
pub use step_start::StepStart;

use std::path::PathBuf;
use std::time::Instant;

use burn::module::Module;
use burn_ddp_checkpoint::{Checkpoint, Progress};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::checkpoint::OptimizerState;
use crate::comm;
use crate::context::Ddp;
use crate::error::{DdpError, Result};
use crate::optimizer::DdpOptimizer;

impl DdpError {
    /// Whether this error is a lost peer's doing (a connection closed, an I/O error or a
    /// timeout on a link, or a group an earlier such error broke): what [`Ddp::recover`]
    /// recovers from.
    pub fn lost_a_peer(&self) -> bool {
        matches!(self, DdpError::Comm(e) if unwind::comm_lost_a_peer(e))
    }
}

impl Ddp {
    /// Whether this process was started in place of a lost rank (`DDP_REJOIN=1` under `ddprun
    /// --recover live`, with [`crate::DdpBuilder::live_recovery`]) and has not received the
    /// survivors' state yet: it must call [`Ddp::recover`] before its first step. `false` once
    /// a [`Ddp::recover`] succeeded: from then on it is a rank like the others.
    pub fn is_replacement(&self) -> bool {
        self.awaiting_handover()
    }

    /// Runs `f` (a step's forward and backward) so that a lost peer inside SyncBatchNorm's
    /// exchange, which Burn's forward and backward cannot return, comes back as `Err` with
    /// [`DdpError::lost_a_peer`] instead of a panic; then call [`Ddp::recover`] as for a failed
    /// gradient synchronisation. Any other panic goes on unwinding. What `f` built is dropped.
    ///
    /// # Errors
    /// [`DdpError::Comm`]: the peer lost inside `f`.
    pub fn catch_lost_peer<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        unwind::catching(f).map_err(DdpError::Comm)
    }

    /// Whether a lost rank of this job is replaced while the others run: the program declared
    /// [`crate::DdpBuilder::live_recovery`], its launcher runs `--recover live` (`DDP_RECOVER=live`
    /// on every rank) and the world has more than one rank. A loop keeps what [`Ddp::recover`]
    /// needs (a [`StepStart`], its progress) only then.
    pub fn recovers_live(&self) -> bool {
        self.recovers_live
    }

    /// Re-forms the group after a lost rank and gives every rank the same state; see the
    /// [module docs](self). Survivors pass the model they held before the failed step (a
    /// clone kept before [`DdpOptimizer::try_step`], or [`StepStart::restore`]'s) and their
    /// progress; a replacement passes its freshly built model and [`Progress::default`]. Returns
    /// the model and progress to go on from: redo the step at `progress.step`. Collective over
    /// the re-formed group.
    ///
    /// # Errors
    /// [`DdpError::InvalidSetting`] for what it does not cover (a sharded optimizer without
    /// copies of its shards, a shard that no rank holds any more);
    /// [`DdpError::Comm`] when the group or its NCCL communicator cannot re-form (no
    /// replacement within `DDP_CONNECT_TIMEOUT_SECS`, a second loss); [`DdpError::Checkpoint`]
    /// when the state does not fit this model or optimizer.
    pub fn recover<M: Module>(
        &self,
        model: M,
        optim: &mut DdpOptimizer,
        progress: Progress,
    ) -> Result<(M, Progress)> {
        let (model, progress, ()) = self.recover_with(model, optim, progress, ())?;
        Ok((model, progress))
    }

    /// [`Ddp::recover`], also handing over the program's own state `state` (what a checkpoint
    /// keeps as its metadata: metrics so far, the epoch's sums): every rank returns the
    /// source's. A replacement passes any value (its `Default`); it is replaced.
    ///
    /// # Errors
    /// As [`Ddp::recover`].
    pub fn recover_with<M: Module, T: Serialize + DeserializeOwned>(
        &self,
        model: M,
        optim: &mut DdpOptimizer,
        progress: Progress,
        state: T,
    ) -> Result<(M, Progress, T)> {
        let (model, progress, _, state) = self.recover_between(model, optim, progress, 0, state)?;
        Ok((model, progress, state))
    }

    /// [`Ddp::recover_with`] for a rank that made `units` collectives of the program's own
    /// since its last finished step ([`LiveTraining::collective`]): the group agrees on the
    /// furthest (steps, units) a rank reached (sharded: the fewest steps a survivor finished,
    /// then the most units at them), and returns the units with the rest.
    pub(crate) fn recover_between<M: Module, T: Serialize + DeserializeOwned>(
        &self,
        model: M,
        optim: &mut DdpOptimizer,
        progress: Progress,
        units: u64,
        state: T,
    ) -> Result<(M, Progress, u64, T)> {
        if optim.is_sharded() && !optim.recovers_with_copies() {
            return Err(refuse(
                "this sharded optimizer (ZeRO-1) keeps no copy of the shards (it was built \
                 without live recovery: DdpOptimizer::sharded on a Ddp whose recovers_live() \
                 is false), and the lost rank's shard exists nowhere else; restart from the \
                 checkpoint",
            ));
        }
        let _span = ddp_comm::trace::span("recover", "ddp").arg("step", progress.step);
        let deadline = Instant::now() + self.recovery_deadline();
        // A replacement holds no state until a hand-over completes; its first try uses the
        // group it joined in `init`. Every later try (a rank lost during this recovery), and
        // every survivor's first, re-forms the group first.
        let mut holding = Holding {
            model,
            progress,
            units,
            state,
            has_state: !self.awaiting_handover(),
        };
        let mut reform = holding.has_state;
        loop {
            if reform {
                // c10d's order: the NCCL communicator aborted first, so that a kernel still
                // waiting on the lost rank returns; then the host group's next generation
                // (which gives up generations that lose a rank while they form, within its
                // connect deadline; its failure is final); then the device communicator.
                self.abort_device_comm();
                comm::lock(self.group()).reform()?;
                if let Err(e) = self.reform_device_comm() {
                    if e.lost_a_peer() && Instant::now() < deadline {
                        tracing::warn!(
                            rank = self.rank(),
                            "a rank was lost while the group re-formed ({e}); re-forming again"
                        );
                        continue;
                    }
                    return Err(e);
                }
            }
            reform = true;
            match self.hand_over(holding, optim) {
                Ok(done) => {
                    self.handover_done();
                    return Ok(done);
                }
                Err(HandOverError::Interrupted {
                    error,
                    holding: back,
                }) if Instant::now() < deadline => {
                    tracing::warn!(
                        rank = self.rank(),
                        "a rank was lost during the hand-over of the state ({error}); \
                         re-forming again"
                    );
                    holding = *back;
                }
                Err(HandOverError::Interrupted { error, .. } | HandOverError::Failed(error)) => {
                    return Err(error);
                }
            }
        }
    }

    /// One try at giving every rank of the re-formed group the same state: every rank says
    /// how many steps it finished, the source is chosen, and broadcasts its state, which the
    /// others restore. A rank lost meanwhile interrupts it, handing back what this rank holds
    /// (so that the next try, in the next generation, starts from it).
    fn hand_over<M: Module, T: Serialize + DeserializeOwned>(
        &self,
        holding: Holding<M, T>,
        optim: &mut DdpOptimizer,
    ) -> std::result::Result<(M, Progress, u64, T), HandOverError<M, T>> {
        let sharded = optim.is_sharded();
        let exchanged = {
            let mut pg = comm::lock(self.group());
            // Every rank's finished steps and the collectives of the program's own it made
            // since (`LiveTraining::collective`); a replacement without state has none (-1).
            let mine = if holding.has_state {
                [holding.progress.step as i64, holding.units as i64]
            } else {
                [-1, 0]
            };
            let mut both = vec![0i64; 2 * self.world_size()];
            pg.all_gather(&mine, &mut both)
                .map(|()| (both, pg.generation()))
        };
        let (both, generation) = match exchanged {
            Ok(x) => x,
            Err(e) => return Err(HandOverError::back(e.into(), holding)),
        };
        let steps: Vec<i64> = both.iter().step_by(2).copied().collect();
        let units: Vec<i64> = both.iter().skip(1).step_by(2).copied().collect();
        // Unsharded, the run rolls forward to the survivor that finished the most steps;
        // sharded, it goes back to the one that finished the fewest (`sharded.rs`). Among
        // those, the one that made the most collectives since.
        let chosen = if sharded {
            sharded::target(&steps).map(|(t, _)| furthest_at(&steps, &units, t as i64))
        } else {
            let most = steps.iter().copied().max().filter(|&m| m >= 0);
            most.map(|m| furthest_at(&steps, &units, m))
        };
        let Some(source) = chosen else {
            // Every rank that held the state was lost (a survivor died during the hand-over
            // to the replacements): a restart from the checkpoint, noted as the lost ranks'
            // failure relayed, so that the launcher restarts the group rather than replacing
            // this rank too.
            let reason = "every rank that held the training state was lost during the \
                          recovery; restart from the checkpoint";
            if let Some(lost) = steps.iter().position(|&s| s < 0) {
                ddp_comm::failure_note::note_peer_failure(lost, reason);
            }
            return Err(HandOverError::Failed(refuse(reason)));
        };
        let agreed_units = units[source] as u64;
        let shard = if sharded {
            let t = steps[source] as u64;
            if holding.has_state && holding.progress.step > t {
                tracing::warn!(
                    rank = self.rank(),
                    from = holding.progress.step,
                    to = t,
                    "sharded optimizer: going back to the step every survivor can reach"
                );
            }
            match sharded::shard_at(self, optim, &steps, holding.progress.step, t) {
                Ok(own) => Some(own),
                Err(e) => return Err(HandOverError::back(e, holding)),
            }
        } else {
            None
        };
        let mut bytes = if self.rank() == source {
            let captured = (|| {
                let optimizer = if sharded {
                    Vec::new()
                } else {
                    optim.state_bytes()?
                };
                Ok::<_, DdpError>(
                    Checkpoint::capture_with_state(
                        &holding.model,
                        optimizer,
                        holding.progress,
                        self.world_size(),
                        &holding.state,
                    )?
                    .to_bytes()?,
                )
            })();
            match captured {
                Ok(b) => b,
                Err(e) => return Err(HandOverError::Failed(e)),
            }
        } else {
            Vec::new()
        };
        if let Err(e) = comm::lock(self.group()).broadcast_bytes(&mut bytes, source) {
            return Err(HandOverError::back(e.into(), holding));
        }
        // Equal parameters by construction: the first synchronisation of a replacement's fresh
        // optimizer must not compare them (the survivors' would not: a collective of its own).
        optim.synchronizer_mut().skip_replica_check();
        let Holding {
            model,
            progress,
            state,
            ..
        } = holding;
        let (model, progress, state) = if self.rank() == source {
            tracing::warn!(
                rank = self.rank(),
                generation,
                step = progress.step,
                "re-formed the group after a lost rank; handed this rank's state to the others"
            );
            (model, progress, state)
        } else {
            let origin = PathBuf::from(format!("<state handed over by rank {source}>"));
            let restored = (|| {
                let ck = Checkpoint::<T>::from_bytes(&bytes, &origin)?;
                let model = ck.restore_model(model, &origin)?;
                if !sharded {
                    optim.load_state_bytes(ck.optimizer)?;
                }
                Ok::<_, DdpError>((model, ck.progress, ck.metadata))
            })();
            let (model, progress, state) = restored.map_err(HandOverError::Failed)?;
            tracing::warn!(
                rank = self.rank(),
                generation,
                source,
                step = progress.step,
                "re-formed the group after a lost rank; took rank {source}'s state"
            );
            (model, progress, state)
        };
        if let Some(own) = shard {
            // Collective: the plan again for the model every rank now holds, then the copies.
            // A rank lost here leaves the shards half re-planned: the launcher restarts the
            // group from the checkpoint (the poisoned group noted the peer's failure).
            optim
                .restore_shard(&model, own, progress.step)
                .map_err(HandOverError::Failed)?;
        }
        Ok((model, progress, agreed_units, state))
    }
}

/// The lowest rank among those that finished `t` steps (`steps`, by rank) with the most
/// collectives of the program's own since (`units`).
fn furthest_at(steps: &[i64], units: &[i64], t: i64) -> usize {
    let most = (0..steps.len())
        .filter(|&r| steps[r] == t)
        .map(|r| units[r])
        .max()
        .unwrap_or(0);
    (0..steps.len())
        .find(|&r| steps[r] == t && units[r] == most)
        .expect("a rank finished t steps")
}

/// What a rank holds when a try at the hand-over begins.
struct Holding<M, T> {
    model: M,
    progress: Progress,
    /// The program's collectives since its last finished step.
    units: u64,
    state: T,
    /// `false` for a replacement that has not received a state yet (its model is fresh).
    has_state: bool,
}

/// Why a try at the hand-over ended without one.
enum HandOverError<M, T> {
    /// A rank was lost during it: what this rank held, for the next try.
    Interrupted {
        error: DdpError,
        holding: Box<Holding<M, T>>,
    },
    /// Anything else: the recovery fails with it.
    Failed(DdpError),
}

impl<M, T> HandOverError<M, T> {
    /// `error` interrupted a try at the point where this rank still holds `holding`: a lost
    /// peer's doing is retried, anything else fails the recovery.
    fn back(error: DdpError, holding: Holding<M, T>) -> Self {
        if error.lost_a_peer() {
            HandOverError::Interrupted {
                error,
                holding: Box::new(holding),
            }
        } else {
            HandOverError::Failed(error)
        }
    }
}

/// The error of a recovery this module does not cover.
fn refuse(reason: &str) -> DdpError {
    DdpError::InvalidSetting {
        setting: "Ddp::recover",
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::furthest_at;

    #[test]
    fn the_source_is_the_lowest_rank_furthest_between_steps() {
        assert_eq!(furthest_at(&[5, 5, -1], &[0, 0, 0], 5), 0);
        assert_eq!(furthest_at(&[5, 5, -1], &[1, 2, 0], 5), 1);
        assert_eq!(furthest_at(&[6, 5, 5], &[0, 3, 3], 5), 1);
    }
}
