//! Forming the mesh of one generation of a group: every rank binds its listeners, publishes
//! its [`PeerInfo`] under the generation's keys in the store (once and unchangeably), waits for
//! every other rank's, and connects ([`mesh::establish`]). Generation 0 is the group
//! [`ProcessGroup::init`] forms; each re-forming after a lost rank ([`super::reform`]) is the
//! next.

use std::time::{Duration, Instant};

use super::local_socket;
use super::mesh::{self, MeshConfig, PeerInfo};
use super::{GroupOptions, Mesh, Msg, node_aware_from_env, nodes};
use crate::error::{CommError, Result};
use crate::port_range::PortRange;
use crate::store::{CompareSet, PrefixStore, Store, StoreClient, StoreServer, keys};

/// How this rank claims its slot in a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// In this generation; a slot already taken is an error (two processes with one rank).
    In(u64),
    /// In place of a lost process: in the first generation whose slot for this rank is free,
    /// waiting for the survivors to start one when the current one's is taken.
    Replacing,
}

/// Forms this rank's mesh: `store` (and rank 0's `server`) carry on into it.
#[allow(clippy::too_many_arguments)]
pub(super) fn join(
    rank: usize,
    world: usize,
    claim: Claim,
    opts: &GroupOptions,
    endpoint: &str,
    mut store: StoreClient,
    server: Option<StoreServer>,
    started: Instant,
) -> Result<Mesh> {
    let deadline = started + opts.connect_timeout;
    let ip = mesh::local_ip_towards(endpoint)
        .map_err(|e| CommError::io(format!("finding the interface to {endpoint}"), None, e))?;
    let ports = match opts.listen_ports {
        Some(range) => Some(range),
        None => PortRange::from_env()?,
    };
    let listener = match ports {
        Some(range) => range.bind(ip, rank),
        None => std::net::TcpListener::bind((ip, 0)),
    }
    .map_err(|e| CommError::io(format!("binding a listener on {ip}"), None, e))?;
    // The ranks on this host connect here; those on other hosts to `listener`.
    let local = match local_socket::LocalListener::bind() {
        Ok(l) if !l.path().to_string_lossy().contains('\n') => Some(l),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(
                "rank {rank}: no Unix socket for the ranks on this host ({e}); they connect over TCP, which any local user can reach"
            );
            None
        }
    };
    let identity = crate::auth::Identity::generate();
    let me = PeerInfo {
        addr: listener
            .local_addr()
            .map_err(|e| CommError::io("listener address", None, e))?,
        host: mesh::host_identity(),
        socket: local
            .as_ref()
            .map(|l| l.path().to_string_lossy().into_owned())
            .unwrap_or_default(),
        nonce: crate::auth::nonce(),
        identity: identity.public(),
    };
    let mut ns = PrefixStore::new(&mut store, keys::PROCESS_GROUP);
    let generation = claim_slot(&mut ns, &me.encode(), rank, claim, endpoint, deadline)?;

    let addr_keys: Vec<String> = (0..world)
        .map(|r| keys::peer_addr_in(generation, r))
        .collect();
    let key_refs: Vec<&str> = addr_keys.iter().map(String::as_str).collect();
    // Ranks other than 0 give up a little earlier, while rank 0 still serves the store, so
    // every rank can name the missing ranks itself.
    let margin = if rank == 0 {
        Duration::ZERO
    } else {
        (opts.connect_timeout / 10).min(Duration::from_millis(500))
    };
    let give_up = deadline.checked_sub(margin).unwrap_or(deadline);
    // In slices: every WAIT_PROGRESS a line says which ranks this rank still waits for.
    let waited = loop {
        let left = give_up.saturating_duration_since(Instant::now());
        match ns.wait(&key_refs, left.min(WAIT_PROGRESS)) {
            Err(CommError::Timeout { .. }) if !left.saturating_sub(WAIT_PROGRESS).is_zero() => {
                let missing = missing_ranks(&mut ns, &addr_keys)?;
                let line = format!(
                    "rank {rank}: waiting for rank(s) {} of {world} to join ({:.0} s of {:.0} s)",
                    mesh::list(&missing),
                    started.elapsed().as_secs_f64(),
                    opts.connect_timeout.as_secs_f64()
                );
                tracing::warn!("{line}");
                if !tracing::dispatcher::has_been_set() {
                    // Said even by a program that set up no logging: it is why it waits.
                    eprintln!("{line}");
                }
            }
            other => break other,
        }
    };
    if let Err(e) = waited {
        if !matches!(e, CommError::Timeout { .. }) {
            return Err(e);
        }
        let missing = missing_ranks(&mut ns, &addr_keys)?;
        if rank == 0 {
            // Keep serving briefly for ranks that started later than us.
            std::thread::sleep(Duration::from_millis(300));
        }
        return Err(CommError::Timeout {
            op: format!(
                "rendezvous: rank(s) {} of {world} never joined",
                mesh::list(&missing)
            ),
            peer: missing.first().copied(),
            after: started.elapsed(),
        });
    }
    let mut infos = Vec::with_capacity(world);
    for (r, k) in addr_keys.iter().enumerate() {
        let v = ns.get(k, Duration::from_secs(1))?;
        infos.push(PeerInfo::decode(&v).ok_or_else(|| CommError::Store {
            addr: endpoint.to_string(),
            msg: format!("rank {r} published a malformed address"),
        })?);
    }

    let cfg = MeshConfig {
        rank,
        world,
        identity: &identity,
        nonce: me.nonce,
        shared_memory: opts.shared_memory,
        deadline,
        started,
    };
    let links = mesh::establish(&cfg, listener, local, &infos)?;
    let local = infos.iter().filter(|i| i.host == me.host).count();
    let nodes = nodes::Nodes::from_hosts(&infos.iter().map(|i| &i.host).collect::<Vec<_>>());
    let node_aware = node_aware_from_env()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tracing::debug!(
        rank,
        world,
        local,
        "process group ready in {:?}",
        started.elapsed()
    );
    Ok(Mesh {
        links,
        msgs: (0..world).map(|_| Msg::default()).collect(),
        scratch: Vec::new(),
        stage: Vec::new(),
        half: Vec::new(),
        spin: local <= cores,
        node_aware: node_aware && nodes.as_ref().is_some_and(nodes::Nodes::worth_it),
        nodes,
        remote: infos.iter().map(|i| i.host != me.host).collect(),
        store,
        _server: server,
        generation,
        endpoint: endpoint.to_string(),
        options: opts.clone(),
    })
}

