//! Unit tests' ranks: `world` process groups in one process, one thread each, over a real
//! rendezvous store and real links (TCP or shared memory), with a deadline.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddp_comm::env::EnvSource;
use ddp_comm::{GroupOptions, LaunchEnv, ProcessGroup};

use crate::comm::SharedGroup;

/// Runs `f(group, rank)` on `world` in-process ranks and returns their results in rank order.
/// Panics (naming the rank) when a rank panics or its group cannot form.
pub(crate) fn run_ranks<R: Send + 'static>(
    world: usize,
    f: impl Fn(SharedGroup, usize) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let port = ddp_testkit::free_port();
    let token = format!("unit-test-{port}");
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (f, token) = (Arc::clone(&f), token.clone());
            std::thread::spawn(move || {
                let env = LaunchEnv {
                    rank,
                    world_size: world,
                    local_rank: rank,
                    local_world_size: world,
                    group_rank: 0,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                    job_token: Some(token),
                    rank_keys: false,
                    source: EnvSource::Torchrun,
                };
                let options = GroupOptions {
                    timeout: Duration::from_secs(30),
                    ..GroupOptions::default()
                };
                let pg = ProcessGroup::init(&env, options)
                    .unwrap_or_else(|e| panic!("rank {rank}: group: {e}"));
                f(Arc::new(Mutex::new(pg)), rank)
            })
        })
        .collect();
    handles
        .into_iter()
        .enumerate()
        .map(|(rank, h)| h.join().unwrap_or_else(|_| panic!("rank {rank} panicked")))
        .collect()
}
