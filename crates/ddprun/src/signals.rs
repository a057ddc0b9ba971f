//! Signals: names for messages, process-group kills, and forwarding SIGINT/SIGTERM.

use std::io;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

/// The conventional name of signal `sig` (`"SIGKILL"`), or `"SIG?"` when unknown.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => "SIG?",
    }
}

/// Sends `sig` to the process group led by `pid` (every rank leads its own group), falling
/// back to the process itself if the group is gone (the rank moved to another group).
pub(crate) fn kill_group(pid: u32, sig: i32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        if libc::kill(-pid, sig) != 0 {
            libc::kill(pid, sig);
        }
    }
}

/// The last termination signal received while forwarding is installed (0 = none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// How many termination signals were received while forwarding is installed.
static RECEIVED_COUNT: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only async-signal-safe work: two atomic stores.
    RECEIVED.store(sig, Ordering::SeqCst);
    RECEIVED_COUNT.fetch_add(1, Ordering::SeqCst);
}

/// The last termination signal caught while forwarding is installed, and how many arrived.
pub(crate) fn caught() -> Option<(i32, u32)> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        sig => Some((sig, RECEIVED_COUNT.load(Ordering::SeqCst))),
    }
}

/// How many SIGUSR1 arrived while forwarding is installed (each asks the hang doctor for a
/// dump; see `crate::doctor`).
static USR1_COUNT: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    // Only async-signal-safe work: one atomic add.
    USR1_COUNT.fetch_add(1, Ordering::SeqCst);
}

/// How many SIGUSR1 arrived so far (while forwarding was installed).
pub(crate) fn usr1_count() -> u32 {
    USR1_COUNT.load(Ordering::SeqCst)
}

/// While alive, SIGINT and SIGTERM are caught (not acted on by the default handler) and
/// recorded for the launcher's watch loop, and SIGUSR1 is counted (a dump, not an end);
/// dropping it restores the previous handlers.
pub(crate) struct SignalForwarding {
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

const FORWARDED: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

impl SignalForwarding {
    pub(crate) fn install() -> io::Result<Self> {
        RECEIVED.store(0, Ordering::SeqCst);
        RECEIVED_COUNT.store(0, Ordering::SeqCst);
        let mut previous = Vec::new();
        let handlers = FORWARDED
            .iter()
            .map(|&s| (s, on_signal as extern "C" fn(libc::c_int)))
            .chain([(libc::SIGUSR1, on_usr1 as extern "C" fn(libc::c_int))]);
        for (sig, handler) in handlers {
            // SAFETY: sigaction is called with fully initialised structs; the handler only
            // touches atomics.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = handler as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut old) != 0 {
                    let err = io::Error::last_os_error();
                    drop(SignalForwarding { previous });
                    return Err(err);
                }
                previous.push((sig, old));
            }
        }
        Ok(SignalForwarding { previous })
    }

    /// The last signal received and how many arrived so far.
    pub(crate) fn received(&self) -> Option<(i32, u32)> {
        caught()
    }
}

impl Drop for SignalForwarding {
    fn drop(&mut self) {
        for (sig, old) in self.previous.drain(..) {
            // SAFETY: restores a disposition previously returned by sigaction.
            unsafe {
                libc::sigaction(sig, &old, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_common_signals() {
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(11), "SIGSEGV");
        assert_eq!(signal_name(1000), "SIG?");
    }
}
