//! Jobs over several nodes: two or three `ddprun` processes on loopback (emulated hosts, one
//! launcher each), their rendezvous, restarts, lost nodes, scale-ups and bad input. Ranks are
//! `sh -c` scripts that print their environment. Every launcher has a deadline; past it, or
//! when a test fails, every launcher still running is SIGKILLed (its ranks die with it through
//! PDEATHSIG).

mod support;

use std::time::{Duration, Instant};

use support::{Node, REPORT, field, free_port};

fn script(fail_rank: usize, how: &str) -> String {
    format!(
        r#"{REPORT}; if [ "$RANK" = {fail_rank} ] && [ "$DDP_RESTART_COUNT" = 0 ]; then sleep 1.5; {how}; fi; sleep 1"#
    )
}

/// Two nodes × `n` ranks, `--max-restarts 2`, rank `fail` SIGKILLed in round 0: both launchers
/// restart together in round 1 (one count, one token, one port for all) and exit 0.
fn both_nodes_restart_together(n: usize, fail: usize) {
    let port = free_port();
    let nproc = n.to_string();
    let opts = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        nproc.as_str(),
        "--max-restarts",
        "2",
    ];
    let s = script(fail, "kill -9 $$");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    let (a, b) = (node0.wait(), node1.wait());
    assert_eq!(a.code, Some(0), "node 0: {}", a.stderr);
    assert_eq!(b.code, Some(0), "node 1: {}", b.stderr);
    for (node, end) in [(0, &a), (1, &b)] {
        // One line about the failure on every node, naming the node and the rank.
        let line = format!(
            "node {} (ddprun pid",
            fail / n // the node of the failed rank
        );
        assert!(
            end.stderr.contains(&line)
                && end
                    .stderr
                    .contains(&format!("rank {fail} was killed by signal 9 (SIGKILL)"))
                && end
                    .stderr
                    .contains("restarting the group (restart budget 1 of 2 spent)"),
            "node {node}: {}",
            end.stderr
        );
    }
    let mut ports = std::collections::BTreeSet::new();
    for rank in 0..2 * n {
        let end = if rank < n { &a } else { &b };
        let lines = end.rank_lines(rank);
        assert_eq!(lines.len(), 2, "rank {rank} ran once per round: {lines:?}");
        for (round, line) in lines.iter().enumerate() {
            assert_eq!(field(line, "W"), (2 * n).to_string(), "{line}");
            assert_eq!(field(line, "G"), (rank / n).to_string(), "{line}");
            assert_eq!(field(line, "C"), round.to_string(), "{line}");
            // Derived from the launchers' token for each round: never "tok" itself; rank 0
            // holds the round's, every other rank its own key derived from it.
            let round_token = ddp_comm::auth::Key::from_token("tok")
                .derive(&format!("ranks/round/{round}"))
                .to_token();
            let token = match rank {
                0 => round_token,
                r => ddp_comm::auth::Key::from_token(&round_token)
                    .rank_key(r as u32)
                    .to_token(),
            };
            assert_eq!(field(line, "T"), token, "{line}");
            ports.insert((round, field(line, "P").to_string()));
        }
    }
    // One rank-0 port per round, shared by every rank, fresh for the restart, never the
    // launchers' own.
    assert_eq!(ports.len(), 2, "{ports:?}");
    assert!(ports.iter().all(|(_, p)| *p != port), "{ports:?}");
}

#[test]
fn a_rank_killed_on_node_1_restarts_both_nodes_in_one_round() {
    both_nodes_restart_together(1, 1);
}

#[test]
fn a_rank_killed_on_node_0_of_two_by_two_restarts_both_nodes() {
    both_nodes_restart_together(2, 1);
}

#[test]
fn a_rank_killed_on_node_1_of_two_by_two_restarts_both_nodes() {
    both_nodes_restart_together(2, 3);
}

/// `--max-restarts` counts rounds for the whole job: one failure on node 1, then one on
/// node 0, with one restart allowed, ends the job on both nodes with the second failure's code.
#[test]
fn the_restart_budget_is_the_jobs_not_each_nodes() {
    let port = free_port();
    let opts = ["--nnodes", "2", "--max-restarts", "1"];
    let s = format!(
        r#"{REPORT}; if [ "$RANK" = 1 ] && [ "$DDP_RESTART_COUNT" = 0 ]; then exit 3; fi; if [ "$RANK" = 0 ] && [ "$DDP_RESTART_COUNT" = 1 ]; then exit 4; fi; sleep 5"#
    );
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    let (a, b) = (node0.wait(), node1.wait());
    assert_eq!(a.code, Some(4), "{}", a.stderr);
    assert_eq!(b.code, Some(4), "{}", b.stderr);
    for end in [&a, &b] {
        assert!(
            end.stderr.contains("rank 1 failed with exit code 3")
                && end.stderr.contains("restart budget 1 of 1 spent")
                && end.stderr.contains("rank 0 failed with exit code 4"),
            "{}",
            end.stderr
        );
    }
    // Rank 0 printed in both rounds (it prints, then fails in round 1); rank 1 of round 1 may
    // be stopped by rank 0's failure before it prints.
    assert_eq!(a.rank_lines(0).len(), 2, "{}", a.stdout);
    assert!(!b.rank_lines(1).is_empty(), "{}", b.stdout);
}

