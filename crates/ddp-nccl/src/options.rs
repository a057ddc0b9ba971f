//! [`NcclOptions`]: the deadlines, device and store namespace of an [`NcclGroup`].
//!
//! [`NcclGroup`]: super::NcclGroup

use std::time::Duration;

use ddp_comm::GroupOptions;
use ddp_comm::error::{CommError, Result};

/// The variable that overrides the default collective timeout, in seconds (shared with the TCP
/// process group).
pub const TIMEOUT_VAR: &str = "DDP_TIMEOUT_SECS";

/// Settings for [`NcclGroup`](super::NcclGroup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOptions {
    /// Deadline of every collective (default 300 s, like the TCP group).
    pub timeout: Duration,
    /// Deadline for the rendezvous and the communicator's creation, i.e. for every rank to
    /// arrive (default 120 s).
    pub init_timeout: Duration,
    /// CUDA device ordinal; `None` uses `LOCAL_RANK` (device 0 for [`NcclGroup::single`](super::NcclGroup::single)),
    /// or device 0 when the rank sees exactly one device (`CUDA_VISIBLE_DEVICES` set per rank).
    pub device: Option<usize>,
    /// Prefix of the rendezvous store keys (default `nccl`); groups created in the same order
    /// on every rank may share it.
    pub store_prefix: String,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(300),
            init_timeout: Duration::from_secs(120),
            device: None,
            store_prefix: "nccl".into(),
        }
    }
}

impl NcclOptions {
    /// The defaults, with the collective timeout read from `DDP_TIMEOUT_SECS` when set.
    ///
    /// # Errors
    /// [`CommError::InvalidArgument`] naming the variable when it is not a positive integer.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`NcclOptions::from_env`] with variables from `lookup` (for tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut opts = NcclOptions::default();
        if let Some(v) = lookup(TIMEOUT_VAR) {
            let secs: u64 = v.trim().parse().ok().filter(|s| *s > 0).ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "environment variable {TIMEOUT_VAR}={v:?} is not a positive number of seconds"
                ))
            })?;
            opts.timeout = Duration::from_secs(secs);
        }
        Ok(opts)
    }
}

impl From<&GroupOptions> for NcclOptions {
    /// The TCP group's deadlines: `timeout` for collectives, `connect_timeout` for creation.
    fn from(g: &GroupOptions) -> Self {
        NcclOptions {
            timeout: g.timeout,
            init_timeout: g.connect_timeout,
            ..NcclOptions::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_from_env_read_the_timeout_and_reject_bad_values() {
        let o = NcclOptions::from_lookup(|_| None).unwrap();
        assert_eq!(o, NcclOptions::default());
        let o = NcclOptions::from_lookup(|k| (k == TIMEOUT_VAR).then(|| "42".into())).unwrap();
        assert_eq!(o.timeout, Duration::from_secs(42));
        for bad in ["0", "-3", "ten", ""] {
            let err =
                NcclOptions::from_lookup(|k| (k == TIMEOUT_VAR).then(|| bad.into())).unwrap_err();
            assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
            assert!(err.to_string().contains(TIMEOUT_VAR), "{err}");
        }
    }

    #[test]
    fn options_follow_the_tcp_group_deadlines() {
        let g = GroupOptions {
            timeout: Duration::from_secs(7),
            connect_timeout: Duration::from_secs(9),
            ..GroupOptions::default()
        };
        let o = NcclOptions::from(&g);
        assert_eq!(o.timeout, Duration::from_secs(7));
        assert_eq!(o.init_timeout, Duration::from_secs(9));
        assert_eq!(o.store_prefix, "nccl");
    }
}
