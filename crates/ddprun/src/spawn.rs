//! Starting one rank process: its command line and variables (the rank's own token), its
//! process group and parent-death signal, and the threads that copy its output with a
//! `[rank k] ` prefix. The same for the first start of a rank and for a replacement of a lost
//! one (`--recover live`, which sets `DDP_RECOVER=live` on every rank), which also gets
//! `DDP_REJOIN=1`.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;

use ddp_comm::env::{LAUNCHER_STORE_VAR, RANK_KEYS_VAR, RECOVER_VAR, REJOIN_VAR, TOKEN_VAR};
use ddp_comm::gpu_hosts;

use super::config::{self, LaunchConfig};
use super::failure_notes::FailureNotes;
use super::output::{self, Sink};
use super::report::LaunchError;
use super::signals::kill_group;

/// Starts this node's ranks of one attempt or round.
pub(crate) struct RankSpawner<'a, A> {
    pub(crate) cfg: &'a LaunchConfig,
    pub(crate) notes: &'a FailureNotes,
    pub(crate) env: &'a BTreeMap<String, String>,
    pub(crate) program: &'a OsStr,
    pub(crate) args: &'a [A],
    /// The global rank of this node's local rank 0.
    pub(crate) first_rank: usize,
    /// Told once per output stream that it has ended; `None` once no rank will start.
    pub(crate) done: Option<mpsc::Sender<()>>,
    /// The output threads started so far.
    pub(crate) pumps: Vec<JoinHandle<()>>,
}

impl<A: AsRef<OsStr>> RankSpawner<'_, A> {
    /// Starts local rank `local`; `rejoin`: in place of a lost process of it, in a running
    /// group. On error nothing of it is left running.
    pub(crate) fn spawn(&mut self, local: usize, rejoin: bool) -> Result<Child, LaunchError> {
        let (cfg, rank) = (self.cfg, self.first_rank + local);
        let (note_var, note_file) = self.notes.for_rank(rank)?;
        let (progress_var, progress_file) = self.notes.progress_for_rank(rank)?;
        // SAFETY: getpid has no preconditions.
        let launcher_pid = unsafe { libc::getpid() };
        let mut cmd = Command::new(self.program);
        cmd.args(self.args)
            .env(note_var, note_file)
            .env(progress_var, progress_file)
            .envs(self.env)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .envs(
                self.env
                    .get(TOKEN_VAR)
                    .map(|round| {
                        [
                            (
                                TOKEN_VAR,
                                config::rank_token(round, rank, cfg.live_recovery),
                            ),
                            (RANK_KEYS_VAR, "1".to_string()),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            .envs(rejoin.then_some((REJOIN_VAR, "1")))
            .envs(cfg.live_recovery.then_some((RECOVER_VAR, "live")))
            // Under live recovery the launcher of global rank 0 serves the ranks' store, so
            // that rank 0 can be replaced too (see `launch_once`).
            .envs(cfg.live_recovery.then_some((LAUNCHER_STORE_VAR, "1")))
            .envs(
                cfg.emulate_gpu_hosts
                    .then(|| gpu_hosts::rank_vars(rank))
                    .into_iter()
                    .flatten(),
            )
            .envs(cfg.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .process_group(0);
        if cfg.prefix_output {
            cmd.stdout(Stdio::piped());
            if !(cfg.rank0_stderr_direct && rank == 0) {
                cmd.stderr(Stdio::piped());
            }
        }
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // system calls (prctl, getppid, kill).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                // The launcher may have died before prctl took effect.
                if libc::getppid() != launcher_pid {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            rank,
            program: self.program.to_string_lossy().into_owned(),
            source,
        })?;
        tracing::debug!(rank, pid = child.id(), rejoin, "rank started");
        if let (true, Some(done)) = (cfg.prefix_output, &self.done) {
            let streams = [
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn io::Read + Send>),
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn io::Read + Send>),
            ];
            for (stream, sink) in streams.into_iter().zip([Sink::Stdout, Sink::Stderr]) {
                let Some(stream) = stream else { continue };
                match output::pump(rank, stream, sink, done.clone()) {
                    Ok(h) => self.pumps.push(h),
                    Err(source) => {
                        // Without a reader the rank would block on a full pipe: give up.
                        kill_group(child.id(), libc::SIGKILL);
                        let _ = child.wait();
                        return Err(LaunchError::Io {
                            what: format!("starting the output thread of rank {rank}"),
                            source,
                        });
                    }
                }
            }
        }
        Ok(child)
    }
}
