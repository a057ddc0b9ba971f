//! A job's outcome, on every node: never a success for a failed or untrained job, and the same
//! code and line on every node that is still there. Two or three `ddprun` on loopback (see
//! `support`), each case one that a fault test found on an earlier launcher: a failure at the
//! moment of a scale-up, a job's end written before any round ran, a host stopped past (and
//! within) the heartbeat timeout, launchers that disagree on the heartbeat, a signal while the
//! host waits for the others to read the job's end, and the lines that name the cause.
//!
//! `DDPRUN_BIN=path` runs them against another `ddprun` binary (an earlier build, to see them
//! fail there).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use support::{Ended, Node, REPORT, free_port, launchers_client, same_end};

/// Waits (at most 30 s) until `path` exists.
fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits (at most 30 s) until `node` has written its rank's pid to `path`; `false` when the
/// launcher ended first.
fn started_its_rank(node: &mut Node, path: &Path) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        if !node.running() {
            return path.exists();
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid, sig) };
}

/// `runs` runs of `run`, `parallel` at a time (a 2-core CI machine must still start every
/// launcher well within its timeouts).
fn repeat<T: Send + 'static>(
    runs: usize,
    parallel: usize,
    run: impl Fn(usize) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    let mut out = Vec::new();
    for first in (0..runs).step_by(parallel) {
        let batch: Vec<_> = (first..(first + parallel).min(runs))
            .map(|i| std::thread::spawn(move || run(i)))
            .collect();
        out.extend(batch.into_iter().map(|t| t.join().unwrap()));
    }
    out
}

/// `--nnodes 1:2 --max-restarts 0`: node 0 runs round 0 alone; its rank exits 3, and node 1
/// arrives while node 0 holds the failure back to settle its cause (node 1 is started once
/// the rank has exited: a scale-up before the failure would stop the rank before it failed,
/// and rightly restart the group). The scale-up the host would make for node 1 must not erase
/// the failure: both nodes exit 3 with the rank's line, twenty times — first with the settle
/// stretched to 2 s (`DDP_RDZV_FAULT=settle-ms:2000`: node 1 lands inside it every time), then
/// at the launcher's own 0.5 s.
#[test]
fn a_failure_is_never_lost_to_a_scale_up() {
    let runs = repeat(20, 5, |i| {
        let dir = tempfile::tempdir().unwrap();
        let go = dir.path().join("go");
        let pid = dir.path().join("pid");
        let opts = [
            "--nnodes",
            "1:2",
            "--max-restarts",
            "0",
            "--rdzv-last-call",
            "0",
            "--grace-secs",
            "1",
            "--rdzv-join-timeout",
            "8",
        ];
        let script = format!(
            r#"if [ "$DDP_ROUND" = 0 ]; then echo $$ > {p}.tmp; mv {p}.tmp {p}; while [ ! -e {g} ]; do sleep 0.01; done; exit 3; fi; sleep 5"#,
            p = pid.display(),
            g = go.display()
        );
        let token = format!("tok-{i}");
        let stretched = i < 10;
        let vars: &[(&str, &str)] = if stretched {
            &[("DDP_RDZV_FAULT", "settle-ms:2000")]
        } else {
            &[]
        };
        // A port from `free_port` is not reserved: with runs in parallel another launcher may
        // take it first, and node 0 then ends before its rank starts. Another port then, three
        // times at most; any other early end fails the test with node 0's stderr.
        let (node0, port) = (0..3)
            .find_map(|attempt| {
                let port = free_port();
                let mut node0 = Node::start_with(0, &port, &token, &opts, &script, vars);
                if started_its_rank(&mut node0, &pid) {
                    return Some((node0, port));
                }
                let ended = node0.wait();
                assert!(
                    ended.stderr.contains(&port),
                    "run {i}: node 0 ended before its rank started: {}",
                    ended.stderr
                );
                eprintln!(
                    "run {i}, attempt {attempt}: port {port} taken: {}",
                    ended.stderr
                );
                None
            })
            .unwrap_or_else(|| panic!("run {i}: node 0 never started its rank"));
        let rank: i32 = std::fs::read_to_string(&pid)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        std::fs::write(&go, b"").unwrap();
        // The rank exits; its launcher reaps it (and notes the failure) within milliseconds.
        let deadline = Instant::now() + Duration::from_secs(20);
        // SAFETY: kill with signal 0 only checks that the process exists.
        while unsafe { libc::kill(rank, 0) } == 0 {
            assert!(Instant::now() < deadline, "run {i}: the rank never exited");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(20));
        let node1 = Node::start(1, &port, &token, &opts, &script);
        (i, node0.wait(), node1.wait())
    });
    let mut in_time = 0;
    for (i, a, b) in &runs {
        let what = format!("run {i}");
        // Without the stretch, a loaded machine may start node 1 only after the whole job
        // ended and node 0 closed the rendezvous: it then finds no host (a non-zero exit at
        // its join timeout, or a host that went away as it arrived). Never an exit 0.
        let late = *i >= 10 && b.code != Some(3);
        if late {
            assert!(b.code.is_some_and(|c| c != 0), "{what}: {}", b.stderr);
        } else {
            in_time += 1;
        }
        let nodes: &[(usize, &Ended)] = if late { &[(0, a)] } else { &[(0, a), (1, b)] };
        for (n, end) in nodes {
            assert_eq!(end.code, Some(3), "{what}, node {n}: {}", end.stderr);
            assert!(
                end.stderr.contains("rank 0 failed with exit code 3"),
                "{what}, node {n}: {}",
                end.stderr
            );
        }
    }
    eprintln!("node 1 joined before the job's end in {in_time} of 20 runs");
    assert!(in_time >= 10, "every stretched run has node 1 in time");
}

