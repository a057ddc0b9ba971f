//! Which secret a job's processes authenticate with, so that no job runs unauthenticated by
//! accident.
//!
//! - `DDP_JOB_TOKEN` set (ddprun always sets it): that token; with `DDP_RANK_KEYS=1`
//!   (ddprun's ranks) it is this rank's own key, rank 0's the round's, from which rank 0's
//!   store derives every rank's ([`JobAuth::serve`]); where the launcher serves the store
//!   ([`crate::env::LAUNCHER_STORE_VAR`]), rank 0's is a key of its own too.
//! - Not set, every rank on this host (`LOCAL_WORLD_SIZE == WORLD_SIZE` and `MASTER_ADDR` an
//!   address of this machine): the store and the mesh listen on loopback only, and rank 0
//!   shares a fresh random secret through a file only this user can read: mode 0600, in a
//!   directory of mode 0700 owned by the user (`$XDG_RUNTIME_DIR/burn-ddp`, else
//!   `$HOME/.burn-ddp`: places no other user can create it in first), named by the job
//!   (`TORCHELASTIC_RUN_ID` or `SLURM_JOB_ID`) and the port. Rank 0 writes it only once it
//!   serves the store (a job that cannot bind the port never touches another job's file) and
//!   removes it once its group is up (or failed), if it still holds its own secret. The other
//!   ranks read it (again, if the store refuses a secret left by an earlier run).
//! - Not set, ranks on several hosts: refused with one line saying how to set a token, unless
//!   [`INSECURE_VAR`] is `1`; then every rank warns once and the job runs unauthenticated.
//!
//! The secret a process resolved is remembered for its endpoint, so a later client of the same
//! job (an NCCL group's) presents it too.

use std::io::{self, Write};
use std::net::{IpAddr, ToSocketAddrs, UdpSocket};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::auth::Key;
use crate::env::{LaunchEnv, TOKEN_VAR};
use crate::error::{CommError, Result};
use crate::store::{Credential, StoreClient, StoreServer};

/// Set to `1` to run a job of several hosts without `DDP_JOB_TOKEN`: every process that can
/// reach the store and the ranks' ports can then join, read and write the job.
pub const INSECURE_VAR: &str = "DDP_INSECURE_NO_TOKEN";

/// How long one connection attempt with a secret read from the file lasts before the file is
/// read again.
const ATTEMPT: Duration = Duration::from_secs(1);
/// Pause between two reads of a file that is not there yet.
const FILE_POLL: Duration = Duration::from_millis(5);

/// Secrets this process resolved, by store endpoint.
static RESOLVED: Mutex<Vec<(String, Option<String>)>> = Mutex::new(Vec::new());

/// Where the secret comes from.
#[derive(Debug)]
enum Source {
    /// `DDP_JOB_TOKEN`, or one this process resolved earlier for the endpoint.
    Given,
    /// The job's secret file (rank 0 wrote it when `owner`).
    File { path: PathBuf, owner: bool },
    /// The explicit opt-out: no secret.
    Insecure,
}

/// How this process authenticates to its job's store and peers.
#[derive(Debug)]
pub struct JobAuth {
    /// Where the job's store is (loopback for a single-host job without a token).
    pub endpoint: String,
    token: Option<String>,
    source: Source,
    /// This rank, when its token is a key of its own ([`crate::env::RANK_KEYS_VAR`]).
    own_key_of: Option<u32>,
}

impl JobAuth {
    /// The secret of the job `env` describes, for the process group that serves its store on
    /// rank 0 (see the module doc): rank 0 of a single-host job without a token makes the
    /// secret here and writes its file once it serves the store ([`JobAuth::publish`]; removed
    /// when this value drops); the other ranks read it when connecting.
    #[doc(hidden)]
    pub fn for_group(env: &LaunchEnv) -> Result<JobAuth> {
        Self::resolve(env, env.rank == 0, false)
    }

    /// The secret for a later client of the job's store (an NCCL group's): the one this
    /// process resolved for the group, else as `JobAuth::for_group` but reading the file on
    /// every rank.
    pub fn for_client(env: &LaunchEnv) -> Result<JobAuth> {
        Self::resolve(env, false, true)
    }

