//! Multi-process tests of every collective: real rank processes (`comm_worker`) on loopback,
//! world sizes 1–4, over shared memory, TCP, and a mix (two emulated hosts).
//!
//! Each rank checks its own results against values it computes itself; these tests check that
//! every rank exits 0.

use std::time::Duration;

use ddp_testkit::RankJob;

const WORKER: &str = env!("CARGO_BIN_EXE_comm_worker");

fn run(world: usize, scenario: &str, tcp: bool) {
    let mut job = RankJob::new(WORKER, world)
        .arg(scenario)
        .deadline(Duration::from_secs(240));
    if tcp {
        job = job.arg("--tcp");
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

/// 25M f32 (100 MB) all-reduce, sum and max.
#[test]
fn big_100mb_world_2_shm() {
    run(2, "big", false);
}

#[test]
fn big_100mb_world_3_tcp() {
    run(3, "big", true);
}
