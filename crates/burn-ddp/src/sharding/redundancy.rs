//! A second copy of every rank's optimizer shard, for live recovery with a sharded optimizer
//! (ZeRO-1 under `ddprun --recover live`): a lost rank's shard exists nowhere else, so after
//! every step each rank keeps its own shard and its predecessor's (rank `r` keeps rank
//! `r − 1`'s, modulo the world size), as of the last finished step (and the one before, from a
//! step's end until the next step's update). A lost rank's shard
//! then lives on in its successor, at the step every survivor can go back to (see
//! `recovery::sharded`); two neighbouring ranks lost together take a shard with them.
//!
//! The copies travel point to point: after each step every rank sends its own shard (its
//! burnpack bytes as the optimizer writes them, keyed by the rank's own parameter ids) to its
//! successor only ([`ddp_comm::ProcessGroup::shift_bytes`]), into the buffer of the copy that
//! was dropped last (no fresh allocation per step). A rank's own shard is kept as the optimizer
//! itself (a clone: its state tensors are shared, not copied); it becomes bytes only at a
//! recovery. Every rank's ids in the model's visit order are all-gathered once per plan, so
//! that a copy is re-keyed by parameter position (the same in every process) only when a
//! recovery needs it. The older copies are dropped once a collective of the next step that
//! every rank takes part in has finished on this rank — the host all-reduce of which
//! parameters have gradients, made every step before the update (`owned_gradients.rs`), also
//! on the NCCL path — which shows that every rank finished the last exchange
//! ([`Redundancy::drop_older`]): at most two steps' copies are held, one of them only from the
//! end of a step to the next step's update.
//! It is only on when the program recovers live.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use burn::optim::ModuleOptimizer;

use super::ShardingError;
use super::state;
use crate::comm::{self, SharedGroup};
use crate::error::Result;

/// Every rank's parameter ids in the model's visit order (index: rank).
type IdsByRank = Arc<Vec<Vec<u64>>>;

/// One rank's copies as of one finished step.
#[derive(Clone)]
pub(crate) struct Snapshot {
    /// The number of steps this optimizer had finished.
    pub(crate) at: u64,
    /// This rank's optimizer as it was (its state tensors shared with the live one until the
    /// next step replaces them).
    own: ModuleOptimizer,
    /// The predecessor's shard (burnpack bytes keyed by the predecessor's ids).
    kept: Vec<u8>,
    /// Every rank's ids when the copies were made.
    ids: IdsByRank,
    /// This rank and the world size.
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("at", &self.at)
            .field("kept_bytes", &self.kept.len())
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl Snapshot {
    /// This rank's shard, keyed by parameter position.
    pub(crate) fn own_by_position(&self) -> Result<Vec<u8>> {
        by_position(&shard_bytes(&self.own)?, &self.ids[self.rank])
    }

    /// The predecessor's shard, keyed by parameter position.
    pub(crate) fn kept_by_position(&self) -> Result<Vec<u8>> {
        let predecessor = (self.rank + self.world - 1) % self.world;
        by_position(&self.kept, &self.ids[predecessor])
    }
}

/// `optim`'s state as burnpack bytes, keyed by this process's parameter ids.
pub(super) fn shard_bytes(optim: &ModuleOptimizer) -> Result<burn::tensor::Bytes> {
    Ok(optim
        .into_bytes()
        .map_err(|e| ShardingError::State(format!("this rank's shard: {e}")))?)
}

/// `shard` (keyed by the ids `ids`, in visit order) re-keyed by position in that order.
fn by_position(shard: &[u8], ids: &[u64]) -> Result<Vec<u8>> {
    let position: HashMap<u64, u64> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| (id, i as u64))
        .collect();
    Ok(state::transform(&[shard], |id| position.get(&id).copied())?)
}

/// The copies of the last finished steps (two at most).
#[derive(Default)]
pub(crate) struct Redundancy {
    /// Steps this optimizer finished (its exchange included).
    completed: u64,
    /// At most two, oldest first.
    snapshots: VecDeque<Snapshot>,
    /// The buffer of the last dropped copy, received into by the next exchange.
    spare: Vec<u8>,
    /// Every rank's ids under the current plan.
    ids: IdsByRank,
}

impl std::fmt::Debug for Redundancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redundancy")
            .field("completed", &self.completed)
            .field("snapshots", &self.snapshots)
            .field("spare_bytes", &self.spare.capacity())
            .finish_non_exhaustive()
    }
}

