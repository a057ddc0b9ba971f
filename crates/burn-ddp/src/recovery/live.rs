//! [`LiveTraining`]: live recovery with the loop's shape kept. It holds what a rank's training
//! is — the model, the [`DdpOptimizer`], the [`Progress`] and the program's own state — and
//! takes each step itself, so that what a loop had to do for [`Ddp::recover`] is the library's:
//! keeping the step's start ([`StepStart`]: the running statistics a failed forward changed),
//! running the forward and backward inside [`Ddp::catch_lost_peer`] (SyncBatchNorm's exchange
//! runs inside them), re-forming the group and handing the state over on a lost peer, and
//! redoing the step at the progress the group agreed on. It also keeps what a hand-over of the
//! model alone would lose: each rank's own buffers (plain BatchNorm's running statistics,
//! `rank_buffers.rs`) and, with [`LiveStart::seeded`], the random state of every step.
//!
//! ```ignore
//! let ddp = Ddp::builder().live_recovery().init()?;
//! let model = ddp.replicate_model(model)?;
//! let optim = DdpOptimizer::new(&ddp, SgdConfig::new().init());
//! // A replacement takes the survivors' model, optimizer, progress and state here.
//! // The program's state (here the loss summed over every rank and step) is handed over too.
//! let mut live = ddp.live(model, optim).seeded(42).start(Progress::default(), 0.0f64)?;
//! while live.progress().step < steps {
//!     if live.progress().step % 100 == 0 {
//!         live.collective(|live| evaluate(live.ddp(), live.model()))?;  // between steps
//!     }
//!     let summed = live.step(lr, |model, progress| {
//!         let (x, y) = batch(progress.step);                  // the batch of this step
//!         let loss = model.forward(x).loss(y);
//!         let value = loss.clone().into_scalar::<f32>() as f64;
//!         (GradientsParams::from_grads(loss.backward(), model), [value])  // summed over ranks
//!     })?;
//!     if let Some([loss]) = summed {
//!         *live.state_mut() += loss;
//!     }
//! }
//! let (model, optim, progress, loss_sum) = live.into_parts();
//! ```
//!
//! **The state is the same on every rank**: a replacement takes the source's, and a survivor
//! that rolls forward does too. Update it only from what every rank holds alike — the sums
//! [`LiveTraining::step`] returns (added over the ranks inside the step, so that a step and its
//! sums are finished together or not at all), the progress, or what
//! [`LiveTraining::collective`] returns — never from a rank's own values.
//!
//! Without live recovery (no [`crate::DdpBuilder::live_recovery`], no `ddprun --recover live`,
//! or a world of one) [`LiveTraining::step`] is [`DdpOptimizer::try_step`] after the passes,
//! with nothing kept: the same loop runs either way, and gives the same numbers.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn_ddp_checkpoint::Progress;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::StepStart;
use super::rank_buffers::{self, RankBuffers};
use crate::context::Ddp;
use crate::error::{DdpError, Result};
use crate::optimizer::DdpOptimizer;

/// A rank's training under live recovery: model, optimizer, progress and the program's own
/// state `S` (metrics so far, anything a survivor must hand a replacement), stepped by
/// [`LiveTraining::step`]. See the [module docs](crate::recovery) and its example.
pub struct LiveTraining<M: Module, S> {
    ddp: Ddp,
    /// `None` only while a step or a recovery holds it.
    model: Option<M>,
    optim: DdpOptimizer,
    progress: Progress,
    /// `None` only while a recovery holds it.
    state: Option<S>,
    /// The seed of every step's random state, when [`LiveStart::seeded`].
    seed: Option<u64>,
    /// [`LiveStart::batches_from_progress`].
    batches_from_progress: bool,
    /// Every rank's buffers, when the model has any and the job recovers live.
    buffers: Option<RankBuffers>,
    /// The [`LiveTraining::collective`] calls the group finished since the last finished step
    /// (as far as this rank knows: a hand-over may say more than this rank made).
    units: u64,
    /// The [`LiveTraining::collective`] calls the program made since the last finished step
    /// (or since it took a hand-over).
    calls: u64,
    recoveries: u64,
}

