//! The presence exchange: which slots have a gradient on some rank, whether every rank has
//! the same trainable layout, and whether every rank can take the device (NCCL) path.

use ddp_comm::ReduceOp;

use super::GradientSynchronizer;
use super::slots::{Slot, layout_fingerprint};
use crate::comm;
use crate::error::{DdpError, Result};

impl GradientSynchronizer {
    /// This rank's vote for the device (NCCL) path: `None` without a communicator (the
    /// exchange then carries no vote, as always in builds without `cuda`), else whether every
    /// gradient lives on the communicator's CUDA device as f32, f16 or bf16 (values f32 holds
    /// exactly: the device paths reduce and gather in f32).
    pub(crate) fn device_vote(&self, slots: &[Slot]) -> Option<bool> {
        let device_comm = self.device_comm.as_ref()?;
        Some(slots.iter().all(|s| {
            device_comm.holds(&s.device)
                && matches!(
                    s.dtype,
                    burn::tensor::DType::F32 | burn::tensor::DType::F16 | burn::tensor::DType::BF16
                )
        }))
    }

    /// All-reduces (Max) the presence bitmap plus a layout fingerprint, the wire format (and,
    /// with a `device_vote`, the pair `[yes, no]`); returns which slots have a gradient on at
    /// least one rank, and whether every rank voted for the device path.
    ///
    /// # Errors
    /// [`DdpError::GradientLayoutMismatch`] when the layouts differ; a
    /// [`ddp_comm::CommError::Mismatch`] when the ranks' wire formats (compression) differ —
    /// on every rank, before any bucket travels.
    pub(crate) fn exchange_presence(
        &self,
        slots: &[Slot],
        device_vote: Option<bool>,
    ) -> Result<Presence> {
        let _span = ddp_comm::trace::span("presence_exchange", "ddp").arg("slots", slots.len());
        let n = slots.len();
        let fp = layout_fingerprint(slots).to_le_bytes();
        let mut buf = Vec::with_capacity(n + 21);
        buf.extend(slots.iter().map(|s| u8::from(s.grad.is_some())));
        buf.extend_from_slice(&fp);
        buf.extend(fp.iter().map(|b| !b));
        // The wire format, checked the same way: on the device path NCCL would otherwise be
        // called with bf16 on some ranks and f32 on others, and hang.
        let wire = wire_code(self.compression);
        buf.extend([wire, !wire]);
        // Whether any rank reaches a peer over TCP (another host): only there do 16-bit
        // gradients pay.
        let tcp = comm::lock(&self.group)
            .transports()
            .contains(&ddp_comm::group::Transport::Tcp);
        buf.push(u8::from(tcp));
        if let Some(yes) = device_vote {
            buf.push(u8::from(yes));
            buf.push(u8::from(!yes));
        }
        let mut group = comm::lock(&self.group);
        ddp_comm::doctor::label_next(ddp_comm::doctor::Label::new("gradient presence"));
        group.all_reduce(&mut buf, ReduceOp::Max)?;
        drop(group);
        // Equal on all ranks iff max(b) + max(!b) == 255 for every fingerprint byte.
        let (bits, tail) = buf.split_at(n);
        let agree = (0..8).all(|i| u16::from(tail[i]) + u16::from(tail[8 + i]) == 255);
        if !agree {
            return Err(DdpError::GradientLayoutMismatch {
                parameters: n,
                values: slots.iter().map(|s| s.numel).sum(),
            });
        }
        if u16::from(tail[16]) + u16::from(tail[17]) != 255 {
            return Err(ddp_comm::CommError::Mismatch(format!(
                "the gradient wire format differs between ranks: this rank sends {} \
                 (DDP_COMPRESSION / DdpBuilder::compression must be the same on every rank)",
                self.compression
            ))
            .into());
        }
        let any_tcp = tail[18] != 0;
        let on_device = device_vote.is_some() && tail[19] == 1 && tail[20] == 0;
        log_path_once(device_vote, on_device);
        Ok(Presence {
            present: bits.iter().map(|&b| b != 0).collect(),
            on_device,
            any_tcp,
        })
    }
}

/// What every rank learns from the presence exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Presence {
    /// Which slots have a gradient on at least one rank.
    pub(crate) present: Vec<bool>,
    /// Whether every rank voted for the device (NCCL) path.
    pub(crate) on_device: bool,
    /// Whether some rank reaches a peer over TCP (else every link stays on one host: shared
    /// memory or a Unix socket).
    pub(crate) any_tcp: bool,
}

/// One byte naming a wire format in the presence exchange.
fn wire_code(c: ddp_comm::Compression) -> u8 {
    match c {
        ddp_comm::Compression::None => 1,
        ddp_comm::Compression::Bf16 => 2,
        ddp_comm::Compression::Fp16 => 3,
        _ => 4,
    }
}

/// Logs, once per process, which path gradient buckets take (builds with `cuda` only: other
/// builds have a single path).
pub(crate) fn log_path_once(device_vote: Option<bool>, on_device: bool) {
    if crate::cuda::ENABLED {
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            if on_device {
                tracing::info!("gradient buckets: NCCL all-reduce on CUDA device memory");
            } else {
                let why = match device_vote {
                    None => "no NCCL communicator",
                    Some(false) => "this rank's gradients are not on the NCCL device",
                    Some(true) => "another rank's gradients are not on its NCCL device",
                };
                tracing::info!("gradient buckets: host-staged over the process group ({why})");
            }
        });
    }
}