/// The launchers' state says the job finished with code 0 before any round ran (written by a
/// launchers'-key holder while node 0 and 1 wait for a third node): no launcher exits 0 for a
/// job that never trained; both say it did not complete.
#[test]
fn a_job_that_never_ran_a_round_never_exits_0() {
    use ddp_comm::store::CompareSet;
    let port = free_port();
    let opts = ["--nnodes", "3", "--rdzv-join-timeout", "20"];
    let node0 = Node::start(0, &port, "tok", &opts, REPORT);
    let node1 = Node::start(1, &port, "tok", &opts, REPORT);
    let mut client = launchers_client(&port, "tok");
    let key = "ddp/launchers/state";
    // Once both wait, the state says the job ended "done", with code 0.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "the two nodes never both waited");
        let bytes = client.get(key, Duration::from_secs(5)).unwrap();
        let mut state: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        if state["waiting"].as_array().unwrap().len() < 2 {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        state["seq"] = (state["seq"].as_u64().unwrap() + 1).into();
        state["phase"] = serde_json::json!({"Finished": {
            "end": {"kind": "Done", "line": "ddprun: forged: every rank exited 0", "exit_code": 0},
            "members": [],
            "acked": [],
        }});
        let forged = serde_json::to_vec(&state).unwrap();
        if client.compare_set(key, Some(&bytes), &forged).unwrap() == CompareSet::Swapped {
            break;
        }
    }
    let (a, b) = (node0.wait(), node1.wait());
    same_end(&[&a, &b], 1, "did not complete");
    assert!(a.stdout.is_empty() && b.stdout.is_empty(), "no rank ran");
}

/// What each run of a stall test leaves: its number, node 0 and node 1.
type Stalled = (usize, Ended, Ended);

/// Node 0 (the host) is stopped (SIGSTOP) for `stop` while both nodes' ranks run, then
/// resumed. `nnodes` is `2` or `1:2`.
fn stall_the_host(i: usize, nnodes: &'static str, stop: Duration, script: &str) -> Stalled {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let opts = [
        "--nnodes",
        nnodes,
        "--rdzv-last-call",
        "1",
        "--grace-secs",
        "1",
        "--rdzv-join-timeout",
        "60",
        "--max-restarts",
        "1",
    ];
    let script = format!(
        r#"if [ "$WORLD_SIZE" = 2 ]; then touch {d}/ready.$RANK; fi; {script}"#,
        d = dir.path().display()
    );
    let token = format!("stall-{i}");
    let node0 = Node::start(0, &port, &token, &opts, &script);
    let node1 = Node::start(1, &port, &token, &opts, &script);
    wait_for_file(&dir.path().join("ready.0"));
    wait_for_file(&dir.path().join("ready.1"));
    signal(node0.pid(), libc::SIGSTOP);
    std::thread::sleep(stop);
    signal(node0.pid(), libc::SIGCONT);
    (i, node0.wait(), node1.wait())
}

