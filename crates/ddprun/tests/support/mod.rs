//! The harness of the multi-node tests: `ddprun` launchers ("nodes") on loopback, each an
//! emulated host (`DDP_HOST_ID`), with a deadline; every launcher still running when a test
//! ends is SIGKILLed (its ranks die with it through PDEATHSIG).

#![allow(dead_code)] // each test file uses its part

use std::process::Command;
use std::time::Duration;

use ddp_testkit::Launched;

const DDPRUN: &str = env!("CARGO_BIN_EXE_ddprun");

/// The `ddprun` under test: this build's, or `DDPRUN_BIN` (an earlier build, to see a test
/// fail there).
pub fn ddprun() -> std::ffi::OsString {
    std::env::var_os("DDPRUN_BIN").unwrap_or_else(|| DDPRUN.into())
}
pub const DEADLINE: Duration = Duration::from_secs(60);
/// Heartbeat timeout of the tests' launchers: short enough for the tests, long enough for a
/// loaded 2-core CI machine (beats every 400 ms).
pub const HEARTBEAT: &str = "2";

/// One launcher ("node") of a test job (SIGKILLed and reaped when dropped).
pub struct Node(Launched);

/// How a node ended.
#[derive(Debug)]
pub struct Ended {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub after: Duration,
}

/// Every node ended with `code` and said `line`.
pub fn same_end(nodes: &[&Ended], code: i32, line: &str) {
    for (i, end) in nodes.iter().enumerate() {
        assert_eq!(end.code, Some(code), "node {i}: {}", end.stderr);
        assert!(end.stderr.contains(line), "node {i}: {}", end.stderr);
    }
}

/// A client of the launchers' store of the job at `port` with token `token`, holding the
/// launchers' key (derived from the job token): what only a launcher holds.
pub fn launchers_client(port: &str, token: &str) -> ddp_comm::store::StoreClient {
    let launchers = ddp_comm::auth::Key::from_token(token)
        .derive("launchers")
        .to_token();
    ddp_comm::store::StoreClient::connect(
        &format!("127.0.0.1:{port}"),
        Some(&launchers),
        Duration::from_secs(10),
    )
    .unwrap()
}

/// Both nodes exited 0 (else a panic with both nodes' stderr).
pub fn both_succeeded(a: &Ended, b: &Ended) {
    assert_eq!(
        (a.code, b.code),
        (Some(0), Some(0)),
        "{}\n{}",
        a.stderr,
        b.stderr
    );
}

impl Ended {
    /// The stdout lines of global rank `rank`, without the prefix.
    pub fn rank_lines(&self, rank: usize) -> Vec<&str> {
        ddp_testkit::rank_lines(&self.stdout, rank)
    }
}

/// A free port for a job's rendezvous, as ddprun's `--master-port` takes it.
pub fn free_port() -> String {
    ddp_testkit::free_port().to_string()
}

impl Node {
    /// Starts `ddprun --node-rank N --master-port PORT OPTS -- sh -c SCRIPT` as host `host-N`
    /// (with the tests' heartbeat timeout unless `OPTS` sets one).
    pub fn start(node: usize, port: &str, token: &str, opts: &[&str], script: &str) -> Node {
        Self::start_with(node, port, token, opts, script, &[])
    }

    /// [`Node::start`] with more variables for ddprun (and so its ranks).
    pub fn start_with(
        node: usize,
        port: &str,
        token: &str,
        opts: &[&str],
        script: &str,
        vars: &[(&str, &str)],
    ) -> Node {
        let mut cmd = Command::new(ddprun());
        cmd.args(["--node-rank", &node.to_string(), "--master-port", port]);
        if !opts.contains(&"--rdzv-heartbeat-secs") {
            cmd.args(["--rdzv-heartbeat-secs", HEARTBEAT]);
        }
        cmd.args(opts)
            .args(["--", "sh", "-c", script])
            .env("DDP_JOB_TOKEN", token)
            // These tests name their tokens for what they test ("right", "wrong"), not for
            // their strength.
            .env("DDP_ALLOW_WEAK_TOKEN", "1")
            .env("DDP_HOST_ID", format!("host-{node}"))
            .env_remove("RUST_LOG")
            .env_remove("MASTER_PORT")
            .env_remove("OMP_NUM_THREADS")
            .env_remove("RAYON_NUM_THREADS")
            .envs(vars.iter().copied());
        Node(Launched::spawn(&mut cmd).expect("start ddprun"))
    }

    pub fn pid(&self) -> i32 {
        self.0.id() as i32
    }

    /// Whether the launcher is still running.
    pub fn running(&mut self) -> bool {
        self.0.running()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Waits for the launcher, at most the test deadline after its start (SIGKILLed past it).
    pub fn wait(self) -> Ended {
        let deadline = self.0.started() + DEADLINE;
        let ended = self.0.wait_until(deadline);
        Ended {
            code: ended.status.code(),
            after: ended.after,
            stdout: ended.stdout,
            stderr: ended.stderr,
        }
    }
}

/// Prints the rank's view of the round; fails rank `$FAIL_RANK` in round 0 as `$HOW` says.
pub const REPORT: &str = r#"echo "R=$RANK W=$WORLD_SIZE G=$GROUP_RANK L=$LOCAL_RANK P=$MASTER_PORT C=$DDP_RESTART_COUNT N=$DDP_ROUND A=$MASTER_ADDR T=$DDP_JOB_TOKEN""#;

/// The `key=value` fields of a rank's line.
pub fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}
