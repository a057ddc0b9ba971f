//! Whether a launcher started this job again.

use ddp_comm::env::{RESTART_COUNT_VARS, ROUND_VAR};

/// Whether a launcher started this job again: `ddprun --max-restarts` or torchrun's
/// (`DDP_RESTART_COUNT`, `TORCHELASTIC_RESTART_COUNT` above 0), or a later round of a
/// multi-node job after a scale-up (`DDP_ROUND` above 0). A program resumes from the checkpoint
/// an earlier attempt left when this is true, without being asked to — except a live
/// replacement (`DDP_REJOIN=1`, [`crate::Ddp::is_replacement`]), which takes its state from the
/// survivors instead.
pub fn restarted() -> bool {
    RESTART_COUNT_VARS.iter().chain([&ROUND_VAR]).any(|var| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    })
}
