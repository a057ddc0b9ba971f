//! Forming the mesh of one generation of a group: every rank binds its listeners, publishes
//! its [`PeerInfo`] under the generation's keys in the store (once and unchangeably), waits for
//! every other rank's, and connects ([`mesh::establish`]). Generation 0 is the group
//! [`ProcessGroup::init`] forms; each re-forming after a lost rank ([`super::reform`]) is the
//! next.
//!
//! **No dead generation.** A generation whose forming cannot finish is given up for the next,
//! within the connect deadline, never waited out:
//! - a replacement that finds its rank's slot taken (by the lost process, or by an earlier
//!   replacement that died after claiming it) starts the next generation itself;
//! - a rank whose handshake with a peer of its generation failed (the peer died or left it)
//!   starts the next generation;
//! - every rank waiting in a generation (for the others' addresses, or inside the handshake)
//!   looks at the group's current generation every [`GENERATION_POLL`] and moves to a later
//!   one as soon as there is one, with a fresh listener and identity.
//!
//! The generation counter only moves forward, by one, with a compare-and-set (the store
//! refuses any other change to it), so every rank agrees on which generation is current.
//!
//! [`ProcessGroup::init`]: super::ProcessGroup::init

use std::cell::{Cell, RefCell};
use std::io;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::local_socket;
use super::mesh::{self, MeshConfig, PeerInfo};
use super::{Home, Mesh, Msg, node_aware_from_env, nodes};
use crate::error::{CommError, Result};
use crate::port_range::PortRange;
use crate::store::{CompareSet, PrefixStore, Store, keys};

/// How this rank claims its slot in a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// In this generation (or a later one that supersedes it); a slot already taken is an
    /// error (two processes with one rank).
    In(u64),
    /// In place of a lost process: in the current generation, or, when the lost process (or
    /// an earlier replacement) holds its slot there, in the next one, which it starts.
    Replacing,
}

/// What one try at a generation came to.
enum Formed {
    /// The mesh of the generation tried.
    Mesh(Mesh),
    /// That generation was given up: try this later one.
    Later(u64),
}

/// Forms this rank's mesh, claiming its slot as `claim` says, in the store `home` holds;
/// sets `home.generation` to the generation formed (on failure, the last one tried).
pub(super) fn join(
    rank: usize,
    world: usize,
    claim: Claim,
    home: &mut Home,
    started: Instant,
) -> Result<Mesh> {
    let deadline = started + home.options.connect_timeout;
    let endpoint = home.endpoint.clone();
    let ip = mesh::local_ip_towards(&endpoint)
        .map_err(|e| CommError::io(format!("finding the interface to {endpoint}"), None, e))?;
    let ports = match home.options.listen_ports {
        Some(range) => Some(range),
        None => PortRange::from_env()?,
    };
    let replacing = claim == Claim::Replacing;
    let mut generation = match claim {
        Claim::In(g) => g,
        Claim::Replacing => {
            current_generation(&mut PrefixStore::new(&mut home.store, keys::PROCESS_GROUP))?
        }
    };
    let attempt = Attempt {
        rank,
        world,
        replacing,
        ip,
        ports,
        deadline,
        started,
    };
    loop {
        // Tried, if not formed: a later re-forming starts after it (its slots hold this
        // process's old addresses).
        home.generation = generation;
        match attempt.form(generation, home)? {
            Formed::Mesh(mesh) => return Ok(mesh),
            Formed::Later(next) => {
                tracing::info!(
                    rank,
                    "generation {generation} of the group was given up; joining generation {next}"
                );
                generation = next;
            }
        }
    }
}

/// What every try at a generation shares.
struct Attempt {
    rank: usize,
    world: usize,
    replacing: bool,
    ip: IpAddr,
    ports: Option<PortRange>,
    deadline: Instant,
    started: Instant,
}

