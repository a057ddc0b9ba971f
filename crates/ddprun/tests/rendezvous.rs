//! The launchers' rendezvous under faults: launchers killed between any two rendezvous steps
//! (`DDP_RDZV_FAULT`), signals while nothing runs, a host whose state is garbage, ranks slow
//! to stop, the same kill repeated, a replaced node, and where each round's rank 0 serves.
//! Two or three `ddprun` on loopback, each with a deadline (see `support`).

mod support;

use std::time::{Duration, Instant};

use support::{Node, REPORT, both_succeeded, field, free_port, launchers_client, same_end};

/// A launcher killed right after each rendezvous step, in a clean run and in one whose rank
/// fails: no node hangs, and every node still running ends within the grace period and the
/// heartbeat timeout (plus the test's slack), all with one exit code.
#[test]
fn a_launcher_killed_after_any_rendezvous_step_leaves_no_half_state() {
    // (step, the node killed, rank 1's exit code: 0 or a failure)
    let cases: [(&str, usize, i32); 9] = [
        ("join", 1, 0),
        ("done", 1, 0),
        ("claim", 1, 3),
        ("ack", 1, 3),
        ("ack", 1, 0),
        ("close", 0, 0),
        ("join", 0, 3),
        ("start", 0, 0),
        ("done", 0, 0),
    ];
    // Three jobs at a time: a loaded 2-core CI machine must still start every launcher well
    // within the join timeout.
    for batch in cases.chunks(3) {
        let runs: Vec<_> = batch
            .iter()
            .copied()
            .map(|(step, killed, code)| {
                std::thread::spawn(move || {
                    let port = free_port();
                    let opts = [
                        "--nnodes",
                        "2",
                        "--grace-secs",
                        "1",
                        "--rdzv-join-timeout",
                        "15",
                    ];
                    let s =
                        format!(r#"{REPORT}; sleep 0.5; [ "$RANK" = 1 ] && exit {code}; exit 0"#);
                    let fault = format!("exit-after:{step}");
                    let start = |n: usize| {
                        let vars: &[(&str, &str)] = if n == killed {
                            &[("DDP_RDZV_FAULT", fault.as_str())]
                        } else {
                            &[]
                        };
                        Node::start_with(n, &port, "tok", &opts, &s, vars)
                    };
                    let started = Instant::now();
                    let (a, b) = (start(0), start(1));
                    let ends = [a.wait(), b.wait()];
                    (step, killed, code, ends, started.elapsed())
                })
            })
            .collect();
        for run in runs {
            let (step, killed, code, ends, took) = run.join().unwrap();
            let what = format!("killed node {killed} after {step:?}, rank 1 exit {code}");
            let k = &ends[killed];
            assert_eq!(k.code, None, "{what}: the knob killed it: {}", k.stderr);
            // The host killed: the other node fails at once (1). Node 1 killed: node 0 ends
            // with the round's end — rank 1's code if node 1 wrote it before it died, else the
            // node lost (1), or 0 when node 1 had already marked its ranks done and was last.
            let other = &ends[1 - killed];
            let ok: &[i32] = match (killed, step, code) {
                (0, "done", c) => &[c, 1],
                (0, ..) => &[1],
                (1, "ack", c) => &[c],
                (1, "claim", c) | (1, "done", c) => &[c, 1],
                _ => &[0, 1],
            };
            assert!(
                other.code.is_some_and(|c| ok.contains(&c)),
                "{what}: node {} ended {:?}, expected one of {ok:?}: {}",
                1 - killed,
                other.code,
                other.stderr
            );
            assert!(took < Duration::from_secs(30), "{what}: took {took:?}");
        }
    }
}

/// The rarer steps, each in the scenario that takes it: the host killed right after it ended
/// a round for a scale-up, and right after it ended a job that could not gather; a refused
/// launcher killed right after its refusal was written. No node hangs; the survivors agree.
#[test]
fn a_launcher_killed_after_the_rarer_rendezvous_steps_leaves_no_half_state() {
    let fault = |step: &str| format!("exit-after:{step}");
    // Scale-up: node 0 alone in round 0 (1:2), node 1 arrives, the host ends the round and dies.
    let port = free_port();
    let opts = [
        "--nnodes",
        "1:2",
        "--rdzv-last-call",
        "0.3",
        "--grace-secs",
        "1",
    ];
    let s = format!("{REPORT}; sleep 20");
    let f = fault("scale-up");
    let node0 = Node::start_with(0, &port, "tok", &opts, &s, &[("DDP_RDZV_FAULT", &f)]);
    std::thread::sleep(Duration::from_millis(1500));
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    let (a, b) = (node0.wait(), node1.wait());
    assert_eq!(a.code, None, "the knob killed the host: {}", a.stderr);
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    assert!(b.after < Duration::from_secs(15), "{:?}", b.after);

    // Finish: 2 of 3 nodes within a 2 s join timeout; the host writes the job's end, dies.
    let port = free_port();
    let opts = ["--nnodes", "3", "--rdzv-join-timeout", "2"];
    let f = fault("finish");
    let node0 = Node::start_with(0, &port, "tok", &opts, REPORT, &[("DDP_RDZV_FAULT", &f)]);
    let node1 = Node::start(1, &port, "tok", &opts, REPORT);
    let (a, b) = (node0.wait(), node1.wait());
    assert_eq!(a.code, None, "the knob killed the host: {}", a.stderr);
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    assert!(b.after < Duration::from_secs(15), "{:?}", b.after);

    // Refuse: a launcher that differs is killed right after its refusal is written; the job
    // goes on and ends 0.
    let port = free_port();
    let opts = ["--nnodes", "2"];
    let s = format!("{REPORT}; sleep 2");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(500));
    let f = fault("refuse");
    let odd = Node::start_with(
        1,
        &port,
        "tok",
        &["--nnodes", "2", "--nproc-per-node", "2"],
        &s,
        &[("DDP_RDZV_FAULT", &f)],
    );
    let c = odd.wait();
    assert_eq!(c.code, None, "the knob killed it: {}", c.stderr);
    let (a, b) = (node0.wait(), node1.wait());
    both_succeeded(&a, &b);
}

