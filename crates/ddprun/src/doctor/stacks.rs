//! The main thread's stack of a rank, taken by its launcher: held still over ptrace
//! ([`super::ptrace`]), unwound while held, named after it goes on ([`super::unwind`]). Only a
//! running or sleeping process is traced (a stopped one would not answer, a zombie has no
//! stack, one in uninterruptible sleep would not stop). On anything but x86-64 Linux, and where
//! ptrace is refused (some containers), the reason is given instead of a stack.

/// The stack taker of one attempt: the modules parsed so far, and the ranks seized but not yet
/// stopped (let go as soon as they stop).
#[derive(Default)]
pub(crate) struct Stacks {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    modules: super::unwind::Modules,
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    pending: Vec<super::ptrace::Traced>,
}

/// How long a thread may take to stop before its stack is given up (it is let go later).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
const STOP_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
impl Stacks {
    /// The stack of process `pid`'s main thread, innermost frame first (`function
    /// (file:line)`); `state` is its process state as last read.
    pub fn main_thread(&mut self, pid: u32, state: &str) -> Result<Vec<String>, String> {
        use super::ptrace::{Stop, Traced};
        if !matches!(state, "running" | "sleeping") {
            return Err(format!("its process is {state}"));
        }
        if self.holds(pid) {
            return Err("an earlier stop is still pending".into());
        }
        let maps = super::unwind::Maps::read(pid)?;
        let mut traced = Traced::seize(pid)?;
        let deadline = std::time::Instant::now() + STOP_WAIT;
        loop {
            match traced.try_stop() {
                Ok(Stop::Stopped) => break,
                Ok(Stop::Exited) => return Err("it exited".into()),
                Ok(Stop::NotYet) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Ok(Stop::NotYet) => {
                    self.pending.push(traced);
                    return Err(format!("it did not stop within {STOP_WAIT:?}"));
                }
                Err(e) => return Err(e),
            }
        }
        let Some(regs) = traced.regs() else {
            return Err("no registers".into());
        };
        let pcs = self.modules.unwind(&maps, regs, &|a| traced.read(a));
        // Let it go before the (slower) naming.
        drop(traced);
        Ok(self.modules.names(&maps, &pcs))
    }

    /// Whether `pid` is seized and not yet let go: the watch loop must not reap it with a
    /// plain wait, which would take its coming stop for its end.
    pub fn holds(&self, pid: u32) -> bool {
        self.pending.iter().any(|t| t.pid() == pid)
    }

    /// Lets go of every seized rank that stopped (or exited) since.
    pub fn release_stopped(&mut self) {
        self.pending
            .retain_mut(|t| matches!(t.try_stop(), Ok(super::ptrace::Stop::NotYet)));
    }
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
impl Stacks {
    /// No stacks here.
    pub fn main_thread(&mut self, _pid: u32, _state: &str) -> Result<Vec<String>, String> {
        Err("stacks are taken on x86-64 Linux only".into())
    }

    /// Nothing is ever held.
    pub fn holds(&self, _pid: u32) -> bool {
        false
    }

    /// Nothing to let go.
    pub fn release_stopped(&mut self) {}
}
