//! End-to-end tests of the `ddprun` binary: real rank processes (`sh -c` scripts), real
//! signals. Every run has a deadline; on a deadline ddprun is SIGKILLed (its ranks die with it
//! through PDEATHSIG) and every rank PID a test learned is killed when the test ends.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const DDPRUN: &str = env!("CARGO_BIN_EXE_ddprun");
const DEADLINE: Duration = Duration::from_secs(60);

/// A scratch directory and the rank PIDs written into it; on drop, kills any PID still alive
/// and removes the directory.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddprun-test-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch { dir }
    }

    fn dir(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    /// The PIDs ranks wrote as `pid.<rank>`.
    fn pids(&self) -> BTreeMap<usize, i32> {
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir(&self.dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if let Some(rank) = name.strip_prefix("pid.").and_then(|r| r.parse().ok()) {
                let text = std::fs::read_to_string(self.dir.join(&name)).unwrap();
                out.insert(rank, text.trim().parse().unwrap());
            }
        }
        out
    }

    /// Waits until `n` ranks have written their PIDs.
    fn wait_for_pids(&self, n: usize) -> BTreeMap<usize, i32> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let pids = self.pids();
            if pids.len() >= n {
                return pids;
            }
            assert!(Instant::now() < deadline, "ranks never wrote their PIDs");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for pid in self.pids().values() {
            if alive(*pid) {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the parenthesised command name.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, Some("Z") | Some("X") | None)
}

/// Asserts every PID is gone, giving orphans' reapers a moment.
fn assert_all_gone(pids: &BTreeMap<usize, i32>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.values().any(|p| alive(*p)) {
        assert!(
            Instant::now() < deadline,
            "rank processes left behind: {:?}",
            pids.iter().filter(|(_, p)| alive(**p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    fn code(&self) -> Option<i32> {
        self.status.code()
    }
    /// stdout lines of `rank`, without the prefix.
    fn rank_lines(&self, rank: usize) -> Vec<&str> {
        ddp_testkit::rank_lines(&self.stdout, rank)
    }
}

/// A ddprun command with a clean environment for the variables the tests check.
fn ddprun_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(DDPRUN);
    cmd.args(args)
        .env_remove("OMP_NUM_THREADS")
        .env_remove("RAYON_NUM_THREADS")
        .env_remove("DDP_JOB_TOKEN")
        .env_remove("MASTER_PORT")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Waits for `child` with the test deadline; SIGKILLs it (and so its ranks) past it.
fn finish(child: Child) -> Run {
    let ended = ddp_testkit::Launched::adopt(child).wait_for(DEADLINE);
    Run {
        status: ended.status,
        stdout: ended.stdout,
        stderr: ended.stderr,
    }
}

fn run(cmd: &mut Command) -> Run {
    finish(cmd.spawn().expect("start ddprun"))
}

/// A shell snippet that records the rank's PID as `$DIR/pid.$RANK` (atomically).
const RECORD_PID: &str = r#"echo $$ > "$DIR/tmp.$RANK" && mv "$DIR/tmp.$RANK" "$DIR/pid.$RANK";"#;

/// A shell snippet that waits (at most ~10 s) until `$1` ranks have recorded their PIDs.
fn wait_for_pid_files(n: usize) -> String {
    format!(
        r#"i=0; while [ $(ls "$DIR" | grep -c '^pid\.') -lt {n} ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done;"#
    )
}

/// `ddprun --version` prints the package's version and starts nothing (what `cargo install
/// --path crates/ddprun` users check first).
/// Without `--master-port`, `MASTER_PORT` from the environment is the ranks' port (torchrun
/// reads it so); one that is not a port is refused with one line, not ignored.
/// `nproc` ranks that print the `MASTER_PORT` ddprun gave them, with `var=value` set.
fn echo_master_port(nproc: &str, var: &str, value: &str) -> Run {
    run(ddprun_cmd(&[
        "--nproc-per-node",
        nproc,
        "--",
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ])
    .env(var, value))
}

#[test]
fn master_port_from_the_environment_is_honoured() {
    let port = ddp_testkit::free_port().to_string();
    let r = echo_master_port("1", "MASTER_PORT", &port);
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    assert_eq!(r.rank_lines(0), [format!("P={port}")]);
    let r = run(ddprun_cmd(&["--nproc-per-node", "1", "--", "true"]).env("MASTER_PORT", "http"));
    assert_eq!(r.code(), Some(2), "{}", r.stderr);
    assert!(
        r.stderr.contains("MASTER_PORT=\"http\" is not a port"),
        "{}",
        r.stderr
    );
}

/// A job token of under 128 bits is refused, with the command that makes a good one and the
/// variable that accepts it anyway (then the launcher says it runs with a weak token); a strong
/// one, or the one ddprun makes, runs without a word.
#[test]
fn a_weak_job_token_is_refused_unless_the_user_says_so() {
    for (token, allow, code, said) in [
        (Some("password123"), false, 1, "is too weak"),
        (
            Some("password123"),
            true,
            0,
            "runs with a weak DDP_JOB_TOKEN",
        ),
        (Some("0123456789abcdef0123456789abcdef"), false, 0, ""),
        (None, false, 0, ""),
    ] {
        let mut cmd = ddprun_cmd(&["--nproc-per-node", "1", "--", "true"]);
        cmd.env_remove("DDP_ALLOW_WEAK_TOKEN");
        if let Some(t) = token {
            cmd.env("DDP_JOB_TOKEN", t);
        }
        if allow {
            cmd.env("DDP_ALLOW_WEAK_TOKEN", "1");
        }
        let r = run(&mut cmd);
        assert_eq!(r.code(), Some(code), "{token:?}: {}", r.stderr);
        if said.is_empty() {
            assert!(!r.stderr.contains("weak"), "{token:?}: {}", r.stderr);
        } else {
            assert!(r.stderr.contains(said), "{token:?}: {}", r.stderr);
        }
        if code == 1 {
            assert!(
                r.stderr.contains("DDP_ALLOW_WEAK_TOKEN")
                    && r.stderr.contains("openssl rand -hex 32"),
                "{}",
                r.stderr
            );
        }
    }
}

#[test]
fn version_prints_the_package_version() {
    let r = run(&mut ddprun_cmd(&["--version"]));
    assert!(r.status.success(), "{}", r.stderr);
    assert_eq!(
        r.stdout.trim(),
        format!("ddprun {}", env!("CARGO_PKG_VERSION")),
        "{}",
        r.stderr
    );
}

#[test]
fn launch_env_reaches_every_rank_for_one_to_four_ranks() {
    let cores = std::thread::available_parallelism().unwrap().get();
    let script = r#"echo "R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR P=$MASTER_PORT T=$DDP_JOB_TOKEN K=$DDP_RANK_KEYS O=${OMP_NUM_THREADS-unset} Y=${RAYON_NUM_THREADS-unset}""#;
    let mut tokens = Vec::new();
    for n in 1..=4usize {
        let nstr = n.to_string();
        let r = run(&mut ddprun_cmd(&[
            "--nproc-per-node",
            &nstr,
            "--",
            "sh",
            "-c",
            script,
        ]));
        assert_eq!(r.code(), Some(0), "n={n}: {}", r.stderr);
        assert_eq!(r.stderr, "", "no summary line on success");
        let mut ports = Vec::new();
        let mut toks = Vec::new();
        for rank in 0..n {
            let lines = r.rank_lines(rank);
            assert_eq!(lines.len(), 1, "n={n} rank {rank}: {}", r.stdout);
            let kv: BTreeMap<&str, &str> = lines[0]
                .split(' ')
                .map(|f| f.split_once('=').unwrap())
                .collect();
            let threads = if n > 1 {
                (cores / n).max(1).to_string()
            } else {
                "unset".to_string()
            };
            assert_eq!(kv["R"], rank.to_string());
            assert_eq!(kv["L"], rank.to_string());
            assert_eq!(kv["W"], nstr);
            assert_eq!(kv["LW"], nstr);
            assert_eq!(kv["G"], "0");
            assert_eq!(kv["A"], "127.0.0.1");
            assert_eq!(kv["O"], threads, "OMP_NUM_THREADS for n={n}");
            assert_eq!(kv["Y"], threads, "RAYON_NUM_THREADS for n={n}");
            let port: u16 = kv["P"].parse().unwrap();
            assert_ne!(port, 0);
            ports.push(port);
            assert!(kv["T"].len() >= 16, "token {:?}", kv["T"]);
            assert_eq!(kv["K"], "1", "each rank holds a key of its own");
            toks.push(kv["T"].to_string());
        }
        assert!(ports.windows(2).all(|w| w[0] == w[1]), "{ports:?}");
        // Rank 0 holds the round's token; every other rank the key derived from it for
        // itself, and no rank another's.
        let round = ddp_comm::auth::Key::from_token(&toks[0]);
        for (rank, tok) in toks.iter().enumerate().skip(1) {
            assert_eq!(*tok, round.rank_key(rank as u32).to_token(), "rank {rank}");
        }
        let mut distinct = toks.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), n, "{toks:?}");
        tokens.push(toks[0].clone());
    }
    // A fresh token per job.
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 4);
}

#[test]
fn user_settings_win_over_defaults_and_multi_node_ranks_are_offset() {
    let script = r#"echo "R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR P=$MASTER_PORT T=$DDP_JOB_TOKEN O=$OMP_NUM_THREADS Y=$RAYON_NUM_THREADS""#;
    // The user's OMP_NUM_THREADS is kept; the token is the launcher's.
    let r = run(
        ddprun_cmd(&["--nproc-per-node", "2", "--", "sh", "-c", script])
            .env("OMP_NUM_THREADS", "3")
            .env(
                "DDP_JOB_TOKEN",
                "shared-secret-0123456789abcdef0123456789abcdef",
            ),
    );
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    for rank in 0..2 {
        let line = r.rank_lines(rank)[0];
        assert!(line.contains(" O=3 "), "{line}");
        // The ranks' token is derived from the launcher's, which they never see (rank 1's
        // from the round's, for rank 1 alone).
        let round =
            ddp_comm::auth::Key::from_token("shared-secret-0123456789abcdef0123456789abcdef")
                .derive("ranks/attempt/0")
                .to_token();
        let derived = match rank {
            0 => round,
            r => ddp_comm::auth::Key::from_token(&round)
                .rank_key(r as u32)
                .to_token(),
        };
        assert!(line.contains(&format!(" T={derived} ")), "{line}");
    }
    // Both nodes of two (two ddprun: node 1 waits for node 0's rendezvous), torchrun's
    // underscore spellings, explicit port and threads. The port is the launchers'
    // rendezvous; the ranks get a fresh one for their rank 0, the same on both nodes.
    let node = |n: &str| {
        ddprun_cmd(&[
            "--nproc_per_node",
            "2",
            "--nnodes",
            "2",
            "--node_rank",
            n,
            "--master_addr",
            "localhost",
            "--master_port",
            "23456",
            "--threads-per-rank",
            "5",
            "--",
            "sh",
            "-c",
            script,
        ])
        .env(
            "DDP_JOB_TOKEN",
            "node-token-0123456789abcdef0123456789abcdef",
        )
        .spawn()
        .expect("start ddprun")
    };
    let (node0, node1) = (node("0"), node("1"));
    let (r0, r) = (finish(node0), finish(node1));
    assert_eq!(r0.code(), Some(0), "{}", r0.stderr);
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    let port = |line: &str| {
        line.split(" P=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_string()
    };
    let rank0_port = port(r0.rank_lines(0)[0]);
    // Each rank of the round holds its own key, derived from the round's token.
    let round = ddp_comm::auth::Key::from_token(
        &ddp_comm::auth::Key::from_token("node-token-0123456789abcdef0123456789abcdef")
            .derive("ranks/round/0")
            .to_token(),
    );
    let (key2, key3) = (round.rank_key(2).to_token(), round.rank_key(3).to_token());
    assert_ne!(rank0_port, "23456");
    assert_eq!(
        r.rank_lines(2),
        [format!(
            "R=2 L=0 W=4 G=1 A=localhost P={rank0_port} T={key2} O=5 Y=5"
        )]
    );
    assert_eq!(
        r.rank_lines(3),
        [format!(
            "R=3 L=1 W=4 G=1 A=localhost P={rank0_port} T={key3} O=5 Y=5"
        )]
    );
}

#[test]
fn output_lines_are_prefixed_per_stream_including_a_partial_last_line() {
    let script = r#"echo "out one $RANK"; echo "err one $RANK" >&2; echo "out two $RANK"; printf "no newline $RANK""#;
    let r = run(&mut ddprun_cmd(&[
        "--nproc-per-node",
        "3",
        "--",
        "sh",
        "-c",
        script,
    ]));
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    for rank in 0..3 {
        assert_eq!(
            r.rank_lines(rank),
            [
                format!("out one {rank}"),
                format!("out two {rank}"),
                format!("no newline {rank}")
            ]
        );
        assert!(
            r.stderr
                .lines()
                .any(|l| l == format!("[rank {rank}] err one {rank}")),
            "{}",
            r.stderr
        );
    }
    // Every line carries a prefix: no interleaving inside lines.
    assert!(
        r.stdout.lines().all(|l| l.starts_with("[rank ")),
        "{}",
        r.stdout
    );
    assert_eq!(r.stdout.lines().count(), 9);

    let r = run(&mut ddprun_cmd(&[
        "--nproc-per-node",
        "2",
        "--no-prefix",
        "--",
        "sh",
        "-c",
        "echo plain $RANK",
    ]));
    assert_eq!(r.code(), Some(0));
    let mut lines: Vec<&str> = r.stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["plain 0", "plain 1"]);
}

#[test]
fn failing_rank_exit_code_is_returned_and_every_other_rank_is_stopped() {
    let scratch = Scratch::new("exit3");
    // Rank 1 fails once everyone is up; rank 2 ignores SIGTERM (needs the SIGKILL); the
    // others sleep.
    let script = format!(
        r#"{RECORD_PID}
        if [ "$RANK" = 1 ]; then {} exit 3; fi
        if [ "$RANK" = 2 ]; then trap '' TERM; while :; do sleep 0.05; done; fi
        exec sleep 1000"#,
        wait_for_pid_files(4)
    );
    let r = run(ddprun_cmd(&[
        "--nproc-per-node",
        "4",
        "--grace-secs",
        "0.5",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .env("DIR", scratch.dir()));
    assert_eq!(r.code(), Some(3), "stderr: {}", r.stderr);
    let summary: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.starts_with("ddprun:"))
        .collect();
    assert_eq!(summary.len(), 1, "exactly one summary line: {}", r.stderr);
    assert!(
        summary[0].starts_with("ddprun: rank 1 failed with exit code 3 after "),
        "{}",
        summary[0]
    );
    assert!(
        summary[0].ends_with("; stopped the other 3 ranks"),
        "{}",
        summary[0]
    );
    let pids = scratch.pids();
    assert_eq!(pids.len(), 4);
    assert_all_gone(&pids);
}

#[test]
fn a_failure_of_the_last_rank_to_exit_is_never_dropped() {
    // One rank per node (the multi-node shape): immediate and late failures.
    for script in ["exit 3", "sleep 0.2; exit 3"] {
        let r = run(&mut ddprun_cmd(&[
            "--nproc-per-node",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ]));
        assert_eq!(r.code(), Some(3), "{script}: {}", r.stderr);
        assert!(
            r.stderr
                .contains("ddprun: rank 0 failed with exit code 3 after "),
            "{script}: {}",
            r.stderr
        );
    }
    // Every rank failing at once.
    let r = run(&mut ddprun_cmd(&[
        "--nproc-per-node",
        "3",
        "--",
        "sh",
        "-c",
        "exit 2",
    ]));
    assert_eq!(r.code(), Some(2), "{}", r.stderr);
    let summary = r
        .stderr
        .lines()
        .filter(|l| l.starts_with("ddprun:"))
        .count();
    assert_eq!(summary, 1, "exactly one summary line: {}", r.stderr);
}

#[test]
fn rank_killed_by_sigkill_gives_137_and_names_the_signal() {
    let scratch = Scratch::new("kill9");
    let script = format!(
        r#"{RECORD_PID}
        if [ "$RANK" = 0 ]; then {} kill -9 $$; fi
        exec sleep 1000"#,
        wait_for_pid_files(3)
    );
    let r = run(ddprun_cmd(&[
        "--nproc-per-node",
        "3",
        "--grace-secs",
        "2",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .env("DIR", scratch.dir()));
    assert_eq!(r.code(), Some(137), "stderr: {}", r.stderr);
    assert!(
        r.stderr
            .contains("ddprun: rank 0 was killed by signal 9 (SIGKILL) after "),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("stopped the other 2 ranks"),
        "{}",
        r.stderr
    );
    let pids = scratch.pids();
    assert_eq!(pids.len(), 3);
    assert_all_gone(&pids);
}

#[test]
fn killing_ddprun_with_sigkill_kills_its_ranks() {
    let scratch = Scratch::new("pdeathsig");
    let script = format!(
        r#"{RECORD_PID}
        if [ "$RANK" = 1 ]; then trap '' TERM INT; while :; do sleep 0.05; done; fi
        exec sleep 1000"#
    );
    let mut cmd = ddprun_cmd(&["--nproc-per-node", "3", "--", "sh", "-c", &script]);
    cmd.env("DIR", scratch.dir());
    let mut child = cmd.spawn().unwrap();
    let pids = scratch.wait_for_pids(3);
    assert!(pids.values().all(|p| alive(*p)));
    child.kill().unwrap(); // SIGKILL: ddprun gets no chance to clean up
    child.wait().unwrap();
    assert_all_gone(&pids);
}

#[test]
fn sigterm_and_sigint_to_ddprun_are_forwarded_then_escalated() {
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let scratch = Scratch::new(name);
        // Rank 0 exits cleanly on the forwarded signal; rank 1 ignores it (SIGKILL after the
        // grace period).
        let script = format!(
            r#"if [ "$RANK" = 0 ]; then trap 'echo "got signal"; exit 7' TERM INT; fi
            if [ "$RANK" = 1 ]; then trap '' TERM INT; fi
            {RECORD_PID}
            while :; do sleep 0.05; done"#
        );
        let mut cmd = ddprun_cmd(&[
            "--nproc-per-node",
            "2",
            "--grace-secs",
            "0.5",
            "--",
            "sh",
            "-c",
            &script,
        ]);
        cmd.env("DIR", scratch.dir());
        let child = cmd.spawn().unwrap();
        let ddprun_pid = child.id() as i32;
        let pids = scratch.wait_for_pids(2);
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(ddprun_pid, sig) }, 0);
        let r = finish(child);
        assert_eq!(r.code(), Some(128 + sig), "{name}: {}", r.stderr);
        assert_eq!(r.rank_lines(0), ["got signal"], "{name}: {}", r.stdout);
        assert!(
            r.stderr
                .contains(&format!("ddprun: received {name} after ")),
            "{}",
            r.stderr
        );
        assert!(r.stderr.contains("stopped 2 running ranks"), "{}", r.stderr);
        assert_all_gone(&pids);
    }
}

#[test]
fn background_grandchild_of_a_successful_rank_does_not_outlive_the_job() {
    let scratch = Scratch::new("grandchild");
    // The rank starts a background sleeper holding its stdout and exits 0 at once.
    let script = r#"sleep 1000 & echo $! > "$DIR/pid.0"; echo started"#;
    let r = run(
        ddprun_cmd(&["--nproc-per-node", "1", "--", "sh", "-c", script]).env("DIR", scratch.dir()),
    );
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    assert_eq!(r.rank_lines(0), ["started"]);
    assert_all_gone(&scratch.pids());
}

#[test]
fn bad_usage_gives_one_clear_error() {
    let r = run(&mut ddprun_cmd(&["--nproc-per-node", "0", "--", "true"]));
    assert_eq!(r.code(), Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("nproc-per-node"), "{}", r.stderr);

    let r = run(&mut ddprun_cmd(&["--nproc-per-node", "2"]));
    assert_eq!(r.code(), Some(2), "missing program: {}", r.stderr);

    let r = run(&mut ddprun_cmd(&["--nnodes", "2", "--", "true"]));
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("DDP_JOB_TOKEN must be set"),
        "{}",
        r.stderr
    );

    let r = run(
        ddprun_cmd(&["--nnodes", "2", "--node-rank", "2", "--", "true"])
            .env("DDP_JOB_TOKEN", "0123456789abcdef0123456789abcdef"),
    );
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("node_rank 2 is out of range"),
        "{}",
        r.stderr
    );

    let r = run(&mut ddprun_cmd(&[
        "--nproc-per-node",
        "2",
        "--",
        "/nonexistent/ddp-rank-program",
    ]));
    assert_eq!(r.code(), Some(127), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("cannot start rank 0 (\"/nonexistent/ddp-rank-program\")"),
        "{}",
        r.stderr
    );
}

