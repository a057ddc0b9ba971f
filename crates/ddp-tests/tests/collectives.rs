//! Multi-process tests of every collective: real rank processes (`comm_worker`) on loopback,
//! world sizes 1–4, over shared memory, TCP, and a mix (two emulated hosts).
//!
//! Each rank checks its own results against values it computes itself; these tests check that
//! every rank exits 0.

use std::time::Duration;

use ddp_testkit::RankJob;

const WORKER: &str = env!("CARGO_BIN_EXE_comm_worker");

/// `tcp`: no shared memory, every rank on an emulated host of its own.
fn run(world: usize, scenario: &str, tcp: bool) {
    let mut job = RankJob::new(WORKER, world)
        .arg(scenario)
        .deadline(Duration::from_secs(240));
    if tcp {
        job = job.arg("--no-shm").own_hosts();
    }
    let res = job.run().expect("spawning ranks");
    res.assert_success();
}

#[test]
fn matrix_world_1() {
    run(1, "matrix", false);
}

#[test]
fn matrix_world_2_shm() {
    run(2, "matrix", false);
}

#[test]
fn matrix_world_2_tcp() {
    run(2, "matrix", true);
}

/// Ranks of one host without shared memory: the data travels over their Unix sockets.
#[test]
fn matrix_world_2_local_socket() {
    RankJob::new(WORKER, 2)
        .args(["matrix", "--no-shm"])
        .deadline(Duration::from_secs(240))
        .run()
        .expect("spawning ranks")
        .assert_success();
}

#[test]
fn matrix_world_3_shm() {
    run(3, "matrix", false);
}

#[test]
fn matrix_world_3_tcp() {
    run(3, "matrix", true);
}

#[test]
fn matrix_world_4_shm() {
    run(4, "matrix", false);
}

#[test]
fn matrix_world_4_tcp() {
    run(4, "matrix", true);
}

/// Ranks 0–1 and 2–3 on two emulated hosts: shared memory inside a host, TCP across.
#[test]
fn matrix_world_4_two_hosts() {
    let res = RankJob::new(WORKER, 4)
        .arg("matrix")
        .rank_env(0, "DDP_HOST_ID", "host-a")
        .rank_env(1, "DDP_HOST_ID", "host-a")
        .rank_env(2, "DDP_HOST_ID", "host-b")
        .rank_env(3, "DDP_HOST_ID", "host-b")
        .deadline(Duration::from_secs(240))
        .run()
        .expect("spawning ranks");
    res.assert_success();
}

/// Two `ddprun` launchers (`--nnodes 2`) of two ranks each, each launcher its own emulated host:
/// the large all-reduces take the node-aware path (every rank says so) and every rank's results
/// are right; both launchers exit 0.
#[test]
fn matrix_two_launchers_of_two_ranks_node_aware() {
    use std::process::Command;
    use std::time::Instant;
    let ddprun = std::path::Path::new(WORKER).with_file_name("ddprun");
    let port = ddp_testkit::free_port().to_string();
    let start = |node: usize| {
        ddp_testkit::Launched::spawn(
            Command::new(&ddprun)
                .args(["--nnodes", "2", "--node-rank", &node.to_string()])
                .args(["--nproc-per-node", "2", "--master-port", &port, "--"])
                .args([WORKER, "matrix"])
                .env(
                    "DDP_JOB_TOKEN",
                    "node-aware-matrix-0123456789abcdef0123456789abcdef",
                )
                .env("DDP_HOST_ID", format!("host-{node}"))
                .env_remove("DDP_NODE_AWARE"),
        )
        .expect("start ddprun")
    };
    let nodes = [start(0), start(1)];
    let deadline = Instant::now() + Duration::from_secs(240);
    let text: Vec<(String, String)> = nodes
        .into_iter()
        .enumerate()
        .map(|(node, launcher)| {
            let ended = launcher.wait_until(deadline);
            assert!(
                ended.status.success(),
                "launcher {node}: {}\n{}\n{}",
                ended.status,
                ended.stdout,
                ended.stderr
            );
            (ended.stdout, ended.stderr)
        })
        .collect();
    let all: String = text.iter().map(|(o, _)| o.as_str()).collect();
    for rank in 0..4 {
        let lines = ddp_testkit::rank_lines(&all, rank);
        assert!(
            lines.iter().any(|l| l.contains("node-aware all-reduce on")),
            "rank {rank}: {lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.ends_with("matrix ok")),
            "rank {rank}: {lines:?}"
        );
    }
}

/// 25M f32 (100 MB) all-reduce, sum and max.
#[test]
fn big_100mb_world_2_shm() {
    run(2, "big", false);
}

#[test]
fn big_100mb_world_3_tcp() {
    run(3, "big", true);
}
