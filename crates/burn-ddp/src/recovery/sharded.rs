//! Live recovery with a sharded optimizer (ZeRO-1): each rank's shard comes back from the copies
//! the optimizer keeps when the program recovers live (`sharding::redundancy`: after every
//! step, each rank's own shard and its predecessor's, as of the last finished step, and of the
//! one before until the next step's update).
//!
//! The survivors may stand one step apart: the peer died after some of them had finished the
//! step's last collective (the copies' exchange) and before the others had. Unsharded, the run
//! rolls forward to the furthest survivor; sharded it cannot, since the lost rank's shard after
//! that step was never copied. So every rank goes back to the **lowest** number of finished
//! steps among the survivors, `t`:
//!
//! - the model at `t` is that of any survivor that finished `t` steps: the lowest such rank is
//!   the source, which hands it over as in the unsharded case;
//! - each survivor takes its own shard at `t` from its copies (a survivor one step ahead, its
//!   older copy);
//! - a lost rank's shard at `t` is its successor's copy (rank `d + 1`, modulo the world size),
//!   broadcast to its replacement.
//!
//! Where a shard exists nowhere (two neighbouring ranks lost together, or a death before the
//! copies of the first step were made), every rank returns the same error and notes it as the
//! lost rank's failure relayed: the launcher stops every rank and falls back to a restart of
//! the group from the checkpoint (within `--max-restarts`).

use crate::comm;
use crate::context::Ddp;
use crate::error::{DdpError, Result};
use crate::optimizer::DdpOptimizer;

/// The error of a shard that no rank holds, after the loss of rank `lost`. Noted as that
/// rank's failure relayed (`DDP_FAILURE_FILE`), so that the launcher stops every rank and
/// restarts the group from the checkpoint instead of replacing this rank live too.
fn lost_shard(reason: String, lost: usize) -> DdpError {
    let reason = format!(
        "{reason}: a sharded optimizer (ZeRO-1) cannot recover live; restart from the checkpoint"
    );
    ddp_comm::failure_note::note_peer_failure(lost, &reason);
    DdpError::InvalidSetting {
        setting: "Ddp::recover",
        reason,
    }
}

/// The step every rank goes back to and the rank whose model it takes: the lowest number of
/// finished steps among the survivors (`steps`, by rank; `-1` for a replacement), and the
/// lowest rank that finished that many.
pub(crate) fn target(steps: &[i64]) -> Option<(u64, usize)> {
    let t = steps.iter().copied().filter(|&s| s >= 0).min()?;
    let source = steps.iter().position(|&s| s == t)?;
    Some((t as u64, source))
}

/// This rank's shard (keyed by parameter position) as of `t` finished steps: a survivor's from
/// its own copies (`progress`: the steps it finished), a replacement's from its successor.
/// Every rank takes part in one all-gather (who holds what) and one broadcast per replacement.
///
/// # Errors
/// A shard that no rank holds (see the module docs), the same error on every rank; the
/// collectives'.
pub(crate) fn shard_at(
    ddp: &Ddp,
    optim: &DdpOptimizer,
    steps: &[i64],
    progress: u64,
    t: u64,
) -> Result<Vec<u8>> {
    let (rank, world) = (ddp.rank(), steps.len());
    let survivor = steps[rank] >= 0;
    let sharding = optim
        .sharding()
        .expect("shard_at is called for a sharded optimizer");
    // The copies as of `t`: `progress - t` (0 or 1) steps before this rank's latest.
    let copies = survivor
        .then(|| {
            let finished = sharding.finished_steps()?;
            sharding.copies_at(finished.checked_sub(progress.checked_sub(t)?)?)
        })
        .flatten();
    let mut held = vec![0u8; world];
    comm::lock(ddp.group()).all_gather(&[u8::from(copies.is_some())], &mut held)?;
    let replaced: Vec<usize> = (0..world).filter(|&d| steps[d] < 0).collect();
    let first_lost = replaced.first().copied().unwrap_or(0);
    if let Some(r) = (0..world).find(|&r| steps[r] >= 0 && held[r] == 0) {
        return Err(lost_shard(
            format!(
                "rank {r} holds no copy of its optimizer shard as of step {t} (a rank was lost \
                 before the first step's copies were made)"
            ),
            first_lost,
        ));
    }
    if let Some(&d) = replaced.iter().find(|&&d| steps[(d + 1) % world] < 0) {
        return Err(lost_shard(
            format!(
                "ranks {d} and {} were both lost, and with them every copy of rank {d}'s \
                 optimizer shard",
                (d + 1) % world
            ),
            d,
        ));
    }
    let mut own = copies.map(|c| c.own_by_position()).transpose()?;
    for &d in &replaced {
        let successor = (d + 1) % world;
        let mut bytes = match copies {
            Some(c) if rank == successor => c.kept_by_position()?,
            _ => Vec::new(),
        };
        comm::lock(ddp.group()).broadcast_bytes(&mut bytes, successor)?;
        if rank == d {
            own = Some(bytes);
        }
    }
    Ok(own.expect("a survivor's copies, or the successor's broadcast"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_goes_back_to_the_lowest_survivor() {
        assert_eq!(target(&[5, 5, -1]), Some((5, 0)));
        assert_eq!(target(&[6, 5, -1, 6]), Some((5, 1)));
        assert_eq!(target(&[-1, -1]), None);
    }
}