/// Ctrl-C and SIGTERM end a launcher at once whatever it waits for: for the fewest nodes, for
/// room in a full job. The job it was waiting for goes on.
#[test]
fn signals_end_a_waiting_launcher_at_once() {
    // Waiting for MIN: node 0 alone of 2 (join timeout 20 s).
    let port = free_port();
    let opts = ["--nnodes", "2", "--rdzv-join-timeout", "20"];
    let node0 = Node::start(0, &port, "tok", &opts, REPORT);
    std::thread::sleep(Duration::from_millis(800));
    let sent = Instant::now();
    node0.signal(libc::SIGTERM);
    let a = node0.wait();
    assert_eq!(a.code, Some(143), "{}", a.stderr);
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "{:?}",
        sent.elapsed()
    );
    assert!(a.stderr.contains("received SIGTERM while"), "{}", a.stderr);

    // Waiting for room: 1:2 full with nodes 0 and 1; node 2 waits, gets SIGINT, leaves.
    let port = free_port();
    let opts = ["--nnodes", "1:2", "--rdzv-last-call", "0.3"];
    let s = format!("{REPORT}; sleep 4");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(1500));
    let extra = Node::start(2, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(800));
    let sent = Instant::now();
    extra.signal(libc::SIGINT);
    let c = extra.wait();
    assert_eq!(c.code, Some(130), "{}", c.stderr);
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "{:?}",
        sent.elapsed()
    );
    assert!(c.stdout.is_empty(), "{}", c.stdout);
    let (a, b) = (node0.wait(), node1.wait());
    both_succeeded(&a, &b);
}

/// SIGTERM to the rendezvous host while nodes wait for the fewest the job needs: the job ends
/// on every node at once, all with 143 and the host's line.
#[test]
fn the_hosts_interruption_ends_the_job_on_every_waiting_node() {
    let port = free_port();
    let opts = ["--nnodes", "3", "--rdzv-join-timeout", "20"];
    let node0 = Node::start(0, &port, "tok", &opts, REPORT);
    let node1 = Node::start(1, &port, "tok", &opts, REPORT);
    std::thread::sleep(Duration::from_millis(1000));
    let sent = Instant::now();
    node0.signal(libc::SIGTERM);
    let (a, b) = (node0.wait(), node1.wait());
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "{:?}",
        sent.elapsed()
    );
    same_end(&[&a, &b], 143, "node 0 (ddprun pid");
    assert!(b.stderr.contains("received SIGTERM"), "{}", b.stderr);
}

