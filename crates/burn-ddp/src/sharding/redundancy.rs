//! A second copy of every rank's optimizer shard, for live recovery with a sharded optimizer
//! (ZeRO-1 under `ddprun --recover live`): a lost rank's shard exists nowhere else, so after
//! every step each rank keeps its own shard and its predecessor's (rank `r` keeps rank
//! `r − 1`'s, modulo the world size), as of the last two finished steps. A lost rank's shard
//! then lives on in its successor, at the step every survivor can go back to (see
//! `recovery::sharded`); two neighbouring ranks lost together take a shard with them.
//!
//! The copies travel as one all-gather of every rank's shard after each step (its burnpack
//! bytes as the optimizer writes them, keyed by the rank's own parameter ids): each rank keeps
//! one part of it. Every rank's ids in the model's visit order are all-gathered once per plan,
//! so that a copy is re-keyed by parameter position (the same in every process) only when a
//! recovery needs it. That is the whole optimizer state received by every rank per step, on top of the
//! step's own traffic; a point-to-point shift would move 1/N of it (not built). It is only on
//! when the program recovers live.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::state;
use crate::comm::{self, SharedGroup};
use crate::error::Result;

/// Every rank's parameter ids in the model's visit order (index: rank).
type IdsByRank = Arc<Vec<Vec<u64>>>;

/// One rank's copies as of one finished step.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    /// The number of steps this optimizer had finished.
    pub(crate) at: u64,
    /// This rank's shard (keyed by its own parameter ids).
    own: Vec<u8>,
    /// The predecessor's shard (keyed by the predecessor's ids).
    kept: Vec<u8>,
    /// Every rank's ids when the copies were made.
    ids: IdsByRank,
    /// This rank and the world size.
    rank: usize,
    world: usize,
}

impl Snapshot {
    /// This rank's shard, keyed by parameter position.
    pub(crate) fn own_by_position(&self) -> Result<Vec<u8>> {
        by_position(&self.own, &self.ids[self.rank])
    }

    /// The predecessor's shard, keyed by parameter position.
    pub(crate) fn kept_by_position(&self) -> Result<Vec<u8>> {
        let predecessor = (self.rank + self.world - 1) % self.world;
        by_position(&self.kept, &self.ids[predecessor])
    }
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

/// The copies of the last two finished steps.
#[derive(Debug, Clone, Default)]
pub(crate) struct Redundancy {
    /// Steps this optimizer finished (its exchange included).
    completed: u64,
    /// At most two, oldest first.
    snapshots: VecDeque<Snapshot>,
    /// Every rank's ids under the current plan.
    ids: IdsByRank,
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

    /// Every rank's shard `own` all-gathered over `group`; keeps `own` and the predecessor's
    /// as the copies at `at` steps (the older of two goes). Collective.
    pub(crate) fn exchange(&mut self, group: &SharedGroup, own: Vec<u8>, at: u64) -> Result<()> {
        let mut g = comm::lock(group);
        let (rank, world) = (g.rank(), g.world_size());
        let kept = if world == 1 {
            own.clone()
        } else {
            let mut parts = g.all_gather_varlen::<u8>(&own)?;
            parts.swap_remove((rank + world - 1) % world)
        };
        drop(g);
        if self.snapshots.len() == 2 {
            self.snapshots.pop_front();
        }
        self.snapshots.push_back(Snapshot {
            at,
            own,
            kept,
            ids: self.ids.clone(),
            rank,
            world,
        });
        self.completed = at;
        Ok(())
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
    use std::sync::{Arc, Mutex};

    #[test]
    fn the_last_two_steps_are_kept() {
        let group: SharedGroup = Arc::new(Mutex::new(ddp_comm::ProcessGroup::single()));
        let mut r = Redundancy::default();
        assert!(r.is_empty());
        for at in 0..3u64 {
            r.exchange(&group, vec![at as u8], at).unwrap();
        }
        assert_eq!(r.completed(), 2);
        assert!(r.at(0).is_none());
        let s = r.at(1).unwrap();
        // A world of one is its own predecessor.
        assert_eq!(
            (s.own.as_slice(), s.kept.as_slice()),
            (&[1u8][..], &[1u8][..])
        );
        assert!(r.at(2).is_some());
        r.learn_ids(&group, &[7, 9]).unwrap();
        assert_eq!(*r.ids, vec![vec![7, 9]]);
        r.restart_at(7);
        assert!(r.is_empty() && r.completed() == 7);
    }
}