impl<M: Module, S> std::fmt::Debug for LiveTraining<M, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveTraining")
            .field("rank", &self.ddp.rank())
            .field("progress", &self.progress)
            .field("seed", &self.seed)
            .field("keeps_rank_buffers", &self.buffers.is_some())
            .field("recoveries", &self.recoveries)
            .finish()
    }
}

impl Ddp {
    /// Starts a training that recovers a lost rank live ([`LiveTraining`]) from `model` as
    /// every rank holds it (after [`Ddp::replicate_model`], or restored from a checkpoint) and
    /// `optim`: set its options on the [`LiveStart`], then [`LiveStart::start`] it.
    pub fn live<M: Module>(&self, model: M, optim: DdpOptimizer) -> LiveStart<M> {
        LiveStart {
            ddp: self.clone(),
            model,
            optim,
            seed: None,
            keep_rank_buffers: true,
            batches_from_progress: false,
        }
    }
}

/// The options of a [`LiveTraining`], before it starts ([`Ddp::live`]). Every rank must set the
/// same.
pub struct LiveStart<M: Module> {
    ddp: Ddp,
    model: M,
    optim: DdpOptimizer,
    seed: Option<u64>,
    keep_rank_buffers: bool,
    batches_from_progress: bool,
}

impl<M: Module> std::fmt::Debug for LiveStart<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveStart")
            .field("rank", &self.ddp.rank())
            .field("seed", &self.seed)
            .field("keep_rank_buffers", &self.keep_rank_buffers)
            .finish()
    }
}