#[test]
fn arguments_after_the_separator_reach_the_program_untouched() {
    let r = run(&mut ddprun_cmd(&[
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        r#"printf '%s|' "$@"; echo"#,
        "argv0",
        "--nproc-per-node",
        "7",
        "a b",
    ]));
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    assert_eq!(r.rank_lines(0), ["--nproc-per-node|7|a b|"]);
}

/// Logs into a pipe or a file carry no ANSI colour codes (they read `[2m…[0m [33m WARN[0m`
/// before): not ddprun's own lines, and its ranks are told their output is no terminal.
#[test]
fn logs_into_a_pipe_are_not_coloured_and_ranks_are_told() {
    let r = run(ddprun_cmd(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        r#"echo "colour=$DDP_LOG_COLOR"; [ "$RANK" = 1 ] && exit 4; exit 0"#,
    ])
    .env("RUST_LOG", "debug"));
    assert_eq!(r.code(), Some(4), "stderr: {}", r.stderr);
    assert!(
        r.stderr
            .lines()
            .any(|l| l.contains("DEBUG") || l.contains("INFO") || l.contains("WARN")),
        "ddprun logged nothing to check: {}",
        r.stderr
    );
    assert!(
        !r.stderr.contains('\u{1b}'),
        "ANSI codes in a pipe: {:?}",
        r.stderr
    );
    assert!(!r.stdout.contains('\u{1b}'), "{:?}", r.stdout);
    assert_eq!(r.rank_lines(0), ["colour=0"]);
    assert_eq!(r.rank_lines(1), ["colour=0"]);
}

