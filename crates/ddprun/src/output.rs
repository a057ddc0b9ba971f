//! Copies a rank's output to ours, one whole line at a time, each prefixed with its rank.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::mpsc;
use std::thread::JoinHandle;

/// Which of our streams a rank's stream goes to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sink {
    Stdout,
    Stderr,
}

/// Writes `line` (which may lack its final newline) as `prefix + line + '\n'` in one write,
/// so that lines of different ranks never interleave, and flushes.
fn emit(sink: Sink, prefix: &[u8], line: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(prefix.len() + line.len() + 1);
    buf.extend_from_slice(prefix);
    buf.extend_from_slice(line);
    if !line.ends_with(b"\n") {
        buf.push(b'\n');
    }
    match sink {
        Sink::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(&buf)?;
            out.flush()
        }
        Sink::Stderr => {
            let mut out = io::stderr().lock();
            out.write_all(&buf)?;
            out.flush()
        }
    }
}

/// Starts a thread that pumps `source` line by line to `sink` with `[rank k] ` in front.
/// The thread sends `()` on `done` when the source reaches end of file.
///
/// If our own stream is closed (e.g. `ddprun … | head`), the thread keeps draining the rank's
/// pipe so that the rank never blocks on a full pipe.
pub(crate) fn pump(
    rank: usize,
    source: impl Read + Send + 'static,
    sink: Sink,
    done: mpsc::Sender<()>,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("ddprun-out-{rank}"))
        .spawn(move || {
            let prefix = format!("[rank {rank}] ").into_bytes();
            let mut reader = BufReader::with_capacity(64 * 1024, source);
            let mut line = Vec::with_capacity(256);
            let mut sink_ok = true;
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) => break,
                    Ok(_) => {
                        if sink_ok && emit(sink, &prefix, &line).is_err() {
                            sink_ok = false;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::debug!(rank, "reading the rank's {sink:?}: {e}");
                        break;
                    }
                }
            }
            let _ = done.send(());
        })
}
