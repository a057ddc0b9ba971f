//! Which secret a job's processes authenticate with, so that no job runs unauthenticated by
//! accident.
//!
//! - `DDP_JOB_TOKEN` set (ddprun always sets it): that token, if it is strong enough
//!   ([`weak_token`]: under 128 bits is refused unless [`WEAK_TOKEN_VAR`] is `1`, and then
//!   every rank says so); with `DDP_RANK_KEYS=1`
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

/// Set to `1` to run with a `DDP_JOB_TOKEN` weaker than [`MIN_TOKEN_BITS`] ([`weak_token`]):
/// every rank (and `ddprun`) then says once that it does. Without it such a token is refused.
pub const WEAK_TOKEN_VAR: &str = "DDP_ALLOW_WEAK_TOKEN";

/// The least strength a job token must have, in bits, by [`token_bits`]'s estimate.
pub const MIN_TOKEN_BITS: f64 = 128.0;

/// An estimate of a token's strength in bits, as if its characters were drawn at random:
/// its length times the bits of one character of the alphabet it draws from — 16 characters
/// if all are hex digits, else the sum of the classes it uses (10 digits, 26 lower-case
/// letters, 26 upper-case, 33 other printable ASCII characters, 128 for anything else). It
/// cannot tell words from random characters, so it never underrates a random token and
/// overrates a phrase: it refuses what is surely too short, no more.
pub fn token_bits(token: &str) -> f64 {
    let (length, alphabet) = token_alphabet(token);
    length as f64 * (alphabet as f64).log2()
}

/// A token's length in characters and the size of the alphabet [`token_bits`] counts it from.
fn token_alphabet(token: &str) -> (usize, u32) {
    let length = token.chars().count();
    if length > 0 && token.chars().all(|c| c.is_ascii_hexdigit()) {
        return (length, 16);
    }
    let has = |f: fn(&char) -> bool| token.chars().any(|c| f(&c));
    let classes = [
        (has(char::is_ascii_digit), 10),
        (has(char::is_ascii_lowercase), 26),
        (has(char::is_ascii_uppercase), 26),
        (has(|c| c.is_ascii() && !c.is_ascii_alphanumeric()), 33),
        (has(|c| !c.is_ascii()), 128),
    ];
    let alphabet = classes.iter().filter(|(on, _)| *on).map(|(_, n)| n).sum();
    (length, alphabet)
}

/// Why `token` is too weak to be a job's secret ([`token_bits`] under [`MIN_TOKEN_BITS`]), in
/// one line naming the rule, the way to make a good one and [`WEAK_TOKEN_VAR`]; `None` for a
/// strong one. Every token `ddprun` makes passes (32 or 64 hex digits).
pub fn weak_token(token: &str) -> Option<String> {
    let bits = token_bits(token);
    if bits >= MIN_TOKEN_BITS {
        return None;
    }
    let (length, alphabet) = token_alphabet(token);
    let needed = if alphabet > 1 {
        (MIN_TOKEN_BITS / (alphabet as f64).log2()).ceil() as usize
    } else {
        usize::MAX
    };
    let needed = if needed == usize::MAX {
        "more kinds of characters".to_string()
    } else {
        format!("at least {needed} such characters")
    };
    Some(format!(
        "{TOKEN_VAR} is too weak to be the job's secret: {length} characters from an alphabet \
         of {alphabet} make about {bits:.0} bits, under the {MIN_TOKEN_BITS:.0} required \
         ({needed}, or 32 hex digits); each connection to the job may try one guess of it. \
         Make one with `export {TOKEN_VAR}=$(openssl rand -hex 32)`, or set {WEAK_TOKEN_VAR}=1 \
         to run with this one anyway"
    ))
}

/// Whether this process was told to run with a weak token ([`WEAK_TOKEN_VAR`]).
fn weak_token_allowed() -> bool {
    std::env::var(WEAK_TOKEN_VAR).as_deref() == Ok("1")
}

/// Refuses `token`, given to this rank in its environment, if it is weak ([`weak_token`]),
/// unless [`WEAK_TOKEN_VAR`] is `1`: then says once that this rank runs with it.
fn check_token_strength(rank: usize, token: &str) -> Result<()> {
    let Some(why) = weak_token(token) else {
        return Ok(());
    };
    if !weak_token_allowed() {
        return Err(CommError::Unauthenticated(why));
    }
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        let warning = format!(
            "rank {rank}: runs with a weak {TOKEN_VAR} ({:.0} bits, under {MIN_TOKEN_BITS:.0}) \
             because {WEAK_TOKEN_VAR}=1: anyone who reaches the job's store may guess it on line",
            token_bits(token)
        );
        tracing::warn!("{warning}");
        if !tracing::dispatcher::has_been_set() {
            // A warning about security is never lost for want of a subscriber.
            eprintln!("warning: {warning}");
        }
    });
    Ok(())
}

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
            // The rule is for what the user put in the environment (ddprun's ranks get keys
            // of 64 hex digits); a program that builds its `LaunchEnv` itself answers for its
            // own.
            if std::env::var(TOKEN_VAR).is_ok_and(|t| t == *token) {
                check_token_strength(env.rank, token)?;
            }
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
                 every rank (e.g. `export {TOKEN_VAR}=$(openssl rand -hex 32)`; in a Slurm \
                 batch script before srun, see docs/clusters.md), launch with ddprun (it makes \
                 one), or set {INSECURE_VAR}=1 to run without authentication",
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

    /// Tokens under 128 bits by the estimate are refused, with the rule and the way out in
    /// the message; what ddprun makes, and what `openssl rand` makes, passes.
    #[test]
    fn weak_tokens_are_refused_and_strong_ones_pass() {
        for weak in [
            "password123",
            "tok",
            "trace-test",
            "0123456789abcdef0123456789abcde",
            "Abcdefghijklmnopqrst1",
            "",
        ] {
            let why = weak_token(weak).unwrap_or_else(|| panic!("{weak:?} passed"));
            assert!(
                why.contains("128")
                    && why.contains(WEAK_TOKEN_VAR)
                    && why.contains("openssl rand -hex 32"),
                "{why}"
            );
        }
        let why = weak_token("password123").unwrap();
        assert!(!why.contains("password"), "the token is not shown: {why}");
        assert!(
            why.contains("11 characters from an alphabet of 36"),
            "{why}"
        );
        assert!(why.contains("at least 25 such characters"), "{why}");
        for strong in [
            // ddprun's own: 32 hex digits of a random u128, a key's 64.
            "0123456789abcdef0123456789abcdef".to_string(),
            crate::auth::Key::from_token("x").rank_key(1).to_token(),
            // openssl rand -base64 16 / 32.
            "q3vT8yZ0m1Lk5sP2xWc7Hg==".to_string(),
            "u7Jk2m9QpL3xV8cR1tY6wZ4nB0sD5fG7hK2jM9pQ3aE=".to_string(),
            // The test kit's (ddp_testkit::job_token).
            "test-12345-0-17d2c3b4a5968778".to_string(),
        ] {
            assert_eq!(weak_token(&strong), None, "{strong} refused");
        }
        assert_eq!(token_bits("ffff"), 16.0);
    }

    #[test]
    fn loopback_and_own_addresses_are_this_host() {
        assert!(is_this_host("127.0.0.1"));
        assert!(is_this_host("localhost"));
        assert!(!is_this_host("192.0.2.1"), "TEST-NET-1 is nobody's");
        assert!(!is_this_host("no-such-host.invalid"));
    }
}
