//! Whether NCCL carries the collectives ([`NcclPolicy`], `DDP_NCCL`), in every build: without
//! the `cuda` feature, [`NcclPolicy::Required`] makes `init` fail with a clear error.

use crate::error::{DdpError, Result};

/// Whether gradient buckets go through NCCL on CUDA devices; see
/// [`crate::DdpBuilder::nccl`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum NcclPolicy {
    /// Use NCCL when every rank can (CUDA device, libcuda and libnccl present, the
    /// communicator created); otherwise fall back to the host path with a log line.
    #[default]
    Auto,
    /// Never create an NCCL communicator: gradients always take the host path.
    Disabled,
    /// Fail [`crate::DdpBuilder::init`] on every rank when NCCL can't be used on some rank.
    /// In a world of one, create a one-rank communicator and run every gradient sync and
    /// SyncBatchNorm exchange through it, so that a single GPU exercises the path N GPUs
    /// take (NCCL itself has nothing to exchange then).
    Required,
}

impl std::str::FromStr for NcclPolicy {
    type Err = DdpError;

    /// `auto`, `off` (or `disabled`), `required`; the values of `DDP_NCCL`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(NcclPolicy::Auto),
            "off" | "disabled" => Ok(NcclPolicy::Disabled),
            "required" => Ok(NcclPolicy::Required),
            other => Err(DdpError::InvalidSetting {
                setting: "NcclPolicy",
                reason: format!("{other:?}: expected auto, off or required"),
            }),
        }
    }
}

/// The variable that sets [`NcclPolicy`] for programs that don't: `auto`, `off`, `required`.
pub const NCCL_POLICY_VAR: &str = "DDP_NCCL";

impl NcclPolicy {
    /// The policy in [`NCCL_POLICY_VAR`], or `None` when it is unset.
    ///
    /// # Errors
    /// The variable holds something else than `auto`, `off` or `required`.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(NCCL_POLICY_VAR) {
            Ok(v) => v.parse().map(Some).map_err(|e| match e {
                DdpError::InvalidSetting { reason, .. } => DdpError::InvalidSetting {
                    setting: NCCL_POLICY_VAR,
                    reason,
                },
                other => other,
            }),
            Err(_) => Ok(None),
        }
    }
}

/// The NCCL policy a builder holds: [`crate::DdpBuilder::nccl`]'s, else `DDP_NCCL`'s.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NcclSetting {
    policy: NcclPolicy,
    /// Whether the builder set it (else `DDP_NCCL` decides).
    chosen: bool,
}

impl NcclSetting {
    /// The policy the program chose.
    pub(crate) fn chosen(policy: NcclPolicy) -> Self {
        NcclSetting {
            policy,
            chosen: true,
        }
    }

    /// The policy in force: the program's, else `DDP_NCCL`'s, else the default.
    pub(crate) fn policy(self) -> Result<NcclPolicy> {
        if self.chosen {
            Ok(self.policy)
        } else {
            Ok(NcclPolicy::from_env()?.unwrap_or(self.policy))
        }
    }
}