/// A SIGTERM or Ctrl-C that reaches ddprun while it stops the group after a failure (the grace
/// period) ends the job: no restart, whatever `--max-restarts` says (before, the group was
/// restarted).
#[test]
fn a_signal_during_the_grace_period_after_a_failure_ends_the_job() {
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let scratch = Scratch::new(name);
        // Rank 1 fails (and says so) once rank 0 ignores SIGTERM (its PID file is written after
        // the trap: a SIGTERM before it would end rank 0 at once), so the group is stopping
        // for the whole grace period.
        let script = format!(
            r#"touch "$DIR/attempt.$DDP_RESTART_COUNT"
            if [ "$RANK" = 1 ]; then
              while [ ! -e "$DIR/pid.0" ]; do sleep 0.01; done
              touch "$DIR/failed.$DDP_RESTART_COUNT"; exit 3
            fi
            trap '' TERM INT; {RECORD_PID}
            while :; do sleep 0.05; done"#
        );
        let mut cmd = ddprun_cmd(&[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--grace-secs",
            "20",
            "--",
            "sh",
            "-c",
            &script,
        ]);
        cmd.env("DIR", scratch.dir());
        let child = cmd.spawn().unwrap();
        let ddprun_pid = child.id() as i32;
        let failed = scratch.dir.join("failed.0");
        let deadline = Instant::now() + DEADLINE;
        while !failed.exists() {
            assert!(Instant::now() < deadline, "rank 1 never failed");
            std::thread::sleep(Duration::from_millis(10));
        }
        let pids = scratch.wait_for_pids(1);
        // Well inside the 20 s grace period.
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(ddprun_pid, sig) }, 0);
        let r = finish(child);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{name}: waited out the grace period"
        );
        assert_ne!(r.code(), Some(0), "{name}: {}", r.stderr);
        assert!(
            !r.stderr.contains("restarting the group"),
            "{name}: restarted after the signal: {}",
            r.stderr
        );
        assert!(
            !scratch.dir.join("attempt.1").exists(),
            "{name}: a second attempt started"
        );
        assert_all_gone(&pids);
    }
}

/// `DDP_PORT_RANGE` keeps the ranks' store inside the range (the ranks' own listeners are
/// ddp-comm's, tested there), and a malformed value is refused with one line naming it.
#[test]
fn the_ranks_store_port_stays_in_ddp_port_range() {
    let lo: u16 = ddp_testkit::free_port();
    let range = format!("{lo}-{}", lo.saturating_add(20));
    let r = echo_master_port("2", "DDP_PORT_RANGE", &range);
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    for rank in 0..2 {
        let line = r.rank_lines(rank)[0];
        let port: u16 = line.trim_start_matches("P=").parse().unwrap();
        assert!((lo..=lo + 20).contains(&port), "{port} not in {range}");
    }
    let r = run(ddprun_cmd(&["--nproc-per-node", "2", "--", "true"]).env("DDP_PORT_RANGE", "9000"));
    assert_ne!(r.code(), Some(0));
    assert!(r.stderr.contains("DDP_PORT_RANGE"), "{}", r.stderr);
}
