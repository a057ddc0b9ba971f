//! Child processes with a deadline: each runs in a process group of its own, writes its
//! output to a log file, and is killed with its whole group once the deadline passes. Every
//! child is reaped before [`run_until`] returns.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use thiserror::Error;

/// How long a group gets between `SIGTERM` and `SIGKILL` past its deadline.
pub const KILL_GRACE: Duration = Duration::from_secs(5);

/// How long a killed child may take to be reaped before it is left behind.
pub const REAP_LIMIT: Duration = Duration::from_secs(10);

/// How often a running child is polled.
const POLL: Duration = Duration::from_millis(25);

/// Why a child could not be run at all (a child that runs and fails is an [`Exit`]).
#[derive(Debug, Error)]
pub enum ProcessError {
    /// The log file could not be opened.
    #[error("cannot open the log {path}: {source}")]
    Log {
        /// The log file.
        path: String,
        /// The cause.
        source: io::Error,
    },
    /// The program could not be started (missing, not executable, …).
    #[error("cannot start {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        source: io::Error,
    },
    /// Waiting for the child failed.
    #[error("waiting for {program} failed: {source}")]
    Wait {
        /// The program.
        program: String,
        /// The cause.
        source: io::Error,
    },
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this status code (0 is success).
    Code(i32),
    /// A signal it did not ask for ended it (a crash, or someone else's kill).
    Signal(i32),
    /// It ran past its deadline and its process group was killed.
    TimedOut,
}

impl Exit {
    /// Whether the child exited with status 0.
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    fn from_status(status: ExitStatus) -> Exit {
        match (status.code(), status.signal()) {
            (Some(code), _) => Exit::Code(code),
            (None, Some(sig)) => Exit::Signal(sig),
            (None, None) => Exit::Code(-1),
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit {c}"),
            Exit::Signal(s) => write!(f, "killed by signal {s}"),
            Exit::TimedOut => write!(f, "past its deadline"),
        }
    }
}

/// A finished child: how it ended and how long it ran.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    /// How it ended.
    pub exit: Exit,
    /// From start to reaping (or to giving up on it).
    pub elapsed: Duration,
    /// Still not reaped [`REAP_LIMIT`] after `SIGKILL`: left behind so the run goes on.
    pub unreaped: bool,
}

/// Runs `cmd` with stdin closed and stdout and stderr appended to `log`, until it exits or
/// `deadline` passes; see [`run_until_with_grace`] ([`KILL_GRACE`] between the signals).
pub fn run_until(
    cmd: &mut Command,
    deadline: Instant,
    log: &Path,
) -> Result<Finished, ProcessError> {
    run_until_with_grace(cmd, deadline, log, KILL_GRACE)
}

/// Runs `cmd` in a new process group (its pgid is its pid) with stdin closed and stdout and
/// stderr appended to `log`. Past `deadline` the group gets `SIGTERM`, `grace` later
/// `SIGKILL`. The child is always reaped, and when it exits on its own, whatever it left
/// running in its group is killed too (rank processes of a test that failed, say).
pub fn run_until_with_grace(
    cmd: &mut Command,
    deadline: Instant,
    log: &Path,
    grace: Duration,
) -> Result<Finished, ProcessError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = open_log(log)?;
    let err = out.try_clone().map_err(|source| ProcessError::Log {
        path: log.display().to_string(),
        source,
    })?;
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(|source| ProcessError::Spawn {
            program: program.clone(),
            source,
        })?;
    let pgid = child.id() as libc::pid_t;
    let wait_err = |source| ProcessError::Wait {
        program: program.clone(),
        source,
    };
    loop {
        if let Some(status) = child.try_wait().map_err(wait_err)? {
            // The group outlives its leader while members remain; stop them.
            kill_group(pgid, libc::SIGKILL);
            return Ok(Finished {
                exit: Exit::from_status(status),
                elapsed: start.elapsed(),
                unreaped: false,
            });
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL.min(deadline.saturating_duration_since(Instant::now())));
    }
    // Past the deadline: the leader is still unreaped, so the pgid names our group.
    kill_group(pgid, libc::SIGTERM);
    let hard = Instant::now() + grace;
    while Instant::now() < hard {
        if child.try_wait().map_err(wait_err)?.is_some() {
            break;
        }
        std::thread::sleep(POLL);
    }
    kill_group(pgid, libc::SIGKILL);
    // Bounded: a process stuck in the driver (uninterruptible sleep) may not die for minutes,
    // and the run must go on to its next row and its report.
    let reap_by = Instant::now() + REAP_LIMIT;
    let mut unreaped = true;
    while Instant::now() < reap_by {
        if child.try_wait().map_err(wait_err)?.is_some() {
            unreaped = false;
            break;
        }
        std::thread::sleep(POLL);
    }
    if unreaped {
        use std::io::Write as _;
        if let Ok(mut f) = open_log(log) {
            let _ = writeln!(
                f,
                "gpu-check: {program} (pid {pgid}) not reaped {} s after SIGKILL (stuck in the \
                 kernel or the driver?); left behind",
                REAP_LIMIT.as_secs()
            );
        }
    }
    Ok(Finished {
        exit: Exit::TimedOut,
        elapsed: start.elapsed(),
        unreaped,
    })
}

