//! The 32-byte header every rank sends every other rank at the start of a collective (encoded
//! with the crate's codec, [`crate::wire`]), and the codes it carries.

use super::ReduceOp;
#[cfg(doc)]
use crate::error::CommError;
use crate::wire::{Reader, Writer};

/// Header bytes in front of every collective's first message.
pub(crate) const HDR: usize = 32;
const MAGIC: u32 = 0x4744_4450; // "PDDG"
/// Largest inline payload a header may announce (guards against a garbled stream).
const MAX_INLINE: u64 = 64 << 20;

/// Which collective a header announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    AllGatherVarlen = 4,
    BroadcastBytes = 5,
    Barrier = 6,
    /// An f32 all-reduce whose data travels as 16-bit values (the header's element type is
    /// the wire format, bf16 or fp16): distinct from [`Kind::AllReduce`], so a rank calling
    /// the uncompressed op against a compressed peer fails with a mismatch.
    AllReduceCompressed = 7,
    /// A reduce-scatter over shards of any sizes (the header's `root` carries a fingerprint
    /// of the shard sizes, so ranks that disagree on them fail with a mismatch).
    ReduceScatter = 8,
    /// [`Kind::ReduceScatter`] of f32 values travelling as 16-bit values.
    ReduceScatterCompressed = 9,
    /// An all-gather of shards of any sizes into one buffer (`len` is the sender's own shard,
    /// `root` the fingerprint of the shard sizes).
    AllGatherShards = 10,
    /// Every rank's bytes to its successor (`len` is the sender's own count).
    ShiftBytes = 11,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::AllGather,
            4 => Kind::AllGatherVarlen,
            5 => Kind::BroadcastBytes,
            6 => Kind::Barrier,
            7 => Kind::AllReduceCompressed,
            8 => Kind::ReduceScatter,
            9 => Kind::ReduceScatterCompressed,
            10 => Kind::AllGatherShards,
            11 => Kind::ShiftBytes,
            _ => return None,
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::AllGather => "all_gather",
            Kind::AllGatherVarlen => "all_gather_varlen",
            Kind::BroadcastBytes => "broadcast_bytes",
            Kind::Barrier => "barrier",
            Kind::AllReduceCompressed => "all_reduce_compressed",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::ReduceScatterCompressed => "reduce_scatter_compressed",
            Kind::AllGatherShards => "all_gather_into",
            Kind::ShiftBytes => "shift_bytes",
        }
    }
}

/// The header every rank sends every other rank at the start of a collective; comparing them
/// turns mismatched calls into [`CommError::Mismatch`] on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    /// [`ReduceOp`] code (all-reduce and reduce-scatter only).
    pub op: u8,
    /// The sender's data follows the header.
    pub inline: bool,
    /// Element size in bytes.
    pub elem: u8,
    /// Call number in this group (1, 2, …).
    pub seq: u64,
    /// Element count (the sender's own count for variable-length calls).
    pub len: u64,
    /// The root rank (broadcast), or the fingerprint of the shard sizes (the sharded calls).
    pub root: u32,
    /// Element type tag.
    pub dtype: u32,
    /// Name of the element type (not sent; for messages).
    pub dtype_name: &'static str,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HDR] {
        Writer::with_capacity(HDR)
            .u32(MAGIC)
            .u8(self.kind as u8)
            .u8(self.op)
            .u8(self.inline as u8)
            .u8(self.elem)
            .u64(self.seq)
            .u64(self.len)
            .u32(self.root)
            .u32(self.dtype)
            .finish()
            .try_into()
            .expect("a header is HDR bytes")
    }

    pub(crate) fn decode(b: &[u8; HDR]) -> Option<Header> {
        let mut r = Reader::new(b);
        if r.u32().ok()? != MAGIC {
            return None;
        }
        let kind = Kind::from_u8(r.u8().ok()?)?;
        let op = r.u8().ok()?;
        let inline = match r.u8().ok()? {
            0 => false,
            1 => true,
            _ => return None,
        };
        Some(Header {
            kind,
            op,
            inline,
            elem: r.u8().ok()?,
            seq: r.u64().ok()?,
            len: r.u64().ok()?,
            root: r.u32().ok()?,
            dtype: r.u32().ok()?,
            dtype_name: "",
        })
    }

    /// Bytes of inline payload after this header.
    pub(crate) fn payload_len(&self) -> Option<usize> {
        if !self.inline {
            return Some(0);
        }
        let n = self.len.checked_mul(self.elem as u64)?;
        (n <= MAX_INLINE).then_some(n as usize)
    }
}

pub(crate) fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Mean => 2,
        ReduceOp::Max => 3,
        ReduceOp::Min => 4,
    }
}

/// The bit of a reduce-scatter header's `op` that says the node-aware path runs.
pub(crate) const NODE_AWARE_OP: u8 = 0x80;

pub(crate) fn op_name(code: u8) -> &'static str {
    match code & !NODE_AWARE_OP {
        1 => "sum",
        2 => "mean",
        3 => "max",
        4 => "min",
        _ => "-",
    }
}
