//! The launchers' rendezvous in one process: a host and members over real sockets.

use std::time::Duration;

use super::host::Host;
use super::member::Member;
use super::messages::{EndKind, NodeSpec, RoundEnd, RoundOutcome};
use super::{RendezvousError, Timing};

fn timing() -> Timing {
    Timing {
        heartbeat: Duration::from_secs(2),
        last_call: Duration::from_millis(300),
        join_timeout: Duration::from_secs(5),
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
        min_nodes: min,
        max_nodes: max,
    }
}

fn endpoint() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// Three launchers joining in the order 0, 2, 1 get node ranks 0, 1, 2 (host first, then by
/// `--node-rank`), one rank-0 port, and the end one of them claims.
#[test]
fn a_round_orders_the_nodes_and_every_member_sees_one_end() {
    let ep = endpoint();
    let host = Host::start(&ep, "tok", spec(0, 3, 3), timing(), "127.0.0.1").unwrap();
    let members: Vec<_> = [0, 2, 1]
        .into_iter()
        .map(|n| {
            let ep = ep.clone();
            std::thread::sleep(Duration::from_millis(50));
            std::thread::spawn(move || {
                let mut m = Member::connect(&ep, "tok", spec(n, 3, 3), timing()).unwrap();
                let round = m.open_round().unwrap();
                let RoundOutcome::Started(info) = m.join(round).unwrap() else {
                    panic!("refused")
                };
                if n == 2 {
                    let end = RoundEnd {
                        kind: EndKind::Failed,
                        line: "node 2 failed".into(),
                        exit_code: 9,
                    };
                    assert!(m.claim(round, &end).unwrap());
                    // A second claim loses.
                    assert!(
                        !m.claim(
                            round,
                            &RoundEnd {
                                exit_code: 1,
                                ..end
                            }
                        )
                        .unwrap()
                    );
                }
                let end = m.wait_end(round).unwrap();
                m.bye(round);
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
        assert_eq!(info.master_port, seen[0].1.master_port);
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
    let err = Member::connect(&ep, "tok", spec(1, 2, 2), t)
        .err()
        .expect("no host");
    assert!(matches!(err, RendezvousError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains(&ep), "{err}");
}
