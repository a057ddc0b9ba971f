//! Holding a rank's main thread still for a moment: `PTRACE_SEIZE` (nothing happens to the
//! thread yet), `PTRACE_INTERRUPT` (it stops at the next chance), its registers and memory
//! read, `PTRACE_DETACH` (it goes on, with a signal that arrived meanwhile delivered). A parent
//! may trace its children. Every wait here is non-blocking: a thread that does not stop in time
//! (uninterruptible sleep) stays seized until it does, and is let go then ([`Traced::try_stop`]
//! again, from the next poll); meanwhile the launcher must not reap it with a plain `waitpid`,
//! which would take the coming ptrace stop for the rank's end.

use super::unwind::Regs;

/// A rank's main thread, seized; let go when dropped once stopped.
pub(crate) struct Traced {
    pid: libc::pid_t,
    /// The registers, once stopped.
    regs: Option<Regs>,
    /// A signal to deliver when letting go (one that arrived while it was being stopped).
    deliver: libc::c_int,
}

/// How a [`Traced::try_stop`] went.
pub(crate) enum Stop {
    /// Stopped: its registers are read.
    Stopped,
    /// Not yet stopped.
    NotYet,
    /// It exited (left for the watch loop to reap).
    Exited,
}

fn os(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Traced {
    /// Seizes process `pid` (a child of ours) and asks its main thread to stop.
    pub fn seize(pid: u32) -> Result<Traced, String> {
        let pid = libc::pid_t::try_from(pid).map_err(|_| "no such process".to_string())?;
        let none = std::ptr::null_mut::<libc::c_void>();
        // SAFETY: ptrace on our own child; the address and data arguments are null pointers.
        if unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, none, none) } != 0 {
            return Err(os("cannot trace the rank (PTRACE_SEIZE)"));
        }
        let traced = Traced {
            pid,
            regs: None,
            deliver: 0,
        };
        // SAFETY: as above.
        if unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, pid, none, none) } != 0 {
            // Seized, not stopped: only its end releases it (it is not stopped by anyone).
            return Err(os("cannot stop the rank (PTRACE_INTERRUPT)"));
        }
        Ok(traced)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// The registers (once stopped).
    pub fn regs(&self) -> Option<Regs> {
        self.regs
    }

    /// Whether it stopped, without waiting: peeks first (`WNOWAIT`), so that an exit is left
    /// for the watch loop to reap; consumes a stop only (`WSTOPPED`), never an exit.
    pub fn try_stop(&mut self) -> Result<Stop, String> {
        if self.regs.is_some() {
            return Ok(Stop::Stopped);
        }
        // SAFETY: waitid fills `info`; no other memory is touched.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let peek = libc::WSTOPPED | libc::WEXITED | libc::WNOHANG | libc::WNOWAIT | libc::__WALL;
        if unsafe { libc::waitid(libc::P_PID, self.pid as libc::id_t, &mut info, peek) } != 0 {
            return Err(os("waiting for the rank to stop"));
        }
        // SAFETY: si_pid is set by waitid for a reported child (0 when none is).
        if unsafe { info.si_pid() } != self.pid {
            return Ok(Stop::NotYet);
        }
        if matches!(
            info.si_code,
            libc::CLD_EXITED | libc::CLD_KILLED | libc::CLD_DUMPED
        ) {
            return Ok(Stop::Exited);
        }
        // A stop: take it (WSTOPPED alone cannot take an exit).
        // SAFETY: as above.
        let mut taken: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let take = libc::WSTOPPED | libc::WNOHANG | libc::__WALL;
        if unsafe { libc::waitid(libc::P_PID, self.pid as libc::id_t, &mut taken, take) } != 0 {
            return Err(os("taking the rank's stop"));
        }
        // SAFETY: si_status is set for a CLD_TRAPPED/CLD_STOPPED child.
        let status = unsafe { taken.si_status() };
        // waitid reports a ptrace stop's whole code: the interrupt's is SIGTRAP with
        // PTRACE_EVENT_STOP above the low byte (an event stop: nothing to deliver); a plain
        // signal number is a signal that stopped the thread on its way in, delivered when the
        // thread is let go.
        self.deliver = match (status >> 8, status & 0x7f) {
            (0, sig) if sig != libc::SIGTRAP => sig,
            _ => 0,
        };
        // SAFETY: `regs` is a plain struct PTRACE_GETREGS fills; the thread is stopped.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        let r = unsafe {
            libc::ptrace(
                libc::PTRACE_GETREGS,
                self.pid,
                std::ptr::null_mut::<libc::c_void>(),
                &mut regs as *mut libc::user_regs_struct,
            )
        };
        if r != 0 {
            // Stopped but unreadable: let it go at once.
            self.regs = Some(Regs {
                ip: 0,
                sp: 0,
                bp: 0,
            });
            return Err(os("cannot read the rank's registers (PTRACE_GETREGS)"));
        }
        self.regs = Some(Regs {
            ip: regs.rip,
            sp: regs.rsp,
            bp: regs.rbp,
        });
        Ok(Stop::Stopped)
    }

    /// Eight bytes of the stopped process's memory at `addr`.
    pub fn read(&self, addr: u64) -> Option<u64> {
        let mut word = [0u8; 8];
        let local = libc::iovec {
            iov_base: word.as_mut_ptr().cast(),
            iov_len: 8,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: 8,
        };
        // SAFETY: writes at most 8 bytes into `word`; the remote address is only read by the
        // kernel, which checks it.
        let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        (n == 8).then(|| u64::from_le_bytes(word))
    }
}

impl Traced {
    fn detach(&self, sig: libc::c_int) -> bool {
        // SAFETY: ptrace on our stopped tracee; the data argument is a signal number or 0.
        unsafe {
            libc::ptrace(
                libc::PTRACE_DETACH,
                self.pid,
                std::ptr::null_mut::<libc::c_void>(),
                sig as libc::c_long as *mut libc::c_void,
            ) == 0
        }
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if self.regs.is_some() && !self.detach(self.deliver) {
            // Never leave a rank held: without the signal if it was refused.
            let first = std::io::Error::last_os_error();
            if !self.detach(0) {
                tracing::warn!(
                    "cannot let rank process {} go after taking its stack: {first}; {}",
                    self.pid,
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}