/// A launcher that arrives while a full job runs and waits for room learns of the job's end
/// when it comes: one line, and the job's exit code (0).
#[test]
fn a_launcher_waiting_in_a_full_job_hears_that_it_finished() {
    let port = free_port();
    let opts = ["--nnodes", "1:2", "--rdzv-last-call", "0.3"];
    let s = format!("{REPORT}; sleep 2");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(1000));
    let extra = Node::start(2, &port, "tok", &opts, &s);
    let (a, b, c) = (node0.wait(), node1.wait(), extra.wait());
    both_succeeded(&a, &b);
    assert_eq!(c.code, Some(0), "{}", c.stderr);
    assert!(
        c.stderr.contains("the job completed without this node"),
        "{}",
        c.stderr
    );
}

/// SIGINT to a node whose ranks run: it stops them and exits 130 within its grace period and
/// a second; the other node sees a node that left and ends with the same code and line.
#[test]
fn a_launcher_interrupted_while_its_ranks_run_leaves_and_is_named() {
    let port = free_port();
    let opts = ["--nnodes", "2", "--grace-secs", "1"];
    let s = format!("{REPORT}; sleep 20");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(1500));
    let sent = Instant::now();
    node1.signal(libc::SIGINT);
    let b = node1.wait();
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "{:?}",
        sent.elapsed()
    );
    let a = node0.wait();
    same_end(&[&a, &b], 130, "received SIGINT and left the job (round 0)");
    assert!(a.stderr.contains("node 1 (ddprun pid"), "{}", a.stderr);
}

/// The host's rendezvous state overwritten with garbage by a token holder: the rendezvous
/// does not die silently — node 0 ends with a line naming itself and what broke, and node 1
/// fails too.
#[test]
fn a_coordinator_that_cannot_read_the_state_ends_the_job_with_one_line() {
    let port = free_port();
    let opts = ["--nnodes", "3", "--rdzv-join-timeout", "30"];
    let node0 = Node::start(0, &port, "tok", &opts, REPORT);
    let node1 = Node::start(1, &port, "tok", &opts, REPORT);
    std::thread::sleep(Duration::from_millis(1000));
    let mut client = launchers_client(&port, "tok");
    client.set("ddp/launchers/state", b"{not json").unwrap();
    let (a, b) = (node0.wait(), node1.wait());
    assert!(a.after < Duration::from_secs(10), "{:?}", a.after);
    for (i, end) in [&a, &b].into_iter().enumerate() {
        assert_eq!(end.code, Some(1), "node {i}: {}", end.stderr);
    }
    assert!(
        a.stderr.contains("node 0 (ddprun pid")
            && a.stderr.contains("malformed launcher rendezvous value")
            && a.stderr.contains("the job stops"),
        "{}",
        a.stderr
    );
    // The state is named, not node 0 as a lost host of itself.
    assert!(
        !a.stderr.contains("lost the launchers' rendezvous host"),
        "{}",
        a.stderr
    );
    assert!(
        b.stderr.contains("malformed launcher rendezvous value")
            || b.stderr.contains("lost the launchers' rendezvous host"),
        "{}",
        b.stderr
    );
}

/// Node 1's ranks take 7 s past SIGTERM to stop (its grace is 10 s, node 0's 1 s) after node
/// 0's rank fails:
/// the host keeps the rendezvous until node 1 has read the end, so both exit with the
/// failing rank's code and line (not "lost the rendezvous host").
#[test]
fn ranks_slow_to_stop_still_get_the_jobs_exit_code() {
    let port = free_port();
    let s = format!(
        r#"trap 'sleep 7; exit 0' TERM; {REPORT}; if [ "$RANK" = 0 ]; then sleep 1; exit 3; fi; sleep 20 & wait"#
    );
    let node0 = Node::start(0, &port, "tok", &["--nnodes", "2", "--grace-secs", "1"], &s);
    let node1 = Node::start(
        1,
        &port,
        "tok",
        &["--nnodes", "2", "--grace-secs", "10"],
        &s,
    );
    let (a, b) = (node0.wait(), node1.wait());
    same_end(&[&a, &b], 3, "rank 0 failed with exit code 3");
    assert!(
        b.after > Duration::from_secs(7),
        "node 1's rank took its time: {:?}",
        b.after
    );
}

