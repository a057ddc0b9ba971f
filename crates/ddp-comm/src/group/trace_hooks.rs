//! The spans of the collectives (see [`crate::trace`]): one guard per call, built here so that
//! each collective carries a single line for it.

use super::header::{op_code, op_name};
use super::{ProcessGroup, ReduceOp, Transport};
use crate::trace::{self, Span};

impl ProcessGroup {
    /// A span for collective `op` with args `op`, `dtype`, `bytes` (this rank's payload; left
    /// out when `None`), `root` (when `Some`), `transport`, `world` and `seq` (the call number
    /// it gets). Inert, and computes nothing, when tracing is off.
    #[inline]
    pub(super) fn trace_op(
        &self,
        op: &'static str,
        dtype: &'static str,
        bytes: Option<usize>,
        root: Option<usize>,
    ) -> Span {
        if !trace::enabled() {
            return Span::inert();
        }
        let mut span = trace::span(op, "collective")
            .arg("op", op)
            .arg("dtype", dtype)
            .arg("transport", self.transport_name())
            .arg("world", self.world_size)
            .arg("seq", self.seq + 1);
        if let Some(b) = bytes {
            span.set_arg("bytes", b);
        }
        if let Some(r) = root {
            span.set_arg("root", r);
        }
        span
    }

    /// [`Self::trace_op`] for `all_reduce`, with the reduction as arg `reduce`.
    #[inline]
    pub(super) fn trace_all_reduce(&self, dtype: &'static str, bytes: usize, op: ReduceOp) -> Span {
        if !trace::enabled() {
            return Span::inert();
        }
        self.trace_op("all_reduce", dtype, Some(bytes), None)
            .arg("reduce", op_name(op_code(op)))
    }

    /// [`Self::trace_op`] for `broadcast_bytes` (the length is only known on the root).
    #[inline]
    pub(super) fn trace_broadcast_bytes(&self, len: usize, root: usize) -> Span {
        if !trace::enabled() {
            return Span::inert();
        }
        let bytes = (self.rank == root).then_some(len);
        self.trace_op("broadcast_bytes", "u8", bytes, Some(root))
    }

    /// `shm`, `unix`, `tcp`, `mixed` (peers of more than one kind) or `self` (a group of one).
    fn transport_name(&self) -> &'static str {
        let mut kinds = self.transports();
        kinds.retain(|t| *t != Transport::SelfRank);
        kinds.dedup();
        match kinds.as_slice() {
            [] => "self",
            [Transport::SharedMemory] => "shm",
            [Transport::LocalSocket] => "unix",
            [Transport::Tcp] => "tcp",
            _ => "mixed",
        }
    }
}