impl Clone for Redundancy {
    /// The copies, without the spare buffer (a clone allocates its own at its next exchange).
    fn clone(&self) -> Self {
        Redundancy {
            completed: self.completed,
            snapshots: self.snapshots.clone(),
            spare: Vec::new(),
            ids: self.ids.clone(),
        }
    }
}

impl Redundancy {
    /// Learns every rank's parameter ids in visit order (`mine`: this rank's), for a new plan.
    /// Collective.
    pub(crate) fn learn_ids(&mut self, group: &SharedGroup, mine: &[u64]) -> Result<()> {
        let mut g = comm::lock(group);
        let world = g.world_size();
        let ids: Vec<i64> = mine.iter().map(|&id| id as i64).collect();
        let mut all = vec![0i64; ids.len() * world];
        if world == 1 {
            all.copy_from_slice(&ids);
        } else {
            g.all_gather(&ids, &mut all)?;
        }
        let n = ids.len();
        let by_rank = (0..world)
            .map(|r| {
                all[r * n..(r + 1) * n]
                    .iter()
                    .map(|&id| id as u64)
                    .collect()
            })
            .collect();
        self.ids = Arc::new(by_rank);
        Ok(())
    }

    /// Whether no copy was made yet (before the first step).
    pub(crate) fn is_empty(&self) -> bool {
        self.snapshots.is_empty()
    }

    /// Steps finished.
    pub(crate) fn completed(&self) -> u64 {
        self.completed
    }

    /// Sends this rank's shard (`optim`'s state) to the successor and receives the
    /// predecessor's; keeps `optim` itself and the received shard as the copies at `at` steps.
    /// Collective.
    pub(crate) fn exchange(
        &mut self,
        group: &SharedGroup,
        optim: &ModuleOptimizer,
        at: u64,
    ) -> Result<()> {
        // (Normally done already before the step's update, see `Sharding::step`; a no-op then.)
        self.drop_older();
        // Serialised before taking the group: the group stays free meanwhile.
        let own = shard_bytes(optim)?;
        let mut g = comm::lock(group);
        let (rank, world) = (g.rank(), g.world_size());
        // (In a world of one, a copy of its own: it is its own predecessor.)
        let mut kept = std::mem::take(&mut self.spare);
        ddp_comm::doctor::label_next(ddp_comm::doctor::Label::new("ZeRO-1 shard copies"));
        g.shift_bytes(&own, &mut kept)?;
        drop(g);
        drop(own);
        self.snapshots.push_back(Snapshot {
            at,
            own: optim.clone(),
            kept,
            ids: self.ids.clone(),
            rank,
            world,
        });
        self.completed = at;
        Ok(())
    }

    /// Drops every copy but the latest (its buffer kept for the next exchange). Called once a
    /// collective every rank takes part in finished on this rank after the latest exchange:
    /// every rank then finished that exchange, so no survivor can go back further than the
    /// latest copies.
    pub(crate) fn drop_older(&mut self) {
        while self.snapshots.len() > 1 {
            if let Some(old) = self.snapshots.pop_front() {
                self.spare = old.kept;
            }
        }
    }

    /// The copies as of `at` steps, if still held.
    pub(crate) fn at(&self, at: u64) -> Option<&Snapshot> {
        self.snapshots.iter().find(|s| s.at == at)
    }

    /// Forgets every copy; the next exchange starts again at `completed` steps.
    pub(crate) fn restart_at(&mut self, completed: u64) {
        self.snapshots.clear();
        self.completed = completed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::optim::SgdConfig;
    use std::sync::{Arc, Mutex};

    #[test]
    fn the_last_two_steps_are_kept_until_the_older_is_dropped() {
        let group: SharedGroup = Arc::new(Mutex::new(ddp_comm::ProcessGroup::single()));
        let optim: ModuleOptimizer = SgdConfig::new().init();
        let mut r = Redundancy::default();
        assert!(r.is_empty());
        for at in 0..3u64 {
            r.exchange(&group, &optim, at).unwrap();
        }
        assert_eq!(r.completed(), 2);
        assert!(r.at(0).is_none());
        let s = r.at(1).unwrap();
        // A world of one is its own predecessor.
        assert_eq!(s.kept, shard_bytes(&optim).unwrap().to_vec());
        assert!(r.at(2).is_some());
        r.drop_older();
        assert!(r.at(1).is_none() && r.at(2).is_some());
        assert!(
            !r.spare.is_empty(),
            "the dropped copy's buffer is kept for the next"
        );
        r.learn_ids(&group, &[7, 9]).unwrap();
        assert_eq!(*r.ids, vec![vec![7, 9]]);
        r.restart_at(7);
        assert!(r.is_empty() && r.completed() == 7);
    }
}