/// Rank 1 SIGKILLed while rank 0 (on the other node) fails with exit code 1 the moment its
/// peer is gone — as a training rank does on the closed connection — twenty times: every time,
/// both nodes exit 137 with the killed rank named.
#[test]
fn the_same_kill_gets_the_same_cause_on_every_node_every_time() {
    let dir = tempfile::tempdir().unwrap();
    for batch in 0..4 {
        let runs: Vec<_> = (batch * 5..batch * 5 + 5)
            .map(|i| {
                let pidfile = dir.path().join(format!("rank1.{i}.pid"));
                std::thread::spawn(move || {
                    let port = free_port();
                    let p = pidfile.display();
                    let s = format!(
                        r#"if [ "$RANK" = 1 ]; then echo $$ > {p}; sleep 1; kill -9 $$; fi
                    while [ ! -s {p} ]; do sleep 0.01; done; peer=$(cat {p})
                    while kill -0 $peer 2>/dev/null; do sleep 0.002; done; exit 1"#
                    );
                    let opts = [
                        "--nnodes",
                        "2",
                        "--grace-secs",
                        "1",
                        "--rdzv-join-timeout",
                        "15",
                    ];
                    // A token of its own: a launcher can only ever join its own job.
                    let token = format!("tok-{i}");
                    let node0 = Node::start(0, &port, &token, &opts, &s);
                    let node1 = Node::start(1, &port, &token, &opts, &s);
                    [node0.wait(), node1.wait()]
                })
            })
            .collect();
        for run in runs {
            let [a, b] = run.join().unwrap();
            assert!(
                a.code == Some(137) && b.code == Some(137),
                "node 0 {:?}: {}\nnode 1 {:?}: {}",
                a.code,
                a.stderr,
                b.code,
                b.stderr
            );
            same_end(&[&a, &b], 137, "rank 1 was killed by signal 9 (SIGKILL)");
            assert!(!a.stderr.contains("rank 0 failed"), "{}", a.stderr);
        }
    }
}

/// Node 1's ddprun SIGKILLed while rank 0 on node 0 fails with exit code 1 as soon as its peer
/// rank is gone: node 0 names the lost node, not its own rank.
#[test]
fn a_killed_launcher_is_named_as_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rank1.pid");
    let p = p.display();
    let s = format!(
        r#"if [ "$RANK" = 1 ]; then echo $$ > {p}; sleep 30; fi
        while [ ! -s {p} ]; do sleep 0.01; done; peer=$(cat {p})
        while kill -0 $peer 2>/dev/null; do sleep 0.002; done; exit 1"#
    );
    let port = free_port();
    let opts = ["--nnodes", "2", "--grace-secs", "1"];
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(1500));
    node1.signal(libc::SIGKILL);
    let a = node0.wait();
    assert_eq!(a.code, Some(1), "{}", a.stderr);
    assert!(
        a.stderr.contains("node 1 (ddprun pid")
            && a.stderr
                .contains("was lost: its connection to the rendezvous closed"),
        "{}",
        a.stderr
    );
    assert!(!a.stderr.contains("rank 0 failed"), "{}", a.stderr);
    drop(node1);
}

/// A job of fixed size (`--nnodes 2`) whose node 1 is killed waits for a replacement while
/// restarts remain: the one a scheduler starts joins round 1, and the job ends 0.
#[test]
fn a_fixed_size_job_waits_for_a_replacement_node() {
    let port = free_port();
    let opts = ["--nnodes", "2", "--max-restarts", "1", "--grace-secs", "1"];
    let s = format!(r#"{REPORT}; if [ "$DDP_ROUND" = 0 ]; then sleep 30; fi; sleep 0.5"#);
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(1500));
    node1.signal(libc::SIGKILL);
    drop(node1);
    std::thread::sleep(Duration::from_secs(2));
    let replacement = Node::start(1, &port, "tok", &opts, &s);
    let (a, c) = (node0.wait(), replacement.wait());
    assert_eq!(a.code, Some(0), "{}", a.stderr);
    assert_eq!(c.code, Some(0), "{}", c.stderr);
    let lines = a.rank_lines(0);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!((field(lines[1], "W"), field(lines[1], "C")), ("2", "1"));
    assert_eq!(field(c.rank_lines(1)[0], "N"), "1", "{}", c.stdout);
}