/// Every rank of both nodes fails at once (no restarts): both launchers exit with the failing
/// code and say which rank failed.
#[test]
fn every_rank_failing_at_once_fails_both_nodes() {
    let port = free_port();
    let opts = ["--nnodes", "2", "--nproc-per-node", "2"];
    let s = format!("{REPORT}; sleep 0.3; exit 5");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    let (a, b) = (node0.wait(), node1.wait());
    for (node, end) in [(0, &a), (1, &b)] {
        assert_eq!(end.code, Some(5), "node {node}: {}", end.stderr);
        assert!(
            end.stderr.contains("failed with exit code 5"),
            "node {node}: {}",
            end.stderr
        );
    }
}

/// Node 0's rank finishes at once; node 1's fails 1.5 s later: the job fails on both nodes —
/// node 0, already done, hears of it and exits non-zero too.
#[test]
fn a_rank_failing_late_fails_the_node_that_had_finished() {
    let port = free_port();
    let opts = ["--nnodes", "2"];
    let s = format!(r#"{REPORT}; if [ "$RANK" = 1 ]; then sleep 1.5; exit 6; fi"#);
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    let (a, b) = (node0.wait(), node1.wait());
    assert_eq!(b.code, Some(6), "{}", b.stderr);
    assert_eq!(a.code, Some(6), "{}", a.stderr);
    assert!(
        a.stderr.contains("node 1 (ddprun pid")
            && a.stderr.contains("rank 1 failed with exit code 6"),
        "{}",
        a.stderr
    );
}

/// `--nnodes 1:2`, node 1's ddprun SIGKILLed while its rank runs: node 0 goes on alone in the
/// next round (WORLD_SIZE 1) and finishes.
#[test]
fn a_lost_node_leaves_the_job_to_the_others_when_min_allows() {
    let port = free_port();
    let opts = [
        "--nnodes",
        "1:2",
        "--max-restarts",
        "1",
        "--rdzv-last-call",
        "0.5",
    ];
    let s = format!(r#"{REPORT}; if [ "$DDP_RESTART_COUNT" = 0 ]; then sleep 30; fi"#);
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    // Both in round 0 (the round fills up at MAX without waiting for the last call).
    let deadline = Instant::now() + Duration::from_secs(20);
    std::thread::sleep(Duration::from_secs(2));
    node1.signal(libc::SIGKILL);
    let b = node1.wait();
    assert_eq!(b.code, None, "node 1 was SIGKILLed: {b:?}");
    let a = node0.wait();
    assert!(Instant::now() < deadline, "node 0 took {:?}", a.after);
    assert_eq!(a.code, Some(0), "{}", a.stderr);
    let lines = a.rank_lines(0);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(field(lines[0], "W"), "2", "{lines:?}");
    assert_eq!(field(lines[1], "W"), "1", "{lines:?}");
    assert_eq!(field(lines[1], "C"), "1", "{lines:?}");
    // Node 0 heard of it: its rank lost its peer (the rank failed), or the heartbeat stopped.
    assert!(
        a.stderr.contains("node 1 (ddprun pid") && a.stderr.contains("restarting the group"),
        "{}",
        a.stderr
    );
}

/// `--nnodes 1:2`, node 1 started 3 s after node 0: round 0 starts with node 0 alone after
/// the last call; node 1's arrival restarts the group (a scale-up, not a restart) and round 1
/// runs both, with `--max-restarts 0`. The restart count is torchrun's (failed rounds: still
/// 0); `DDP_ROUND` counts the rounds.
#[test]
fn a_late_node_is_admitted_by_restarting_the_group() {
    let port = free_port();
    let opts = [
        "--nnodes",
        "1:2",
        "--max-restarts",
        "0",
        "--rdzv-last-call",
        "0.5",
    ];
    let s = format!(r#"{REPORT}; if [ "$WORLD_SIZE" = 1 ]; then sleep 30; fi; sleep 0.5"#);
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_secs(3));
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    let (a, b) = (node0.wait(), node1.wait());
    assert_eq!(a.code, Some(0), "{}", a.stderr);
    assert_eq!(b.code, Some(0), "{}", b.stderr);
    let lines = a.rank_lines(0);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(
        (
            field(lines[0], "W"),
            field(lines[0], "C"),
            field(lines[0], "N")
        ),
        ("1", "0", "0"),
        "{lines:?}"
    );
    assert_eq!(
        (
            field(lines[1], "W"),
            field(lines[1], "C"),
            field(lines[1], "N")
        ),
        ("2", "0", "1"),
        "{lines:?}"
    );
    assert_eq!(field(b.rank_lines(1)[0], "G"), "1");
    assert!(
        a.stderr
            .contains("is waiting to join; restarting the group to admit it"),
        "{}",
        a.stderr
    );
}

/// A launcher that disagrees with the job arrives while a round runs: it alone is refused,
/// with one line naming what differs; the running job goes on and ends 0 on both nodes.
#[test]
fn a_launcher_that_disagrees_is_refused_and_the_job_goes_on() {
    let cases: [(&[&str], &str, &str); 3] = [
        (
            &["--nproc-per-node", "2"],
            REPORT,
            "--nproc-per-node 2 (node 0 has 1)",
        ),
        (
            &["--max-restarts", "1"],
            REPORT,
            "--max-restarts 1 (node 0 has 0)",
        ),
        (&[], "echo other", "the program"),
    ];
    for (opts2, script2, says) in cases {
        let port = free_port();
        let opts = ["--nnodes", "2"];
        let s = format!("{REPORT}; sleep 3");
        let node0 = Node::start(0, &port, "tok", &opts, &s);
        let node1 = Node::start(1, &port, "tok", &opts, &s);
        std::thread::sleep(Duration::from_millis(800));
        let late = Node::start(1, &port, "tok", &[&opts[..], opts2].concat(), script2);
        let c = late.wait();
        assert_eq!(c.code, Some(1), "{}", c.stderr);
        assert!(
            c.stderr.contains("node 1 (ddprun pid")
                && c.stderr.contains(says)
                && c.stderr.contains("the job goes on without it")
                && !c.stderr.contains("ddprun: error: ddprun:"),
            "{}",
            c.stderr
        );
        assert!(c.stdout.is_empty(), "no rank ran: {}", c.stdout);
        let (a, b) = (node0.wait(), node1.wait());
        assert_eq!(a.code, Some(0), "{}", a.stderr);
        assert_eq!(b.code, Some(0), "{}", b.stderr);
        assert!(a.stderr.contains(says), "the host logs it: {}", a.stderr);
    }
}

/// A launcher with the wrong job token is refused (and the host logs it); the job, still
/// waiting for its second node, fails after the join timeout naming what is missing.
#[test]
fn a_launcher_with_the_wrong_token_is_refused() {
    let port = free_port();
    let opts = ["--nnodes", "2", "--rdzv-join-timeout", "3"];
    let node0 = Node::start(0, &port, "right", &opts, REPORT);
    std::thread::sleep(Duration::from_millis(300));
    let node1 = Node::start(1, &port, "wrong", &opts, REPORT);
    let b = node1.wait();
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    assert!(
        b.stderr.contains("cannot join the launchers' rendezvous") && b.stderr.contains("token"),
        "{}",
        b.stderr
    );
    let a = node0.wait();
    assert_eq!(a.code, Some(1), "{}", a.stderr);
    assert!(
        a.stderr.contains("refused") || a.stderr.contains("token"),
        "the host logs the refusal: {}",
        a.stderr
    );
    assert!(
        a.stderr
            .contains("only 1 of the at least 2 nodes the job needs joined round 0 within 3s"),
        "{}",
        a.stderr
    );
}

/// Node 0's ddprun SIGKILLed: the other node stops its ranks and fails with one line naming
/// the rendezvous host, within the heartbeat timeout.
#[test]
fn the_rendezvous_hosts_death_fails_every_other_node_at_once() {
    let port = free_port();
    let opts = ["--nnodes", "2"];
    let s = format!("{REPORT}; sleep 30");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_secs(1));
    let killed = Instant::now();
    node0.signal(libc::SIGKILL);
    let b = node1.wait();
    assert_eq!(b.code, Some(1), "{}", b.stderr);
    assert!(
        b.stderr
            .contains("lost the launchers' rendezvous host at 127.0.0.1"),
        "{}",
        b.stderr
    );
    assert!(
        killed.elapsed() < Duration::from_secs(2) + Duration::from_secs(5),
        "node 1 took {:?} to stop",
        killed.elapsed()
    );
    drop(node0);
}

/// A node whose ddprun is stopped (SIGSTOP: alive, silent) is lost after the heartbeat
/// timeout: on a fixed-size job without restarts, node 0 ends with a line naming it, and node
/// 1, resumed, ends non-zero too.
#[test]
fn a_stopped_launcher_is_lost_after_the_heartbeat_timeout() {
    let port = free_port();
    let opts = ["--nnodes", "2"];
    let s = format!("{REPORT}; sleep 30");
    let node0 = Node::start(0, &port, "tok", &opts, &s);
    let node1 = Node::start(1, &port, "tok", &opts, &s);
    std::thread::sleep(Duration::from_secs(1));
    node1.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let a = node0.wait();
    let took = stopped.elapsed();
    node1.signal(libc::SIGCONT);
    let b = node1.wait();
    assert_eq!(a.code, Some(1), "{}", a.stderr);
    assert!(
        a.stderr.contains("node 1 (ddprun pid") && a.stderr.contains("sent no heartbeat for"),
        "{}",
        a.stderr
    );
    // The heartbeat timeout (2 s), the ranks' stop, and up to 5 s waiting for node 1 to read
    // the end.
    assert!(took < Duration::from_secs(12), "node 0 took {took:?}");
    assert_ne!(b.code, Some(0), "{}", b.stderr);
}