/// Runs `cmd` to completion within `timeout` and returns its output (stdout and stderr);
/// `None` when it cannot start, exits non-zero or times out. For the short queries of the
/// run's preamble (`nvidia-smi`, `ldd`, `python3 -c …`); `scratch` is a path for the log.
pub fn output_within(cmd: &mut Command, timeout: Duration, scratch: &Path) -> Option<String> {
    let _ = std::fs::remove_file(scratch);
    let finished = run_until_with_grace(cmd, Instant::now() + timeout, scratch, Duration::ZERO);
    let text = std::fs::read_to_string(scratch).ok();
    let _ = std::fs::remove_file(scratch);
    match finished {
        Ok(f) if f.exit.success() => text,
        _ => None,
    }
}

fn open_log(log: &Path) -> Result<File, ProcessError> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|source| ProcessError::Log {
            path: log.display().to_string(),
            source,
        })
}

/// Sends `sig` to the process group `pgid` (one this module created); a group that is gone
/// already is fine.
fn kill_group(pgid: libc::pid_t, sig: libc::c_int) {
    if pgid > 1 {
        // SAFETY: kill(2) with a negative pid signals that process group and touches no memory.
        unsafe {
            libc::kill(-pgid, sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gone_or_zombie(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            // "pid (comm) STATE …"
            Ok(s) => s
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        }
    }

    #[test]
    fn a_child_past_its_deadline_is_killed_and_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sleep.log");
        let t = Instant::now();
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let f = run_until(&mut cmd, Instant::now() + Duration::from_millis(300), &log).unwrap();
        assert_eq!(f.exit, Exit::TimedOut);
        // SIGTERM ends sleep at once: well inside the grace period.
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        assert!(f.elapsed >= Duration::from_millis(300));
    }

    #[test]
    fn the_whole_group_dies_with_a_child_that_ignores_sigterm() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("group.log");
        let pidfile = dir.path().join("grandchild.pid");
        // The shell ignores TERM and leaves a grandchild sleeping in its group.
        let script = format!(
            "trap '' TERM; sleep 60 & echo $! > {}; echo started; wait",
            pidfile.display()
        );
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(&script);
        let t = Instant::now();
        let f = run_until_with_grace(
            &mut cmd,
            Instant::now() + Duration::from_millis(500),
            &log,
            Duration::from_millis(300),
        )
        .unwrap();
        assert_eq!(f.exit, Exit::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let grandchild: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(3);
        while !gone_or_zombie(grandchild) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            gone_or_zombie(grandchild),
            "grandchild {grandchild} survived"
        );
        assert!(std::fs::read_to_string(&log).unwrap().contains("started"));
    }

    #[test]
    fn exit_codes_and_output_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("ok.log");
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg("echo out; echo err >&2; exit 3");
        let f = run_until(&mut cmd, Instant::now() + Duration::from_secs(20), &log).unwrap();
        assert_eq!(f.exit, Exit::Code(3));
        assert!(!f.exit.success());
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains("out") && text.contains("err"), "{text}");
        assert!(matches!(
            run_until(
                &mut Command::new("/nonexistent/program"),
                Instant::now() + Duration::from_secs(1),
                &log
            ),
            Err(ProcessError::Spawn { .. })
        ));
    }

    #[test]
    fn output_within_captures_stdout_or_gives_none() {
        let dir = tempfile::tempdir().unwrap();
        let scratch = dir.path().join("q");
        let mut echo = Command::new("echo");
        echo.arg("hello");
        assert_eq!(
            output_within(&mut echo, Duration::from_secs(10), &scratch).as_deref(),
            Some("hello\n")
        );
        let mut slow = Command::new("sleep");
        slow.arg("30");
        let t = Instant::now();
        assert_eq!(
            output_within(&mut slow, Duration::from_millis(200), &scratch),
            None
        );
        assert!(t.elapsed() < Duration::from_secs(3));
        assert_eq!(
            output_within(
                &mut Command::new("false"),
                Duration::from_secs(10),
                &scratch
            ),
            None
        );
    }
}