/// The host stopped for 6 s against a 2 s heartbeat timeout, then resumed, in an elastic job
/// (`1:2`) and a fixed one (`2`) with a restart left, ten times each: node 1 gives the host up;
/// the host, resumed, finds it was not running past the timeout and ends the job too, instead
/// of going on alone (and exiting 0 after a round 1 of one node) or waiting a join timeout for
/// a replacement of node 1. Both exit 1 naming the lost host, every time.
#[test]
fn a_host_stopped_past_the_heartbeat_timeout_fails_the_job_on_every_node() {
    let runs = repeat(20, 5, |i| {
        let nnodes = if i % 2 == 0 { "1:2" } else { "2" };
        let script = r#"if [ "$DDP_ROUND" = 0 ]; then sleep 30; fi; sleep 0.5"#;
        stall_the_host(i, nnodes, Duration::from_secs(6), script)
    });
    for (i, a, b) in &runs {
        let what = format!("run {i} ({})", if i % 2 == 0 { "1:2" } else { "2" });
        same_end(
            &[a, b],
            1,
            "lost the launchers' rendezvous host at 127.0.0.1:",
        );
        assert!(!a.stderr.contains(" was lost: "), "{what}: {}", a.stderr);
        // Node 0 ends soon after it runs again (not a join timeout later).
        assert!(a.after < Duration::from_secs(25), "{what}: {:?}", a.after);
    }
}

/// The host stopped for 1.6 s against a 2 s heartbeat timeout (less than the timeout: nobody
/// may be judged lost by it, neither node 1 by the host's stopped time nor the host by node
/// 1), twenty times: the job runs on and both nodes exit 0 in round 0.
#[test]
fn a_host_stopped_within_the_heartbeat_timeout_loses_nobody() {
    let runs = repeat(20, 5, |i| {
        stall_the_host(i, "1:2", Duration::from_millis(1600), "sleep 3")
    });
    for (i, a, b) in &runs {
        assert_eq!(
            (a.code, b.code),
            (Some(0), Some(0)),
            "run {i}\nnode 0: {}\nnode 1: {}",
            a.stderr,
            b.stderr
        );
        for end in [a, b] {
            assert!(
                !end.stderr.contains("was lost") && !end.stderr.contains("restarting"),
                "run {i}: {}",
                end.stderr
            );
        }
    }
}

/// A stopped host is given up within the bound the docs give: the heartbeat timeout (2 s),
/// 1.5 beats (0.6 s) and a last try of at most 1 s; node 1 then stops its ranks (grace 1 s)
/// and exits. Measured from the SIGSTOP to node 1's exit.
#[test]
fn a_stopped_host_is_detected_within_the_documented_bound() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let opts = ["--nnodes", "2", "--grace-secs", "1"];
    let script = format!(r#"touch {}/ready.$RANK; sleep 30"#, dir.path().display());
    let node0 = Node::start(0, &port, "tok", &opts, &script);
    let node1 = Node::start(1, &port, "tok", &opts, &script);
    wait_for_file(&dir.path().join("ready.0"));
    wait_for_file(&dir.path().join("ready.1"));
    let stopped = Instant::now();
    signal(node0.pid(), libc::SIGSTOP);
    let b = node1.wait();
    let took = stopped.elapsed();
    signal(node0.pid(), libc::SIGCONT);
    let a = node0.wait();
    eprintln!("node 1 gave the stopped host up and exited after {took:?}");
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    // 2 + 0.6 + 1 (the last try) + 1 (grace) + the output drain and slack of a loaded machine.
    assert!(took < Duration::from_secs(7), "{took:?}: {}", b.stderr);
    assert_eq!(a.code, Some(1), "{}", a.stderr);
}

/// A launcher with another heartbeat timeout than the host's is refused alone, with both
/// values; the job goes on without it (`1:2`) and ends 0.
#[test]
fn a_launcher_with_another_heartbeat_timeout_is_refused_alone() {
    let port = free_port();
    let opts = ["--nnodes", "1:2", "--rdzv-last-call", "0.5"];
    let s = format!("{REPORT}; sleep 2");
    let node0 = Node::start(
        0,
        &port,
        "tok",
        &[&opts[..], &["--rdzv-heartbeat-secs", "1"]].concat(),
        &s,
    );
    let node1 = Node::start(
        1,
        &port,
        "tok",
        &[&opts[..], &["--rdzv-heartbeat-secs", "30"]].concat(),
        &s,
    );
    let (a, b) = (node0.wait(), node1.wait());
    assert_eq!(a.code, Some(0), "{}", a.stderr);
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    assert!(
        b.stderr.contains("--rdzv-heartbeat-secs 30 (node 0 has 1)"),
        "{}",
        b.stderr
    );
    assert!(b.stdout.is_empty(), "{}", b.stdout);
}