/// Every round's `MASTER_ADDR` is the address of that round's node 0 (`--local-addr`: node 1
/// is 127.0.0.2 here), whichever launcher that is: node 1, started first with no last call,
/// may run round 0 alone, and then its ranks meet on its own address, not node 0's.
#[test]
fn a_rounds_master_is_its_own_node_0() {
    let port = free_port();
    let opts = [
        "--nnodes",
        "1:2",
        "--rdzv-last-call",
        "0",
        "--max-restarts",
        "0",
    ];
    let s = format!(r#"{REPORT}; if [ "$WORLD_SIZE" = 1 ]; then sleep 30; fi; sleep 0.3"#);
    let node1 = Node::start(
        1,
        &port,
        "tok",
        &[&opts[..], &["--local-addr", "127.0.0.2"]].concat(),
        &s,
    );
    std::thread::sleep(Duration::from_millis(700));
    let node0 = Node::start(
        0,
        &port,
        "tok",
        &[&opts[..], &["--local-addr", "127.0.0.1"]].concat(),
        &s,
    );
    let (a, b) = (node0.wait(), node1.wait());
    both_succeeded(&a, &b);
    let mut lines: Vec<&str> = Vec::new();
    for (end, node_addr) in [(&a, "127.0.0.1"), (&b, "127.0.0.2")] {
        for line in end.stdout.lines() {
            let line = line.split_once("] ").map_or(line, |(_, l)| l);
            if field(line, "G") == "0" {
                assert_eq!(field(line, "A"), node_addr, "{line}");
            }
            lines.push(line);
        }
    }
    // Whatever the rounds, every rank of a round was told the same address.
    let mut by_round = std::collections::BTreeMap::<&str, std::collections::BTreeSet<&str>>::new();
    for line in &lines {
        by_round
            .entry(field(line, "N"))
            .or_default()
            .insert(field(line, "A"));
    }
    assert!(by_round.values().all(|a| a.len() == 1), "{by_round:?}");
}

/// The ranks' token cannot reach the launchers' rendezvous (it is derived from the job token
/// for that round, and the launchers' key for them), so no rank can write a round's end or
/// the job's; nor can the job token itself, presented as it is.
#[test]
fn a_ranks_token_cannot_reach_the_launchers_rendezvous() {
    use ddp_comm::store::StoreClient;
    let port = free_port();
    let opts = ["--nnodes", "2"];
    let s = format!("{REPORT}; sleep 3");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_millis(1000));
    let round0 = ddp_comm::auth::Key::from_token("tok")
        .derive("ranks/round/0")
        .to_token();
    let endpoint = format!("127.0.0.1:{port}");
    for token in [round0.as_str(), "tok"] {
        let err = StoreClient::connect(&endpoint, Some(token), Duration::from_secs(3))
            .expect_err("refused");
        assert!(err.to_string().contains("job's token"), "{err}");
    }
    let (a, b) = (node0.wait(), node1.wait());
    both_succeeded(&a, &b);
    // The ranks saw their round's token, not the launchers'.
    assert_eq!(field(a.rank_lines(0)[0], "T"), round0);
}

/// A flood of connections without the token on the launchers' store (silent, half frames,
/// garbage; several hundred a second from another address) while a two-node job runs: both
/// launchers finish with the same output as without it, and exit 0.
#[test]
fn a_flood_on_the_launchers_store_does_not_disturb_the_job() {
    let script =
        r#"i=0; while [ $i -lt 5 ]; do echo "R=$RANK step=$i"; i=$((i+1)); sleep 0.4; done"#;
    let run = |flood: bool| {
        let port = free_port();
        let opts = ["--nnodes", "2"];
        let node0 = Node::start(0, &port, "tok", &opts, script);
        let flood = flood.then(|| {
            ddp_testkit::Flood::start(
                "127.0.0.3".parse().unwrap(),
                format!("127.0.0.1:{port}").parse().unwrap(),
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        let node1 = Node::start(1, &port, "tok", &opts, script);
        let (a, b) = (node0.wait(), node1.wait());
        let rate = flood.as_ref().map(ddp_testkit::Flood::rate);
        drop(flood);
        both_succeeded(&a, &b);
        let mut lines: Vec<String> = [&a, &b]
            .iter()
            .flat_map(|e| e.stdout.lines())
            .map(|l| l.split_once("] ").map_or(l, |(_, l)| l).to_string())
            .collect();
        lines.sort();
        (lines, rate)
    };
    let (quiet, _) = run(false);
    let (flooded, rate) = run(true);
    let rate = rate.unwrap();
    eprintln!("launchers' store flooded at {rate:.0} connections/s");
    assert!(rate > 100.0, "{rate:.0}/s");
    assert_eq!(quiet, flooded);
    assert_eq!(quiet.len(), 10, "{quiet:?}");
}
