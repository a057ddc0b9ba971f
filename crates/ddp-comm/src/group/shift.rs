//! [`ProcessGroup::shift_bytes`]: every rank sends a byte message of any length to its
//! successor (rank `r + 1`, modulo the world size) and receives its predecessor's: one
//! point-to-point transfer per rank instead of an all-gather of every rank's message.

use super::*;

impl ProcessGroup {
    /// After the header exchange: sends `input` to the successor and receives the
    /// predecessor's message into `out`, both at once (so neither direction waits for the
    /// other). `out` keeps its allocation when the length is unchanged.
    pub(super) fn shift_bytes_impl(
        &mut self,
        mut hdr: Header,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world_size);
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        hdr.inline = input.len() <= INLINE_BYTES;
        self.exchange(&hdr, if hdr.inline { input } else { &[] })?;
        let theirs = self.peer_header(prev)?;
        let len = theirs.len as usize;
        if out.len() != len {
            out.clear();
            out.resize(len, 0);
        }
        if theirs.inline {
            out.copy_from_slice(&self.mesh_mut().msgs[prev].payload);
        }
        let what = self.what(&hdr);
        let wait = self.waiting();
        let mut ops: Vec<Op<'_>> = Vec::with_capacity(2);
        if !hdr.inline {
            ops.push(Op::Send {
                peer: next,
                hdr: None,
                data: input,
                done: 0,
            });
        }
        if !theirs.inline {
            ops.push(Op::Recv {
                peer: prev,
                dst: out,
                done: 0,
            });
        }
        if ops.is_empty() {
            return Ok(());
        }
        drive(&mut self.mesh_mut().links, &mut ops, &wait, &what)
    }
}
