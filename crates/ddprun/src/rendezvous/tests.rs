//! The launchers' rendezvous in one process: a host and members over real sockets.

use std::time::Duration;

use super::host::Host;
use super::member::{Joined, Member};
use super::messages::{EndKind, NodeSpec, RoundEnd};
use super::{RendezvousError, Timing};

fn timing() -> Timing {
    Timing {
        heartbeat: Duration::from_secs(2),
        last_call: Duration::from_millis(300),
        join_timeout: Duration::from_secs(5),
        grace: Duration::from_secs(1),
    }
}

fn spec(node: usize, min: usize, max: usize) -> NodeSpec {
    NodeSpec {
        id: format!("launcher-{node}"),
        host: format!("host-{node}"),
        pid: 1000 + node as u32,
        requested_node_rank: node,
        nproc_per_node: 2,
        command: vec!["train".into()],
        max_restarts: 1,
        live_recovery: false,
        min_nodes: min,
        max_nodes: max,
        heartbeat_ms: 2_000,
        join_timeout_ms: 5_000,
    }
}

fn endpoint() -> String {
    let port = ddp_testkit::free_port();
    format!("127.0.0.1:{port}")
}

fn member(ep: &str, node: usize, min: usize, max: usize) -> Member {
    Member::connect(ep, "tok", spec(node, min, max), timing(), false, None, None).unwrap()
}

/// Three launchers joining in the order 0, 2, 1 get node ranks 0, 1, 2 (by `--node-rank`),
/// one rank-0 address, and the end written first.
#[test]
fn a_round_orders_the_nodes_and_every_member_sees_one_end() {
    let ep = endpoint();
    let host = Host::start(&ep, "tok", spec(0, 3, 3), timing()).unwrap();
    let members: Vec<_> = [0, 2, 1]
        .into_iter()
        .map(|n| {
            let ep = ep.clone();
            std::thread::sleep(Duration::from_millis(50));
            std::thread::spawn(move || {
                let mut m = member(&ep, n, 3, 3);
                let info = match m.join().unwrap() {
                    Joined::Started(info) => info,
                    // Node 2 may end the round before this one looked.
                    Joined::Missed(info, end) => return (n, info, end),
                    Joined::Finished(end, _) => panic!("the job ended: {end:?}"),
                };
                if n == 2 {
                    let end = RoundEnd::new(EndKind::Failed, "node 2 failed".into(), 9);
                    assert_eq!(m.claim(info.round, &end).unwrap(), end);
                    // A second end loses: the first stands.
                    let later = RoundEnd {
                        exit_code: 1,
                        ..end.clone()
                    };
                    assert_eq!(m.claim(info.round, &later).unwrap(), end);
                }
                let end = m.wait_end(info.round).unwrap();
                (n, info, end)
            })
        })
        .collect();
    let seen: Vec<_> = members.into_iter().map(|h| h.join().unwrap()).collect();
    for (n, info, end) in &seen {
        assert_eq!(info.round, 0);
        assert_eq!(
            info.nodes,
            ["launcher-0", "launcher-1", "launcher-2"],
            "node {n}"
        );
        assert_eq!(info.world_size(), 6);
        assert_eq!(
            (&info.master_addr, info.master_port),
            (&seen[0].1.master_addr, seen[0].1.master_port)
        );
        assert_eq!((end.kind, end.exit_code), (EndKind::Failed, 9));
    }
    drop(host);
}

/// A member whose host never comes up gets one clear error naming the endpoint, after the
/// join timeout.
#[test]
fn a_member_without_a_host_fails_naming_the_endpoint() {
    let ep = endpoint();
    let t = Timing {
        join_timeout: Duration::from_millis(500),
        ..timing()
    };
    let err = Member::connect(&ep, "tok", spec(1, 2, 2), t, false, None, None)
        .err()
        .expect("no host");
    assert!(matches!(err, RendezvousError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains(&ep), "{err}");
}

/// A member whose configuration differs is refused with the difference named, and the job
/// goes on: the others still get their round.
#[test]
fn a_member_that_differs_is_refused_and_the_job_goes_on() {
    let ep = endpoint();
    let host = Host::start(&ep, "tok", spec(0, 2, 2), timing()).unwrap();
    let other = NodeSpec {
        nproc_per_node: 4,
        ..spec(2, 2, 2)
    };
    let err = Member::connect(&ep, "tok", other, timing(), false, None, None)
        .err()
        .expect("refused");
    assert!(
        err.to_string()
            .contains("--nproc-per-node 4 (node 0 has 2)"),
        "{err}"
    );
    let ep1 = ep.clone();
    // Node 1 stays connected until the end of the test: a member that leaves is lost, and
    // the round would end before node 0 looked.
    let node1 = std::thread::spawn(move || {
        let mut m = member(&ep1, 1, 2, 2);
        let joined = m.join().unwrap();
        (m, joined)
    });
    let mut m0 = member(&ep, 0, 2, 2);
    let Joined::Started(info) = m0.join().unwrap() else {
        panic!("the job ended")
    };
    assert_eq!(info.nodes, ["launcher-0", "launcher-1"]);
    let (m1, joined) = node1.join().unwrap();
    assert!(matches!(joined, Joined::Started(_)));
    drop((m0, m1, host));
}
