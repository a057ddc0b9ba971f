//! Re-forming a group after a lost rank, without a process restart (as c10d's process-group
//! abort and re-init): the survivors break their links, move the group to its next generation
//! with one compare-and-set in the store, and form a new mesh together with the process that
//! replaces the lost one ([`ProcessGroup::rejoin`]). Every rank agrees on the generation it
//! joins (the store's compare-and-set), every slot of a generation is claimed once, and the
//! collectives start numbering again from the first.
//!
//! Where rank 0 serves the store, a lost rank 0 cannot be replaced this way: its survivors'
//! re-forming fails (the store is gone), as the restart path expects. Where the launcher serves
//! it ([`crate::env::LAUNCHER_STORE_VAR`], `ddprun --recover live`), rank 0 is replaced as any
//! rank.

use std::time::Instant;

use super::rendezvous::{self, Claim, next_generation};
use super::{GroupOptions, ProcessGroup};
use crate::env::LaunchEnv;
use crate::error::{CommError, Result};
use crate::store::{PrefixStore, keys};

impl ProcessGroup {
    /// Joins a running group in place of a lost process of rank `env.rank`: claims the rank's
    /// slot in the first generation where it is free, waiting (within
    /// [`GroupOptions::connect_timeout`]) for the survivors to re-form
    /// ([`ProcessGroup::reform`]) while the lost process's slot is the current one's.
    ///
    /// Rank 0 cannot rejoin where it served the store, which was lost with it; it can where
    /// the launcher serves the store ([`crate::env::LAUNCHER_STORE_VAR`]).
    pub fn rejoin(env: &LaunchEnv, opts: GroupOptions) -> Result<Self> {
        if env.world_size == 1 {
            return Self::init(env, opts);
        }
        if env.rank == 0 && !crate::env::store_served_by_launcher() {
            return Err(CommError::InvalidArgument(
                "rank 0 serves the group's store: a lost rank 0 cannot be replaced while the \
                 job runs (restart the job from its checkpoint)"
                    .into(),
            ));
        }
        Self::start(env, opts, Claim::Replacing).inspect_err(|e| {
            // A replacement that found no group to join fails on the ranks that never came,
            // not on an error of its own: the launcher does not replace it again for that.
            if let Some(peer) = e.peer() {
                crate::failure_note::note_peer_failure(peer, &e.to_string());
            }
        })
    }

    /// Re-forms the group after a collective failed because a rank was lost: breaks every
    /// link (so that peers still inside a collective with this rank fail now, and re-form
    /// too), starts the group's next generation (or joins the one another survivor started)
    /// and forms a new mesh with every rank of it, the lost rank's replacement included
    /// ([`ProcessGroup::rejoin`]), within [`GroupOptions::connect_timeout`]. The group is
    /// usable again (no longer poisoned); the next collective is the first of the new
    /// generation on every rank. What each rank holds (a model, a step) is the caller's to
    /// make consistent, e.g. by a broadcast from a survivor.
    ///
    /// A generation that cannot form (a rank of it died or left while it formed) is given up
    /// for the next one within the same deadline (see the rendezvous module).
    ///
    /// On error the group stays poisoned, and `reform` may be called again: it tries the
    /// next generation. A group of one has nothing to re-form.
    pub fn reform(&mut self) -> Result<()> {
        if self.world_size == 1 {
            self.poisoned = None;
            self.seq = 0;
            return Ok(());
        }
        let Some(home) = self.home.as_mut() else {
            return Err(CommError::InvalidArgument(
                "this group has no store to re-form through".into(),
            ));
        };
        if let Some(mesh) = self.mesh.take() {
            for l in mesh.links.iter().flatten() {
                l.abort(None);
            }
        }
        let started = Instant::now();
        let rank = self.rank;
        let world = self.world_size;
        let joined = next_generation(
            &mut PrefixStore::new(&mut home.store, keys::PROCESS_GROUP),
            home.generation,
        )
        .and_then(|next| {
            tracing::warn!("rank {rank}: re-forming the group as its generation {next}");
            rendezvous::join(rank, world, Claim::In(next), home, started)
        });
        match joined {
            Ok(mesh) => {
                self.mesh = Some(mesh);
                self.seq = 0;
                self.poisoned = None;
                // The peer failure this rank noted for its launcher is recovered.
                crate::failure_note::withdraw_peer_failure()
                    .map_err(|e| CommError::io("re-forming the group", None, e))
            }
            Err(e) => {
                self.poisoned = Some(format!("re-forming the group failed: {e}"));
                // A rank that never came (or a store that went) fails this rank: the
                // launcher names that rank, not this one.
                if let Some(peer) = e.peer() {
                    crate::failure_note::note_peer_failure(peer, &e.to_string());
                }
                Err(e)
            }
        }
    }

    /// Which forming of the group this is: 0 for the first, one more for each
    /// [`ProcessGroup::reform`] (or the generation a [`ProcessGroup::rejoin`] joined).
    pub fn generation(&self) -> u64 {
        self.home.as_ref().map_or(0, |h| h.generation)
    }
}
