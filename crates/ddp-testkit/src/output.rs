//! Reading what launched processes print: a pipe drained on a thread of its own, and the
//! lines of one rank in `ddprun`'s prefixed output.

use std::io::Read;
use std::thread::JoinHandle;

/// Reads `r` to its end on a thread of its own (so a full pipe never blocks the child);
/// join the handle for the text.
pub fn collect(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// The lines of global rank `rank` in `ddprun`'s output (`[rank N] …`), without the prefix.
pub fn rank_lines(output: &str, rank: usize) -> Vec<&str> {
    let prefix = format!("[rank {rank}] ");
    output
        .lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .collect()
}