/// The generation the survivors last started (0 before any).
pub(super) fn current_generation<S: Store + ?Sized>(ns: &mut PrefixStore<'_, S>) -> Result<u64> {
    Ok(ns
        .try_get(keys::MESH_GENERATION)?
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse().ok())
        .unwrap_or(0))
}

/// Publishes `info` as this rank's in the generation `claim` names (or finds), once and
/// unchangeably: no other process holding the job's key can replace it. Returns the generation.
fn claim_slot<S: Store + ?Sized>(
    ns: &mut PrefixStore<'_, S>,
    info: &[u8],
    rank: usize,
    claim: Claim,
    endpoint: &str,
    deadline: Instant,
) -> Result<u64> {
    let mut generation = match claim {
        Claim::In(g) => g,
        Claim::Replacing => current_generation(ns)?,
    };
    loop {
        match ns.set_once(&keys::peer_addr_in(generation, rank), info)? {
            CompareSet::Swapped => return Ok(generation),
            CompareSet::Current(Some(v)) if v == info => return Ok(generation),
            CompareSet::Current(_) if claim == Claim::Replacing => {
                // The lost process's slot: the survivors start the next generation once they
                // notice the loss.
                generation = wait_for_generation_after(ns, generation, deadline)?;
            }
            CompareSet::Current(_) => {
                return Err(CommError::Store {
                    addr: endpoint.to_string(),
                    msg: format!(
                        "another process already joined as rank {rank} of this job \
                         (two ranks with RANK={rank}, or a leftover process of an earlier run \
                         on the same MASTER_PORT)"
                    ),
                });
            }
        }
    }
}

/// How often a replacement looks for the survivors' next generation.
const GENERATION_POLL: Duration = Duration::from_millis(20);

/// Waits until a generation after `generation` is started; returns it.
fn wait_for_generation_after<S: Store + ?Sized>(
    ns: &mut PrefixStore<'_, S>,
    generation: u64,
    deadline: Instant,
) -> Result<u64> {
    let started = Instant::now();
    loop {
        let now = current_generation(ns)?;
        if now > generation {
            return Ok(now);
        }
        if Instant::now() >= deadline {
            return Err(CommError::Timeout {
                op: format!(
                    "rejoining: the survivors never re-formed the group after generation {generation}"
                ),
                peer: None,
                after: started.elapsed(),
            });
        }
        std::thread::sleep(GENERATION_POLL);
    }
}

/// How often a rank waiting at rendezvous for the others says which it still waits for.
const WAIT_PROGRESS: Duration = Duration::from_secs(10);

/// The ranks whose address is not in the store yet.
fn missing_ranks<S: Store + ?Sized>(
    ns: &mut PrefixStore<'_, S>,
    addr_keys: &[String],
) -> Result<Vec<usize>> {
    let mut missing = Vec::new();
    for (r, k) in addr_keys.iter().enumerate() {
        if ns.try_get(k)?.is_none() {
            missing.push(r);
        }
    }
    Ok(missing)
}
