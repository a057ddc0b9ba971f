//! [`RankJob`]: N rank processes with the torchrun launch environment, a deadline, and
//! every process reaped.

use std::ffi::OsString;
use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The variable naming a folder that holds the rank programs, overriding their build paths
/// (see [`RankJob::new`]).
pub const BIN_DIR_VAR: &str = "DDP_TESTS_BIN_DIR";

/// A free TCP port on 127.0.0.1 for a process the test starts to bind later (checked here,
/// not held).
///
/// - **Below the kernel's ephemeral range** (`ip_local_port_range`, 32768–60999 by default),
///   where that leaves room. The kernel hands out that range for every bind to port 0 and
///   every outgoing connection: a rank's listeners and stores, a flood test's hundreds of
///   connections a second. A port from the range can be taken by one of those between its
///   release here and the bind it is meant for. That happened once in CI: "Address already in
///   use" on a launchers' rendezvous port.
/// - **A slice of its own per process**, 1/32 of the room chosen by process id, taken in turn
///   call by call. A test binary's ports then differ from those of a test process still
///   shutting down beside it.
/// - **Nothing on the port at all**: the check binds it without `SO_REUSEADDR`, so a port
///   still holding a connection (even one closing, or in TIME_WAIT) is passed over.
pub fn free_port() -> u16 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    const LOWEST: u64 = 10_000;
    const SLICES: u64 = 32;
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(32768);
    if ephemeral_start > LOWEST + 64 * SLICES {
        let width = (ephemeral_start - LOWEST) / SLICES;
        let slice = LOWEST + u64::from(std::process::id()) % SLICES * width;
        for _ in 0..width {
            let port = (slice + CALLS.fetch_add(1, Ordering::Relaxed) % width) as u16;
            if nothing_on(port) {
                return port;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

/// Whether 127.0.0.1:`port` can be bound without `SO_REUSEADDR`: no socket of any state is on
/// it.
fn nothing_on(port: u16) -> bool {
    use socket2::{Domain, Socket, Type};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    Socket::new(Domain::IPV4, Type::STREAM, None)
        .and_then(|s| s.bind(&addr.into()))
        .is_ok()
}

/// A job token unique to this process and call.
pub fn job_token() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "test-{}-{}-{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A description of N rank processes to start (a builder).
#[derive(Debug, Clone)]
pub struct RankJob {
    program: PathBuf,
    args: Vec<OsString>,
    world_size: usize,
    env: Vec<(String, String)>,
    rank_env: Vec<(usize, String, String)>,
    ranks: Option<Vec<usize>>,
    deadline: Duration,
    port: Option<u16>,
}

/// `program`, or, when [`BIN_DIR_VAR`] is set, the program of the same file name in that
/// folder: test binaries copied to another machine (the GPU check) find the programs copied
/// beside them, whatever path `env!("CARGO_BIN_EXE_…")` compiled in.
pub fn bundled(program: impl Into<PathBuf>) -> PathBuf {
    let program = program.into();
    match (std::env::var_os(BIN_DIR_VAR), program.file_name()) {
        (Some(dir), Some(name)) => PathBuf::from(dir).join(name),
        _ => program,
    }
}

impl RankJob {
    /// `world_size` ranks of `program` (all started unless [`RankJob::only_ranks`] says
    /// otherwise); the default deadline is 120 s.
    ///
    /// When [`BIN_DIR_VAR`] is set, the program with the same file name in that folder runs
    /// instead: test binaries copied to another machine (the GPU check) find the rank programs
    /// copied beside them, whatever path `env!("CARGO_BIN_EXE_…")` compiled in.
    pub fn new(program: impl Into<PathBuf>, world_size: usize) -> Self {
        let program = bundled(program);
        RankJob {
            program,
            args: Vec::new(),
            world_size,
            env: Vec::new(),
            rank_env: Vec::new(),
            ranks: None,
            deadline: Duration::from_secs(120),
            port: None,
        }
    }

    /// Appends one argument (the same for every rank).
    pub fn arg(mut self, a: impl Into<OsString>) -> Self {
        self.args.push(a.into());
        self
    }

    /// Appends arguments (the same for every rank).
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable for every rank (overrides the launch variables too).
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets several environment variables for every rank, as [`RankJob::env`].
    pub fn envs(mut self, vars: &[(&str, &str)]) -> Self {
        for (k, v) in vars {
            self = self.env(*k, *v);
        }
        self
    }

    /// Sets an environment variable for one rank only (applied last).
    pub fn rank_env(
        mut self,
        rank: usize,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        self.rank_env.push((rank, key.into(), value.into()));
        self
    }

    /// Puts every rank on an emulated host of its own (`DDP_HOST_ID=host-<rank>`), so that
    /// the ranks meet over TCP on loopback, as ranks of different machines do (ranks of one
    /// host meet over shared memory or a Unix socket).
    pub fn own_hosts(mut self) -> Self {
        for r in 0..self.world_size {
            self = self.rank_env(r, "DDP_HOST_ID", format!("host-{r}"));
        }
        self
    }

    /// Starts only these ranks (the others "never arrive").
    pub fn only_ranks(mut self, ranks: impl IntoIterator<Item = usize>) -> Self {
        self.ranks = Some(ranks.into_iter().collect());
        self
    }

    /// Wall-clock limit from spawn; ranks still running then are killed.
    pub fn deadline(mut self, d: Duration) -> Self {
        self.deadline = d;
        self
    }

    /// Uses `port` as `MASTER_PORT` instead of a free one picked at [`RankJob::spawn`].
    pub fn master_port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Starts the ranks.
    pub fn spawn(self) -> std::io::Result<RunningJob> {
        let port = self.port.unwrap_or_else(free_port);
        let token = job_token();
        let started = Instant::now();
        let ranks = self
            .ranks
            .clone()
            .unwrap_or_else(|| (0..self.world_size).collect());
        let mut job = RunningJob {
            procs: Vec::new(),
            started,
            deadline: started + self.deadline,
            master_port: port,
        };
        for rank in ranks {
            let mut cmd = Command::new(&self.program);
            cmd.args(&self.args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", self.world_size.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", self.world_size.to_string())
                .env("GROUP_RANK", "0")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("DDP_JOB_TOKEN", &token)
                .env("OMP_NUM_THREADS", "1")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in &self.env {
                cmd.env(k, v);
            }
            for (r, k, v) in &self.rank_env {
                if *r == rank {
                    cmd.env(k, v);
                }
            }
            // On error `job` is dropped here, which kills the ranks already started.
            let mut child = cmd.spawn()?;
            let stdout = Arc::new(Mutex::new(Vec::new()));
            let stderr = Arc::new(Mutex::new(Vec::new()));
            let readers = vec![
                pump(child.stdout.take(), stdout.clone()),
                pump(child.stderr.take(), stderr.clone()),
            ];
            job.procs.push(RankProc {
                rank,
                child,
                stdout,
                stderr,
                readers,
                exit: None,
            });
        }
        Ok(job)
    }

    /// Starts the ranks and waits for all of them (see [`RunningJob::wait`]).
    pub fn run(self) -> std::io::Result<JobResult> {
        Ok(self.spawn()?.wait())
    }
}

fn pump(src: Option<impl Read + Send + 'static>, dst: Arc<Mutex<Vec<u8>>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let Some(mut src) = src else { return };
        let mut buf = [0u8; 8192];
        loop {
            match src.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => dst
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&buf[..n]),
            }
        }
    })
}