    /// See the module doc: rank 0 `writes_secret` of a single-host job without a token; a
    /// later client uses what this process `remembers` for the endpoint.
    fn resolve(env: &LaunchEnv, writes_secret: bool, remembers: bool) -> Result<JobAuth> {
        if let Some(token) = &env.job_token {
            return Ok(JobAuth {
                endpoint: env.master_endpoint(),
                token: Some(token.clone()),
                source: Source::Given,
                own_key_of: env.rank_keys.then_some(env.rank as u32),
            });
        }
        let single_host = env.local_world_size == env.world_size && is_this_host(&env.master_addr);
        let endpoint = if single_host {
            format!("127.0.0.1:{}", env.master_port)
        } else {
            env.master_endpoint()
        };
        if remembers && let Some(token) = remembered(&endpoint) {
            return Ok(JobAuth {
                endpoint,
                token,
                source: Source::Given,
                own_key_of: None,
            });
        }
        if !single_host {
            if std::env::var(INSECURE_VAR).as_deref() == Ok("1") {
                let warning = format!(
                    "rank {}: {TOKEN_VAR} is not set and {INSECURE_VAR}=1: this job is not \
                     authenticated; any process that reaches {endpoint} or a rank's port can \
                     join it, read and change what it exchanges",
                    env.rank
                );
                tracing::warn!("{warning}");
                if !tracing::dispatcher::has_been_set() {
                    // A warning about security is never lost for want of a subscriber.
                    eprintln!("warning: {warning}");
                }
                remember(&endpoint, None);
                return Ok(JobAuth {
                    endpoint,
                    token: None,
                    source: Source::Insecure,
                    own_key_of: None,
                });
            }
            return Err(CommError::Unauthenticated(format!(
                "{TOKEN_VAR} is not set and the ranks are on several hosts (WORLD_SIZE={} with \
                 LOCAL_WORLD_SIZE={}, MASTER_ADDR={}): set {TOKEN_VAR} to the same secret on \
                 every rank (e.g. `export {TOKEN_VAR}=$(openssl rand -hex 32)`), launch with \
                 ddprun (it makes one), or set {INSECURE_VAR}=1 to run without authentication",
                env.world_size, env.local_world_size, env.master_addr
            )));
        }
        let path = secret_dir()?.join(secret_name(env.master_port));
        if !writes_secret {
            return Ok(JobAuth {
                endpoint,
                token: None,
                source: Source::File { path, owner: false },
                own_key_of: None,
            });
        }
        // Written only once rank 0 serves the store ([`JobAuth::publish`]): a job that cannot
        // bind the port (another job's) never touches that job's secret.
        let secret = hex(&crate::auth::nonce());
        Ok(JobAuth {
            endpoint,
            token: Some(secret),
            source: Source::File { path, owner: false },
            own_key_of: None,
        })
    }

    /// Rank 0, once it serves the store: writes the job's secret file for the other ranks
    /// (a single-host job without a token; nothing otherwise). From then on this value owns
    /// the file, and removes it when dropped — only if it still holds this job's secret.
    #[doc(hidden)]
    pub fn publish(&mut self) -> Result<()> {
        let (Source::File { path, owner }, Some(secret)) = (&mut self.source, &self.token) else {
            return Ok(());
        };
        if *owner {
            return Ok(());
        }
        write_secret(path, secret)?;
        *owner = true;
        remember(&self.endpoint, Some(secret.clone()));
        Ok(())
    }

    /// The secret to serve the store with (rank 0); for a rank other than 0 reading the file,
    /// known once [`JobAuth::connect`] succeeded.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Whether this rank's token is a key of its own (`ddprun`'s per-rank keys).
    pub fn per_rank(&self) -> bool {
        self.own_key_of.is_some()
    }

    /// Rank 0: serves the job's store at its endpoint, with the job's key, or with per-rank
    /// keys derived from this rank's token (the round's) when ranks hold keys of their own.
    #[doc(hidden)]
    pub fn serve(&self) -> Result<StoreServer> {
        match (&self.token, self.own_key_of) {
            (Some(round), Some(_)) => StoreServer::bind_per_rank(&self.endpoint, round),
            (token, _) => StoreServer::bind(&self.endpoint, token.clone()),
        }
    }