impl<M: Module> LiveStart<M> {
    /// Seeds the device's random generator before each step's passes with a value of
    /// `seed`, the rank and the step (whatever the backend's generator), so that a step redone
    /// after a recovery, or by a replacement, draws what it drew the first time: dropout and
    /// augmentation on the device recover bitwise. Burn's backends do not expose their
    /// generator's state, so it cannot be handed over; with live recovery, draw random numbers
    /// only inside [`LiveTraining::step`] (or from a generator of the program's own, kept in
    /// its state), never from the device's generator between steps.
    pub fn seeded(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Whether to keep every rank's buffers (non-trainable tensors: BatchNorm's running
    /// statistics) for a replacement: on by default, under live recovery and when the model
    /// has any. Turn it off where every rank's buffers are the same (SyncBatchNorm only), to
    /// save the all-gather each step makes; a replacement then takes the source's.
    pub fn keep_rank_buffers(mut self, keep: bool) -> Self {
        self.keep_rank_buffers = keep;
        self
    }

    /// Says that the passes build each step's batch from the progress they get (a function of
    /// `progress.step`, or the loader's position in it), not from a batch taken before the call.
    /// Only then may a recovery with a sharded optimizer (ZeRO-1), which goes back to the fewest
    /// steps a survivor finished, redo the step before inside [`LiveTraining::step`]; without
    /// it such a recovery fails with one line (the launcher restarts the group from its
    /// checkpoint), since the batch at hand is the next step's. Unsharded, a recovery never
    /// goes back, and the batch at hand is always right.
    pub fn batches_from_progress(mut self) -> Self {
        self.batches_from_progress = true;
        self
    }

    /// Starts at `progress` (the default, or a checkpoint's) with the program's own `state`.
    /// In a process started in place of a lost rank ([`Ddp::is_replacement`]) it takes the
    /// survivors' model, optimizer state, progress and state right away: position the data from
    /// [`LiveTraining::progress`] after this call.
    ///
    /// # Errors
    /// As [`Ddp::recover`], for a replacement.
    pub fn start<S>(self, progress: Progress, state: S) -> Result<LiveTraining<M, S>>
    where
        S: Serialize + DeserializeOwned,
    {
        let LiveStart {
            ddp,
            model,
            optim,
            seed,
            keep_rank_buffers,
            batches_from_progress,
        } = self;
        let keep = keep_rank_buffers && ddp.recovers_live() && rank_buffers::has_buffers(&model);
        let replacement = ddp.is_replacement();
        let mut live = LiveTraining {
            ddp,
            model: Some(model),
            optim,
            progress,
            state: Some(state),
            seed,
            batches_from_progress,
            buffers: keep.then(RankBuffers::default),
            units: 0,
            calls: 0,
            recoveries: 0,
        };
        if replacement {
            let model = live.model.take().expect("just built");
            live.recover(model)?;
        }
        Ok(live)
    }
}

impl<M, S> LiveTraining<M, S>
where
    M: Module,
    S: Serialize + DeserializeOwned,
{
    /// One optimizer step at [`LiveTraining::progress`]: `passes` runs the forward and backward
    /// of that step's batch on the model and returns the gradients with `N` values of its own
    /// (a loss × batch size, correct predictions, the batch size); then the values are summed
    /// over the ranks (in rank order: the same bits on every rank), the gradients
    /// synchronised, the optimizer steps and the progress counts one more step. Returns the
    /// sums. A rank's own values (not summed) can be written by `passes` to what it captures.
    ///
    /// Under live recovery a peer lost anywhere in it (the forward or backward, a collective of
    /// `passes` itself, the synchronisation) is recovered here: the step's start is restored,
    /// the group re-formed, the state handed over, and `passes` runs again at the progress the
    /// group agreed on. When that progress is past this step (a survivor had finished it: the
    /// run rolls forward), this rank's step is done without running `passes` again, and the
    /// return is `Ok(None)`: the state already counts the step (it came from that survivor).
    ///
    /// `passes` gets the progress of the step to take: build that step's batch from it (a
    /// function of `progress.step`, or of the sharded loader's position), or use the batch
    /// taken for it. A sharded optimizer (ZeRO-1) may go back a step in a recovery, and then
    /// calls `passes` for the step before: see [`LiveTraining::progress`].
    ///
    /// # Errors
    /// A lost peer without live recovery; what [`Ddp::recover`] could not recover; any other
    /// error of the synchronisation.
    pub fn step<const N: usize>(
        &mut self,
        lr: impl Into<ModuleLearningRate> + Clone,
        mut passes: impl FnMut(&M, &Progress) -> (GradientsParams, [f64; N]),
    ) -> Result<Option<[f64; N]>> {
        let this_step = self.progress.step;
        // Collectives of the program's own made since the step before: a recovery that goes
        // back over them (ZeRO-1) cannot redo them.
        let calls_before = self.calls;
        loop {
            let model = self
                .model
                .take()
                .expect("the model is back after every step");
            if let Some(seed) = self.seed {
                self.ddp
                    .device()
                    .seed(step_seed(seed, self.ddp.rank(), self.progress.step));
            }
            let live = self.ddp.recovers_live();
            let start = live.then(|| StepStart::take(&model));
            let progress = self.progress;
            let ddp = self.ddp.clone();
            let tried =
                ddp.catch_lost_peer(|| passes(&model, &progress))
                    .and_then(|(grads, mut sums)| {
                        if let Some(buffers) = &mut self.buffers {
                            buffers.gather(&ddp, &model, progress.step)?;
                        }
                        if N > 0 {
                            let mut group = crate::comm::lock(ddp.group());
                            if group.world_size() > 1 {
                                group.all_reduce(&mut sums, ddp_comm::ReduceOp::Sum)?;
                            }
                        }
                        let stepped = self.optim.try_step(lr.clone(), model.clone(), grads)?;
                        Ok((stepped, sums))
                    });
            match tried {
                Ok((stepped, sums)) => {
                    self.model = Some(stepped);
                    self.progress.step += 1;
                    self.units = 0;
                    self.calls = 0;
                    return Ok(Some(sums));
                }
                Err(e) if e.lost_a_peer() && live => {
                    tracing::warn!(
                        rank = self.ddp.rank(),
                        step = progress.step,
                        "lost a peer ({e}); re-forming the group with its replacement"
                    );
                    let before = match start {
                        Some(s) => s.restore(model),
                        None => model,
                    };
                    self.recover(before)?;
                    if self.progress.step > this_step {
                        // The program's collectives after the step the group reached come
                        // next; those the group made are skipped.
                        self.calls = 0;
                        return Ok(None);
                    }
                    if self.progress.step < this_step
                        && (calls_before > 0 || !self.batches_from_progress)
                    {
                        return Err(went_back(this_step, calls_before));
                    }
                }
                Err(e) => {
                    self.model = Some(model);
                    return Err(e);
                }
            }
        }
    }

    /// Runs `f`, a part of the program that makes collectives between steps (an evaluation, a
    /// metric's all-reduce, a checkpoint save), on the training as it stands. Every rank must
    /// make the same calls in the same order between two steps: they are counted, and the
    /// count is handed over with the state. A peer lost in `f` is recovered as in
    /// [`LiveTraining::step`]; then `f` runs again on the recovered state, or, where another
    /// rank had finished this call (the state it handed over counts it), returns `Ok(None)`.
    /// `f` may run more than once, so it must give the same result each time from the same
    /// state (write files atomically); add to the state what it returns, after it.
    ///
    /// **Make these calls at the top of the loop, from the progress** (`if
    /// live.progress().step % 100 == 0 { live.collective(evaluate)?; }` before the step), not
    /// after a step: a replacement starts at the top of the loop with the progress the group
    /// reached, so it makes the calls the others make next, and the calls the group already
    /// made return `Ok(None)` at once, without running `f`. A program that decides from its
    /// state whether a call is still to be made (an epoch's metrics already in the history)
    /// must make no other call before the next step: the count goes by calls, not by their
    /// purpose.
    ///
    /// # Errors
    /// What `f` returned that is not a lost peer (or a lost peer without live recovery), or a
    /// recovery's error.
    pub fn collective<O, E>(
        &mut self,
        mut f: impl FnMut(&Self) -> std::result::Result<O, E>,
    ) -> std::result::Result<Option<O>, E>
    where
        E: From<DdpError> + MaybeLostPeer + std::fmt::Display,
    {
        let (this_step, this_unit) = (self.progress.step, self.calls);
        self.calls += 1;
        if this_unit < self.units {
            // Made by the group before this rank took its state (a replacement, or a rank that
            // rolled forward): the state counts it.
            return Ok(None);
        }
        loop {
            let tried = {
                let ddp = self.ddp.clone();
                ddp.catch_lost_peer(|| f(self))
                    .map_err(E::from)
                    .and_then(|r| r)
            };
            match tried {
                Ok(out) => {
                    self.units = this_unit + 1;
                    return Ok(Some(out));
                }
                Err(e) if e.lost_a_peer() && self.ddp.recovers_live() => {
                    tracing::warn!(
                        rank = self.ddp.rank(),
                        step = this_step,
                        call = this_unit,
                        "lost a peer between steps ({e}); re-forming the group"
                    );
                    let model = self.model.take().expect("the model is there between steps");
                    self.recover(model).map_err(E::from)?;
                    let here = (self.progress.step, self.units);
                    if here > (this_step, this_unit) {
                        return Ok(None);
                    }
                    if here < (this_step, this_unit) {
                        return Err(E::from(went_back(this_step, this_unit)));
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Re-forms the group and takes the state the group agreed on, with this rank's own
    /// buffers.
    fn recover(&mut self, model: M) -> Result<()> {
        let state = self.state.take().expect("the state is there between steps");
        let (model, progress, units, state) =
            self.ddp
                .recover_between(model, &mut self.optim, self.progress, self.units, state)?;
        let model = match &mut self.buffers {
            Some(buffers) => buffers.restore(&self.ddp, model, progress.step)?,
            None => model,
        };
        self.model = Some(model);
        self.progress = progress;
        self.units = units;
        self.state = Some(state);
        self.recoveries += 1;
        Ok(())
    }

    /// Where the training stands: the steps finished, and what the program records with
    /// [`LiveTraining::progress_mut`] (epochs, the sharded loader's position). After a
    /// recovery it is the progress the group agreed on: a loop that positions its data from
    /// it (`loader.load_state(progress.loader)`) redoes nothing and skips nothing.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The progress, for the program's own records (epochs finished, the sharded loader's
    /// position after a step): handed over with the state. [`LiveTraining::step`] counts the
    /// steps itself.
    pub fn progress_mut(&mut self) -> &mut Progress {
        &mut self.progress
    }

    /// The model as of the last finished step.
    pub fn model(&self) -> &M {
        self.model
            .as_ref()
            .expect("the model is there between steps")
    }

    /// The program's own state.
    pub fn state(&self) -> &S {
        self.state
            .as_ref()
            .expect("the state is there between steps")
    }

    /// The program's own state, to update after a step: a replacement gets it as it stands
    /// after the last finished step.
    pub fn state_mut(&mut self) -> &mut S {
        self.state
            .as_mut()
            .expect("the state is there between steps")
    }

    /// The optimizer (its statistics; what a checkpoint saves).
    pub fn optimizer(&self) -> &DdpOptimizer {
        &self.optim
    }

    /// How many times this rank took a recovered state (a replacement's first one counts).
    pub fn recoveries(&self) -> u64 {
        self.recoveries
    }

    /// The job's context.
    pub fn ddp(&self) -> &Ddp {
        &self.ddp
    }

    /// Ends the training: its model, optimizer, progress and state.
    pub fn into_parts(self) -> (M, DdpOptimizer, Progress, S) {
        (
            self.model.expect("the model is there between steps"),
            self.optim,
            self.progress,
            self.state.expect("the state is there between steps"),
        )
    }
}

/// An error a lost peer may have caused: what [`LiveTraining::collective`] recovers from. A
/// program's own error type implements it by asking the [`DdpError`] it wraps, if any.
pub trait MaybeLostPeer {
    /// Whether a lost peer caused this error ([`DdpError::lost_a_peer`]).
    fn lost_a_peer(&self) -> bool;
}

impl MaybeLostPeer for DdpError {
    fn lost_a_peer(&self) -> bool {
        DdpError::lost_a_peer(self)
    }
}

/// The error of a recovery that went back to an earlier step (a sharded optimizer: the fewest
/// steps any survivor finished) where this rank cannot redo it: past collectives of the
/// program's own that it made after that step, or with passes that take the batch at hand
/// (not [`LiveStart::batches_from_progress`]). The rank fails with it, an error of its own,
/// which `ddprun --recover live` answers with a restart of the group from its checkpoint.
fn went_back(step: u64, units: u64) -> DdpError {
    let reason = if units > 0 {
        format!(
            "the recovery went back before step {step}, over {units} collective(s) of the \
             program's own made after it (a sharded optimizer goes back to the fewest steps a \
             survivor finished); restart from the checkpoint"
        )
    } else {
        format!(
            "the recovery went back before step {step} (a sharded optimizer goes back to the \
             fewest steps a survivor finished), and the batch at hand is step {step}'s \
             (LiveStart::batches_from_progress not set); restart from the checkpoint"
        )
    };
    DdpError::InvalidSetting {
        setting: "LiveTraining",
        reason,
    }
}

/// The seed of step `step` on rank `rank`: xxh3 of the two, keyed by `seed` (neighbouring
/// steps and ranks get unrelated streams; the same three, the same seed).
fn step_seed(seed: u64, rank: usize, step: u64) -> u64 {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&(rank as u64).to_le_bytes());
    key[8..].copy_from_slice(&step.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64_with_seed(&key, seed)
}

#[cfg(test)]
mod tests {
    use super::step_seed;

    #[test]
    fn every_rank_and_step_has_its_own_seed_and_the_same_one_again() {
        let mut seen = std::collections::HashSet::new();
        for rank in 0..4 {
            for step in 0..100 {
                assert!(seen.insert(step_seed(42, rank, step)));
                assert_eq!(step_seed(42, rank, step), step_seed(42, rank, step));
            }
        }
        assert_ne!(step_seed(1, 0, 0), step_seed(2, 0, 0));
    }
}