struct RankProc {
    rank: usize,
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    readers: Vec<JoinHandle<()>>,
    exit: Option<(ExitStatus, Instant)>,
}

impl RankProc {
    fn poll(&mut self) {
        if self.exit.is_none()
            && let Ok(Some(st)) = self.child.try_wait()
        {
            self.exit = Some((st, Instant::now()));
        }
    }

    fn text(buf: &Arc<Mutex<Vec<u8>>>) -> String {
        String::from_utf8_lossy(&buf.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

/// Rank processes that are running; dropping it kills and reaps all of them.
pub struct RunningJob {
    procs: Vec<RankProc>,
    started: Instant,
    deadline: Instant,
    master_port: u16,
}

impl RunningJob {
    /// The `MASTER_PORT` given to the ranks.
    pub fn master_port(&self) -> u16 {
        self.master_port
    }

    /// When the ranks were started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The process id of `rank`, if it was started.
    pub fn pid(&self, rank: usize) -> Option<u32> {
        self.procs
            .iter()
            .find(|p| p.rank == rank)
            .map(|p| p.child.id())
    }

    /// Sends SIGKILL to `rank`; returns the moment it was sent.
    pub fn kill(&mut self, rank: usize) -> std::io::Result<Instant> {
        let p = self
            .procs
            .iter_mut()
            .find(|p| p.rank == rank)
            .ok_or_else(|| std::io::Error::other(format!("rank {rank} was not started")))?;
        let at = Instant::now();
        p.child.kill()?;
        Ok(at)
    }

    /// The ranks that have exited so far, with their status.
    pub fn exited(&mut self) -> Vec<(usize, ExitStatus)> {
        self.procs
            .iter_mut()
            .filter_map(|p| {
                p.poll();
                p.exit.map(|(st, _)| (p.rank, st))
            })
            .collect()
    }

    /// Output of `rank` so far (stdout then stderr).
    pub fn output_so_far(&self, rank: usize) -> String {
        self.procs
            .iter()
            .find(|p| p.rank == rank)
            .map(|p| format!("{}{}", RankProc::text(&p.stdout), RankProc::text(&p.stderr)))
            .unwrap_or_default()
    }

    /// Waits until every rank in `ranks` has printed `needle` (stdout or stderr); false if the
    /// job deadline or `timeout` passes first, or one of them exits without printing it.
    pub fn wait_for_output(&mut self, ranks: &[usize], needle: &str, timeout: Duration) -> bool {
        let until = self.deadline.min(Instant::now() + timeout);
        loop {
            let mut all = true;
            for p in self.procs.iter_mut().filter(|p| ranks.contains(&p.rank)) {
                let seen = RankProc::text(&p.stdout).contains(needle)
                    || RankProc::text(&p.stderr).contains(needle);
                if !seen {
                    p.poll();
                    if p.exit.is_some() {
                        return false;
                    }
                    all = false;
                }
            }
            if all {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for every rank to exit (up to the deadline, then kills the rest) and collects
    /// exit statuses, exit times and output.
    pub fn wait(mut self) -> JobResult {
        loop {
            let mut running = false;
            for p in &mut self.procs {
                p.poll();
                running |= p.exit.is_none();
            }
            if !running || Instant::now() >= self.deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut ranks = Vec::new();
        for mut p in std::mem::take(&mut self.procs) {
            let timed_out = p.exit.is_none();
            if timed_out {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
            for r in p.readers.drain(..) {
                let _ = r.join();
            }
            ranks.push(RankResult {
                rank: p.rank,
                status: p.exit.map(|(s, _)| s),
                exited_at: p.exit.map(|(_, t)| t),
                timed_out,
                stdout: RankProc::text(&p.stdout),
                stderr: RankProc::text(&p.stderr),
            });
        }
        JobResult {
            started: self.started,
            ranks,
        }
    }
}

impl Drop for RunningJob {
    fn drop(&mut self) {
        for p in &mut self.procs {
            p.poll();
            if p.exit.is_none() {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

/// How one rank ended.
#[derive(Debug, Clone)]
pub struct RankResult {
    /// The rank.
    pub rank: usize,
    /// Its exit status (`None` if it was still running at the deadline and was killed).
    pub status: Option<ExitStatus>,
    /// When it exited (observed within ~5 ms).
    pub exited_at: Option<Instant>,
    /// It ran past the job deadline.
    pub timed_out: bool,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

impl RankResult {
    /// The exit code, if it exited normally.
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }

    /// True when it exited with code 0.
    pub fn success(&self) -> bool {
        self.code() == Some(0)
    }

    /// stdout followed by stderr.
    pub fn output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// The outcome of a whole job.
#[derive(Debug, Clone)]
pub struct JobResult {
    /// When the ranks were started.
    pub started: Instant,
    /// One entry per started rank, in start order.
    pub ranks: Vec<RankResult>,
}

impl JobResult {
    /// The result of `rank` (panics if it was not started).
    pub fn rank(&self, rank: usize) -> &RankResult {
        self.ranks
            .iter()
            .find(|r| r.rank == rank)
            .unwrap_or_else(|| panic!("rank {rank} was not started"))
    }

    /// True when every rank exited with code 0.
    pub fn success(&self) -> bool {
        self.ranks.iter().all(RankResult::success)
    }

    /// Checks that every rank but `victim` exited within `limit` of `killed_at` (when the test
    /// killed `victim`), printing each one's delay and error output for the test log.
    ///
    /// # Panics
    /// When a rank did not exit, or exited later, with [`Self::report`].
    pub fn assert_others_exited_within(&self, victim: usize, killed_at: Instant, limit: Duration) {
        for r in self.ranks.iter().filter(|r| r.rank != victim) {
            let exited = r
                .exited_at
                .unwrap_or_else(|| panic!("rank {} did not exit:\n{}", r.rank, self.report()));
            let after = exited.saturating_duration_since(killed_at);
            eprintln!(
                "rank {} exited {after:?} after rank {victim} was killed: {}",
                r.rank,
                r.stderr.trim()
            );
            assert!(
                after < limit,
                "rank {} took {after:?} after the kill to exit:\n{}",
                r.rank,
                self.report()
            );
        }
    }

    /// Every rank's status and output, for failure messages.
    pub fn report(&self) -> String {
        let mut s = String::new();
        for r in &self.ranks {
            let how = match (r.timed_out, r.status) {
                (true, _) => "killed at the deadline".to_string(),
                (false, Some(st)) => st.to_string(),
                (false, None) => "unknown".to_string(),
            };
            s += &format!("--- rank {} ({how}) ---\n{}", r.rank, r.output());
            if !s.ends_with('\n') {
                s.push('\n');
            }
        }
        s
    }

    /// Panics with [`JobResult::report`] unless every rank exited with code 0.
    pub fn assert_success(&self) {
        assert!(self.success(), "a rank failed:\n{}", self.report());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ports are outside the range the kernel hands out for port 0, different from call
    /// to call, and bindable when returned.
    #[test]
    fn free_ports_are_below_the_ephemeral_range_and_bindable() {
        let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok());
        let ports: Vec<u16> = (0..20).map(|_| free_port()).collect();
        for &p in &ports {
            if let Some(start) = start.filter(|&s| s > 11_000) {
                assert!(p < start, "port {p} is in the ephemeral range from {start}");
            }
            assert!(TcpListener::bind(("127.0.0.1", p)).is_ok(), "port {p}");
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
    }
}