    /// What this process proves to the store with `token`: the job's key, or this rank's own
    /// (rank 0 derives its own from the round's token, unless the launcher serves the store:
    /// then rank 0's token is its own key too).
    fn credential(&self, token: &str) -> Result<Credential> {
        let Some(rank) = self.own_key_of else {
            return Ok(Credential::job(token));
        };
        let key = if rank == 0 && !crate::env::store_served_by_launcher() {
            Key::from_token(token).rank_key(0)
        } else {
            Key::from_hex(token).ok_or_else(|| {
                CommError::Unauthenticated(format!(
                    "{TOKEN_VAR} is not a rank's key (64 hex digits) though {}=1",
                    crate::env::RANK_KEYS_VAR
                ))
            })?
        };
        Ok(Credential::rank(key, rank))
    }

    /// Connects a client to the job's store within `timeout`. With the secret file, reads it
    /// (waiting for rank 0 to write it), and reads it again when the store refuses the secret
    /// (one left by an earlier run on the same port) until `timeout`.
    pub fn connect(&mut self, timeout: Duration) -> Result<StoreClient> {
        let path = match &self.source {
            Source::File { path, owner: false } if self.token.is_none() => path.clone(),
            _ => {
                let credential = match &self.token {
                    Some(token) => Some(self.credential(token)?),
                    None => None,
                };
                return StoreClient::connect_with(&self.endpoint, credential.as_ref(), timeout);
            }
        };
        let started = Instant::now();
        let deadline = started + timeout;
        let mut last: Option<CommError> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(last.unwrap_or_else(|| CommError::Timeout {
                    op: format!(
                        "waiting for rank 0 to write the job's secret {} ({TOKEN_VAR} is not \
                         set; is rank 0 running on this host as the same user?)",
                        path.display()
                    ),
                    peer: Some(0),
                    after: started.elapsed(),
                }));
            }
            let Some(secret) = read_secret(&path)? else {
                std::thread::sleep(FILE_POLL.min(left));
                continue;
            };
            match StoreClient::connect(&self.endpoint, Some(&secret), left.min(ATTEMPT)) {
                Ok(client) => {
                    remember(&self.endpoint, Some(secret.clone()));
                    self.token = Some(secret);
                    return Ok(client);
                }
                // Refused (a secret an earlier run left) or not served yet: read it again.
                Err(e @ (CommError::Store { .. } | CommError::Timeout { .. })) => {
                    last = Some(e);
                    std::thread::sleep(FILE_POLL.min(left));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for JobAuth {
    /// Rank 0 removes the secret file: its group is up (every rank read it) or failed. Only
    /// its own: a file that holds another secret by now (another job's on the same port) stays.
    fn drop(&mut self) {
        if let (Source::File { path, owner: true }, Some(secret)) = (&self.source, &self.token) {
            match read_secret(path) {
                Ok(Some(held)) if held == *secret => remove_secret(path),
                Ok(_) => {}
                Err(e) => tracing::warn!("{e}"),
            }
        }
    }
}

fn remembered(endpoint: &str) -> Option<Option<String>> {
    let known = RESOLVED.lock().unwrap_or_else(|e| e.into_inner());
    known
        .iter()
        .find(|(e, _)| e == endpoint)
        .map(|(_, t)| t.clone())
}

fn remember(endpoint: &str, token: Option<String>) {
    let mut known = RESOLVED.lock().unwrap_or_else(|e| e.into_inner());
    known.retain(|(e, _)| e != endpoint);
    known.push((endpoint.to_string(), token));
}

/// Whether `addr` (a `MASTER_ADDR`) names this machine: a loopback address, or one a socket
/// can bind here.
fn is_this_host(addr: &str) -> bool {
    let Ok(ips) = (addr, 0).to_socket_addrs() else {
        return false;
    };
    let ips: Vec<IpAddr> = ips.map(|a| a.ip()).collect();
    !ips.is_empty()
        && ips
            .iter()
            .all(|ip| ip.is_loopback() || UdpSocket::bind((*ip, 0)).is_ok())
}

/// The directory of this user's job secrets, created (mode 0700) if absent; refused unless it
/// is a directory of this user's that no one else can read. It lies in a directory only this
/// user can create in — `$XDG_RUNTIME_DIR/burn-ddp`, else `$HOME/.burn-ddp` — so that no other
/// user can create it first and so block this user's jobs; the shared temporary directory
/// (`{temp}/burn-ddp-{uid}`, where another user *can* do that, and is refused) only when
/// neither variable names a directory.
fn secret_dir() -> Result<PathBuf> {
    let uid = unsafe { libc::getuid() };
    let named = |var: &str| {
        std::env::var_os(var)
            .filter(|d| !d.is_empty() && Path::new(d).is_dir())
            .map(PathBuf::from)
    };
    let dir = if let Some(runtime) = named("XDG_RUNTIME_DIR") {
        runtime.join("burn-ddp")
    } else if let Some(home) = named("HOME") {
        home.join(".burn-ddp")
    } else {
        std::env::temp_dir().join(format!("burn-ddp-{uid}"))
    };
    let unsafe_dir = |why: String| {
        CommError::Unauthenticated(format!(
            "cannot keep the job's secret in {}: {why} (set {TOKEN_VAR} instead)",
            dir.display()
        ))
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(unsafe_dir(e.to_string())),
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(|e| unsafe_dir(e.to_string()))?;
    if !meta.is_dir() {
        return Err(unsafe_dir("it is not a directory".into()));
    }
    if meta.uid() != uid {
        return Err(unsafe_dir(format!("it belongs to user {}", meta.uid())));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(unsafe_dir(format!(
            "others may use it (mode {:o})",
            meta.mode() & 0o777
        )));
    }
    Ok(dir)
}

/// The file name of the job's secret: the job's id where a launcher gives one, and the port.
fn secret_name(port: u16) -> String {
    let job = ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .map(|id| {
            id.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .take(64)
                .collect::<String>()
        })
        .unwrap_or_else(|| "job".into());
    format!("{job}-port{port}.secret")
}

/// Writes `secret` to `path` atomically: a file of mode 0600 beside it, then renamed over it.
fn write_secret(path: &Path, secret: &str) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let failed = |what: &str, e: io::Error| {
        let _ = std::fs::remove_file(&tmp);
        CommError::io(
            format!("{what} the job's secret {}", path.display()),
            None,
            e,
        )
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .or_else(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                std::fs::remove_file(&tmp)?;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&tmp)
            } else {
                Err(e)
            }
        })
        .map_err(|e| failed("writing", e))?;
    // No fsync: the ranks read it while this host runs; after a crash the job is over anyway.
    f.write_all(secret.as_bytes())
        .map_err(|e| failed("writing", e))?;
    std::fs::rename(&tmp, path).map_err(|e| failed("publishing", e))
}

/// The secret in `path`; `None` while it is absent (only `NotFound` means absent).
fn read_secret(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) if s.trim().is_empty() => Ok(None),
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CommError::io(
            format!("reading the job's secret {}", path.display()),
            None,
            e,
        )),
    }
}

fn remove_secret(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("could not remove the job's secret {}: {e}", path.display()),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_file_is_private_and_replaced_atomically() {
        let dir = secret_dir().unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o700);
        let path = dir.join(format!("unit-{}.secret", std::process::id()));
        write_secret(&path, "first").unwrap();
        write_secret(&path, "second").unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().mode() & 0o777,
            0o600,
            "only this user reads it"
        );
        assert_eq!(read_secret(&path).unwrap().as_deref(), Some("second"));
        remove_secret(&path);
        assert_eq!(read_secret(&path).unwrap(), None, "absent reads as None");
        let not_a_file = dir.join(format!("unit-dir-{}", std::process::id()));
        std::fs::create_dir(&not_a_file).unwrap();
        assert!(read_secret(&not_a_file).is_err(), "other errors stop");
        std::fs::remove_dir(&not_a_file).unwrap();
    }

    #[test]
    fn loopback_and_own_addresses_are_this_host() {
        assert!(is_this_host("127.0.0.1"));
        assert!(is_this_host("localhost"));
        assert!(!is_this_host("192.0.2.1"), "TEST-NET-1 is nobody's");
        assert!(!is_this_host("no-such-host.invalid"));
    }
}
