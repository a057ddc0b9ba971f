//! A connection flood for abuse tests: a thread that opens connections to a port from one
//! source address, several hundred a second, and sends nothing, half a frame or garbage on
//! each, keeping the newest few hundred open, until it is dropped.

use std::collections::VecDeque;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections kept open at once (older ones are closed).
const HELD: usize = 300;
/// Pause between two connections (about 500 a second, less what the connects cost).
const PAUSE: Duration = Duration::from_millis(2);

/// A running flood; dropping it stops the thread and closes its connections.
#[derive(Debug)]
pub struct Flood {
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicU64>,
    started: Instant,
    thread: Option<JoinHandle<()>>,
}

impl Flood {
    /// Starts flooding `target` from `source` (an address of this machine: `127.0.0.2`
    /// stands for another host on loopback).
    pub fn start(source: IpAddr, target: SocketAddr) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, opened) = (Arc::clone(&stop), Arc::clone(&opened));
            std::thread::spawn(move || {
                let mut held = VecDeque::with_capacity(HELD + 1);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(mut s) = connect_from(source, target) {
                        // Silent, half a frame (a length, no body), or not our protocol.
                        let _ = match n % 3 {
                            0 => Ok(()),
                            1 => s.write_all(&200u32.to_le_bytes()),
                            _ => s.write_all(b"GET / HTTP/1.1\r\n\r\n"),
                        };
                        held.push_back(s);
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                    n += 1;
                    if held.len() > HELD {
                        held.pop_front();
                    }
                    std::thread::sleep(PAUSE);
                }
            })
        };
        Flood {
            stop,
            opened,
            started: Instant::now(),
            thread: Some(thread),
        }
    }

    /// Connections opened so far.
    pub fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// Connections opened per second so far.
    pub fn rate(&self) -> f64 {
        self.opened() as f64 / self.started.elapsed().as_secs_f64().max(1e-9)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A connection to `to` from the source address `from`.
pub fn connect_from(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(to),
        socket2::Type::STREAM,
        None,
    )?;
    s.bind(&SocketAddr::new(from, 0).into())?;
    s.connect_timeout(&to.into(), Duration::from_secs(2))?;
    Ok(s.into())
}