/// SIGTERM to the host while it waits for node 1 to read the job's end (node 1's ranks take
/// 7 s to stop): the host stops waiting and exits 143 within its grace and a second, after
/// printing the job's line.
#[test]
fn a_signal_ends_the_hosts_wait_for_the_others_to_read_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("stopping");
    let port = free_port();
    let s = format!(
        r#"trap 'touch {m}; sleep 7; exit 0' TERM; if [ "$RANK" = 0 ]; then sleep 1; exit 3; fi; sleep 20 & wait"#,
        m = marker.display()
    );
    let node0 = Node::start(0, &port, "tok", &["--nnodes", "2", "--grace-secs", "1"], &s);
    let node1 = Node::start(
        1,
        &port,
        "tok",
        &["--nnodes", "2", "--grace-secs", "10"],
        &s,
    );
    // Node 1's rank is stopping (slowly): node 0 has its end and waits for node 1's read.
    wait_for_file(&marker);
    std::thread::sleep(Duration::from_millis(1500));
    let sent = Instant::now();
    node0.signal(libc::SIGTERM);
    let a = node0.wait();
    let took = sent.elapsed();
    assert_eq!(a.code, Some(143), "{}", a.stderr);
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(
        a.stderr.contains("rank 0 failed with exit code 3")
            && a.stderr
                .contains("received SIGTERM while the other nodes were reading"),
        "{}",
        a.stderr
    );
    let b = node1.wait();
    assert_eq!(b.code, Some(3), "{}", b.stderr);
}

/// A launcher that arrives while nothing listens at the rendezvous waits for the host (it may
/// be starting) and says so once the heartbeat timeout has passed; at the join timeout it
/// fails with the last error it saw, never an empty one. One that arrives at a host that
/// accepts connections but does not answer (stopped) gives it up within the heartbeat timeout.
#[test]
fn a_launcher_without_a_host_says_so() {
    let port = free_port();
    let node1 = Node::start(
        1,
        &port,
        "tok",
        &["--nnodes", "2", "--rdzv-join-timeout", "4"],
        REPORT,
    );
    let b = node1.wait();
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    assert!(
        b.stderr.contains("nothing listens at 127.0.0.1:"),
        "{}",
        b.stderr
    );
    assert!(!b.stderr.contains("last error: )"), "{}", b.stderr);
    assert!(b.after < Duration::from_secs(8), "{:?}", b.after);

    // A host that is there but stopped.
    let port = free_port();
    let opts = ["--nnodes", "2", "--rdzv-join-timeout", "60"];
    let node0 = Node::start(0, &port, "tok", &opts, REPORT);
    let mut probe = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while probe.is_none() {
        assert!(Instant::now() < deadline, "the host never listened");
        probe = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).ok();
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(probe);
    signal(node0.pid(), libc::SIGSTOP);
    let node1 = Node::start(1, &port, "tok", &opts, REPORT);
    let b = node1.wait();
    signal(node0.pid(), libc::SIGCONT);
    drop(node0);
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    assert!(
        b.stderr.contains("lost the launchers' rendezvous host")
            && b.stderr.contains("accepts connections but answered none"),
        "{}",
        b.stderr
    );
    assert!(b.after < Duration::from_secs(10), "{:?}", b.after);
}

/// On one node: rank 1 fails on an error of its own (exit 7) just after rank 0 exited 1 on
/// rank 1's failure and said so through `DDP_FAILURE_FILE` (as ddp-comm does when a peer
/// closes its connection). The launcher names rank 1, and exits 7.
#[test]
fn the_rank_with_its_own_error_is_named_not_the_one_that_relayed_it() {
    let script = r#"if [ "$RANK" = 0 ]; then printf '1\trank 1 closed its connection\n' > "$DDP_FAILURE_FILE"; exit 1; fi; sleep 0.2; exit 7"#;
    let out = std::process::Command::new(support::ddprun())
        .args([
            "--nproc-per-node",
            "2",
            "--grace-secs",
            "1",
            "--",
            "sh",
            "-c",
        ])
        .arg(script)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(
        stderr.contains("rank 1 failed with exit code 7"),
        "{stderr}"
    );
    assert!(!stderr.contains("rank 0 failed"), "{stderr}");

    // Across nodes: node 1's rank relays at once, node 0's rank fails on its own 0.2 s later.
    let port = free_port();
    let opts = ["--nnodes", "2", "--grace-secs", "1"];
    let s = r#"if [ "$RANK" = 1 ]; then printf '0\ton rank 0: No space left on device\n' > "$DDP_FAILURE_FILE"; exit 1; fi; sleep 0.2; exit 5"#;
    let node0 = Node::start(0, &port, "tok", &opts, s);
    let node1 = Node::start(1, &port, "tok", &opts, s);
    let (a, b) = (node0.wait(), node1.wait());
    same_end(&[&a, &b], 5, "rank 0 failed with exit code 5");
    assert!(!a.stderr.contains("rank 1 failed"), "{}", a.stderr);
}
