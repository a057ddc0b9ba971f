//! Progress across nodes: each launcher of a round publishes its ranks' snapshots under a key
//! of its own in the launchers' rendezvous store, once a second, and reads the other nodes',
//! on a thread of its own (a slow store never holds up the watch loop).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddp_comm::StoreClient;
use ddp_doctor::RankSnapshot;

/// How often a launcher publishes and reads.
const EVERY: Duration = Duration::from_secs(1);
/// The collectives of each rank that travel (the last ones).
const COLLECTIVES_SHARED: usize = 16;

#[derive(Default)]
struct Exchange {
    local: Vec<RankSnapshot>,
    others: Vec<RankSnapshot>,
}

/// One round's exchange of progress with the other nodes' launchers (stops when dropped).
pub(crate) struct Share {
    exchange: Arc<Mutex<Exchange>>,
    stop: Arc<AtomicBool>,
}

/// The store key of node `node`'s progress in round `round`.
fn key(round: u64, node: usize) -> String {
    format!("ddprun/doctor/{round}/{node}")
}

impl Share {
    /// Starts the exchange of node `node` (of `nodes`) in round `round` over the rendezvous
    /// store at `endpoint`.
    pub fn start(endpoint: String, token: String, round: u64, node: usize, nodes: usize) -> Self {
        let exchange = Arc::new(Mutex::new(Exchange::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (ex, halt) = (exchange.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("ddprun-progress".into())
            .spawn(move || {
                let mut client: Option<StoreClient> = None;
                while !halt.load(Ordering::Relaxed) {
                    if client.is_none() {
                        client = StoreClient::connect(&endpoint, Some(&token), EVERY)
                            .map(|mut c| {
                                c.set_io_timeout(EVERY);
                                c
                            })
                            .ok();
                    }
                    if let Some(c) = client.as_mut()
                        && let Err(e) = swap(c, &ex, round, node, nodes)
                    {
                        tracing::debug!("sharing progress with the other launchers: {e}");
                        client = None;
                    }
                    std::thread::sleep(EVERY);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start sharing progress with the other launchers: {e}");
        }
        Share { exchange, stop }
    }

    /// Hands this node's latest snapshots over and returns the other nodes' latest.
    pub fn trade(&self, local: &[RankSnapshot]) -> Vec<RankSnapshot> {
        let mut ex = self.exchange.lock().unwrap_or_else(|p| p.into_inner());
        ex.local = local.to_vec();
        ex.others.clone()
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn swap(
    client: &mut StoreClient,
    exchange: &Mutex<Exchange>,
    round: u64,
    node: usize,
    nodes: usize,
) -> Result<(), String> {
    let mut mine = exchange
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .local
        .clone();
    for s in &mut mine {
        let n = s.collectives.len();
        s.collectives.drain(..n.saturating_sub(COLLECTIVES_SHARED));
    }
    let json = serde_json::to_vec(&mine).map_err(|e| e.to_string())?;
    client
        .set(&key(round, node), &json)
        .map_err(|e| e.to_string())?;
    let mut others = Vec::new();
    for n in (0..nodes).filter(|&n| n != node) {
        if let Some(bytes) = client.try_get(&key(round, n)).map_err(|e| e.to_string())? {
            match serde_json::from_slice::<Vec<RankSnapshot>>(&bytes) {
                Ok(v) => others.extend(v),
                Err(e) => tracing::debug!("node {n}'s progress is unreadable: {e}"),
            }
        }
    }
    exchange.lock().unwrap_or_else(|p| p.into_inner()).others = others;
    Ok(())
}