impl Attempt {
    /// One try at forming `generation`.
    fn form(&self, generation: u64, home: &mut Home) -> Result<Formed> {
        let (rank, world, deadline, started) = (self.rank, self.world, self.deadline, self.started);
        let opts = home.options.clone();
        let endpoint = home.endpoint.clone();
        let listener = match self.ports {
            Some(range) => range.bind(self.ip, rank),
            None => std::net::TcpListener::bind((self.ip, 0)),
        }
        .map_err(|e| CommError::io(format!("binding a listener on {}", self.ip), None, e))?;
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
        let mut ns = PrefixStore::new(&mut home.store, keys::PROCESS_GROUP);
        let info = me.encode();
        match ns.set_once(&keys::peer_addr_in(generation, rank), &info)? {
            CompareSet::Swapped => die_after_claim_for_tests(),
            CompareSet::Current(Some(v)) if v == info => {}
            CompareSet::Current(_) if self.replacing => {
                // The slot of a process that is gone (the lost one, or a replacement that
                // died after claiming it): nobody will ever form this generation with it.
                return Ok(Formed::Later(next_generation(&mut ns, generation)?));
            }
            CompareSet::Current(_) => {
                return Err(CommError::Store {
                    addr: endpoint,
                    msg: format!(
                        "another process already joined as rank {rank} of this job \
                         (two ranks with RANK={rank}, or a leftover process of an earlier run \
                         on the same MASTER_PORT)"
                    ),
                });
            }
        }

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
        // In slices of GENERATION_POLL: a later generation ends the wait; every WAIT_PROGRESS a
        // line says which ranks this rank still waits for.
        let mut next_line = started + WAIT_PROGRESS;
        let waited = loop {
            let left = give_up.saturating_duration_since(Instant::now());
            match ns.wait(&key_refs, left.min(GENERATION_POLL)) {
                Err(CommError::Timeout { .. })
                    if !left.saturating_sub(GENERATION_POLL).is_zero() =>
                {
                    let now = current_generation(&mut ns)?;
                    if now > generation {
                        return Ok(Formed::Later(now));
                    }
                    if Instant::now() >= next_line {
                        next_line += WAIT_PROGRESS;
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
                addr: endpoint.clone(),
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
        let watch = GenerationWatch::new(&mut ns, generation);
        let established = mesh::establish(&cfg, listener, local, &infos, &|| watch.superseded());
        let ns = watch.into_store();
        let links = match established {
            Ok(links) => links,
            Err(e) => {
                let now = current_generation(ns)?;
                if now > generation {
                    return Ok(Formed::Later(now));
                }
                // A group's first forming (no replacement coming) fails at once, as it always
                // did; a re-forming, or a replacement's join, goes on with a later generation.
                let recovering = generation > 0 || self.replacing;
                if !recovering || !a_peer_is_gone(&e) || Instant::now() >= deadline {
                    return Err(e);
                }
                // A peer of this generation died or left it mid-handshake: this generation
                // can never form. Start the next (or join the one another rank started).
                tracing::warn!(
                    rank,
                    "the group's generation {generation} lost a rank while it formed ({e}); starting the next"
                );
                return Ok(Formed::Later(next_generation(ns, generation)?));
            }
        };
        let local = infos.iter().filter(|i| i.host == me.host).count();
        let nodes = nodes::Nodes::from_hosts(&infos.iter().map(|i| &i.host).collect::<Vec<_>>());
        let node_aware = node_aware_from_env()?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tracing::debug!(
            rank,
            world,
            local,
            generation,
            "process group ready in {:?}",
            started.elapsed()
        );
        Ok(Formed::Mesh(Mesh {
            links,
            msgs: (0..world).map(|_| Msg::default()).collect(),
            scratch: Vec::new(),
            stage: Vec::new(),
            half: Vec::new(),
            spin: local <= cores,
            node_aware: node_aware && nodes.as_ref().is_some_and(nodes::Nodes::worth_it),
            nodes,
            remote: infos.iter().map(|i| i.host != me.host).collect(),
        }))
    }
}

/// The variable of the test-only fault [`die_after_claim_for_tests`] (as ddprun's
/// `DDP_RDZV_FAULT`): `die-after-claim` makes a process started in place of a lost rank
/// (`DDP_REJOIN=1`) SIGKILL itself right after it claimed its slot in a generation, before
/// the others could connect to it: the "dead generation" a recovery must give up.
pub(crate) const GROUP_FAULT_VAR: &str = "DDP_GROUP_FAULT";

/// See [`GROUP_FAULT_VAR`].
fn die_after_claim_for_tests() {
    if crate::env::rejoining()
        && std::env::var(GROUP_FAULT_VAR).is_ok_and(|v| v == "die-after-claim")
    {
        eprintln!("{GROUP_FAULT_VAR}=die-after-claim: killing this process after its claim");
        // SAFETY: kill and getpid have no preconditions.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// Whether a handshake failed because a peer is gone (it died, or left for a later
/// generation): its connection closed, was refused or reset. Not a refusal of our identity, a
/// malformed answer or a timeout.
fn a_peer_is_gone(e: &CommError) -> bool {
    match e {
        CommError::PeerClosed { .. } => true,
        CommError::Io { source, peer, .. } => {
            peer.is_some()
                && matches!(
                    source.kind(),
                    io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::BrokenPipe
                        | io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::NotConnected
                )
        }
        _ => false,
    }
}

/// While a rank is inside the handshake of `generation`: whether the group has moved on to a
/// later generation (read from the store at most every [`GENERATION_POLL`]).
struct GenerationWatch<'n, 's, S: Store + ?Sized> {
    ns: RefCell<&'n mut PrefixStore<'s, S>>,
    generation: u64,
    checked: Cell<Instant>,
    moved: Cell<bool>,
}

impl<'n, 's, S: Store + ?Sized> GenerationWatch<'n, 's, S> {
    fn new(ns: &'n mut PrefixStore<'s, S>, generation: u64) -> Self {
        GenerationWatch {
            ns: RefCell::new(ns),
            generation,
            checked: Cell::new(Instant::now()),
            moved: Cell::new(false),
        }
    }

    fn superseded(&self) -> bool {
        if self.moved.get() || self.checked.get().elapsed() < GENERATION_POLL {
            return self.moved.get();
        }
        self.checked.set(Instant::now());
        // A store that cannot answer says nothing here: the handshake's own deadline holds.
        let now = current_generation(&mut **self.ns.borrow_mut()).unwrap_or(self.generation);
        self.moved.set(now > self.generation);
        self.moved.get()
    }

    fn into_store(self) -> &'n mut PrefixStore<'s, S> {
        self.ns.into_inner()
    }
}

/// The generation the survivors last started (0 before any).
pub(super) fn current_generation<S: Store + ?Sized>(ns: &mut PrefixStore<'_, S>) -> Result<u64> {
    Ok(ns
        .try_get(keys::MESH_GENERATION)?
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse().ok())
        .unwrap_or(0))
}

/// How often a rank waiting in a generation looks for a later one.
pub(super) const GENERATION_POLL: Duration = Duration::from_millis(50);

/// The generation after `left`: started by this rank (a compare-and-set from `left`, the only
/// change the store accepts to the counter) or by another rank first (then the current one,
/// which is later).
pub(super) fn next_generation<S: Store + ?Sized>(
    ns: &mut PrefixStore<'_, S>,
    left: u64,
) -> Result<u64> {
    let expected = (left > 0).then(|| left.to_string());
    let desired = (left + 1).to_string();
    match ns.compare_set(
        keys::MESH_GENERATION,
        expected.as_deref().map(str::as_bytes),
        desired.as_bytes(),
    )? {
        CompareSet::Swapped => Ok(left + 1),
        CompareSet::Current(_) => Ok(current_generation(ns)?.max(left + 1)),
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
