//! [`Launchers`]: `ddprun` processes a test started, killed and reaped however the test ends;
//! [`Launched`]: one such process with its output read and a deadline on its wait.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::output::collect;

/// Launchers of a test: SIGKILLed and reaped when dropped, however the test ends (their ranks
/// die with them through PDEATHSIG).
pub struct Launchers(pub Vec<Child>);

impl Drop for Launchers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One launcher (or any program) started with its output piped and read on threads; SIGKILLed
/// and reaped when dropped, and when it runs past the deadline it is waited for.
pub struct Launched {
    child: Option<Child>,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
    started: Instant,
}

/// What a [`Launched`] program left when it ended.
#[derive(Debug)]
pub struct Finished {
    /// Its exit status.
    pub status: ExitStatus,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
    /// How long after the start it ended.
    pub after: Duration,
}

impl Launched {
    /// Starts `cmd` with stdin closed and stdout and stderr piped.
    ///
    /// # Errors
    /// The program could not be started.
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Launched> {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        Ok(Launched::adopt(child))
    }

    /// Takes over `child`, already started with stdout and stderr piped.
    ///
    /// # Panics
    /// If either stream is not piped.
    pub fn adopt(mut child: Child) -> Launched {
        let stdout = collect(child.stdout.take().expect("stdout piped"));
        let stderr = collect(child.stderr.take().expect("stderr piped"));
        Launched {
            child: Some(child),
            stdout: Some(stdout),
            stderr: Some(stderr),
            started: Instant::now(),
        }
    }

    /// When it was started (or adopted).
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The program's process id.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Whether it is still running (its exit, once seen, is kept for [`Self::wait_until`]).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits until it ends, at most until `deadline`.
    ///
    /// # Panics
    /// Past the deadline: the program is SIGKILLed and reaped first, and the panic message
    /// carries what it wrote to stderr.
    pub fn wait_until(mut self, deadline: Instant) -> Finished {
        let mut child = self.child.take().expect("not yet waited for");
        let status = loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let err = self.stderr.take().map(join).unwrap_or_default();
                panic!(
                    "the program ran past its deadline ({:?} after its start); its stderr:\n{err}",
                    self.started.elapsed()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let after = self.started.elapsed();
        Finished {
            status,
            stdout: self.stdout.take().map(join).unwrap_or_default(),
            stderr: self.stderr.take().map(join).unwrap_or_default(),
            after,
        }
    }

    /// [`Launched::wait_until`] `limit` after now.
    ///
    /// # Panics
    /// As [`Launched::wait_until`].
    pub fn wait_for(self, limit: Duration) -> Finished {
        self.wait_until(Instant::now() + limit)
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A reader thread's text (empty if the thread panicked).
fn join(h: JoinHandle<String>) -> String {
    h.join().unwrap_or_default()
}
