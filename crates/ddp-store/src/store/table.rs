//! The keys and values the store's server holds, and the limits that keep one client — even
//! one holding the job's key, or one rank's — from exhausting the host or another rank's room.
//!
//! Each limit is sized from the largest legitimate use, with room to spare:
//!
//! | limit | value | largest legitimate use |
//! |---|---|---|
//! | [`MAX_KEY_BYTES`] | 512 B | `ddp/launchers/gone/{launcher id}`, about 60 B |
//! | [`MAX_VALUE_BYTES`] | 1 MiB | the launchers' rendezvous state, about 200 B per node |
//! | [`MAX_TOTAL_BYTES`] | 64 MiB of entries' costs ([`entry_cost`]) | a 4096-rank job stores well under 4 MiB |
//! | [`MAX_KEYS`] | 262144 | a 4096-rank job with `DDP_TRACE`: under 40000 keys |
//! | [`RESERVED_KEYS`], [`RESERVED_BYTES`] | 16 keys, 16 KiB of the above | the forward-only counters ([`keys::forward_only`]): one key of under 250 B |
//! | a rank's share ([`Table::share`]) | the rest divided by the world size, at most 4 ways | rank 0 of a 4096-rank job with `DDP_TRACE`: about 33000 keys, 8 MiB |
//! | a rank's own keys (no [`keys::owner`]) | three quarters of its share | a handful per rank and restart |
//! | [`MAX_KEYS_PER_CONNECTION`] | 16384 | rank 0 answers 8 clock rounds per rank with `DDP_TRACE`: 8192 keys at 1024 ranks |
//! | [`MAX_WAIT_KEYS`] | 65536 | every rank waits for every rank's address: one key per rank |
//! | [`MAX_WAITING_KEYS`] | 262144 | every connection waiting at once stays far below |
//!
//! In a store whose ranks hold keys of their own ([`super::StoreServer::bind_per_rank`]) every
//! entry is charged to the rank that wrote it, and no rank may hold more than its share: so a
//! rank's key that fills its share leaves every other rank's room, and the library's own
//! entries of every rank, untouched. Within a share a quarter is kept for the library's entries
//! (those [`keys::owner`] gives an owner: a rank's address, NCCL's keys, the trace clock's):
//! a program's own keys cannot crowd out its rank's next address. The forward-only counters
//! (the process group's generation) are charged to no rank and live in room of their own.
//!
//! Errors name a key only through [`shown`]: a reply never echoes unbounded input.

use std::collections::{HashMap, HashSet};

use super::keys;
use super::message::Reply;

/// Longest key: burn-ddp's longest (`ddp/launchers/…`, `ddp/pg/addr/{rank}`, the NCCL and
/// trace keys) are under 100 bytes.
pub(super) const MAX_KEY_BYTES: usize = 512;
/// Largest value: the largest burn-ddp writes is the launchers' state, about 200 bytes a node
/// (a few hundred nodes stay under 100 KiB); a rank's address is under 200 bytes.
pub(super) const MAX_VALUE_BYTES: usize = 1 << 20;
/// Most bytes the store's entries may cost in all ([`entry_cost`]): 64 values of the largest
/// size, some thousand times what a job of a few thousand ranks writes. What the table holds
/// in memory stays within it (a test fills the store and reads the process's memory).
pub(super) const MAX_TOTAL_BYTES: usize = 64 << 20;
/// Most keys the store holds: what a job of 4096 ranks with timelines writes, six times over.
pub(super) const MAX_KEYS: usize = 1 << 18;
/// Keys of [`MAX_KEYS`] kept for the forward-only counters ([`keys::forward_only`]; one today):
/// no other entry may use them, so a store filled to its limit still takes the next generation.
pub(super) const RESERVED_KEYS: usize = 16;
/// Bytes of [`MAX_TOTAL_BYTES`] kept for the forward-only counters: 16 of them at their
/// largest (a key under 100 bytes, a count of at most 20 digits) cost under 6 KiB.
pub(super) const RESERVED_BYTES: usize = 16 << 10;
/// The most parts the store's room is split into for the ranks' shares: a rank's share is the
/// room divided by the world size, but never less than a quarter of it, which holds rank 0's
/// entries of a 4096-rank job with `DDP_TRACE` (its clock's answers: 8 per rank). One rank's
/// key can thus hold at most a quarter of the store, and in a job of up to 4 ranks the shares
/// together are the room: every rank's share is its own whatever the others write.
pub(super) const SHARE_PARTS: usize = 4;
/// What an entry costs the server besides its key's and value's bytes: its slot in the map, the
/// key's and the value's own allocations (headers and the allocator's rounding) and the copy of
/// the key a sealed entry keeps. Measured: a million 5-byte keys with 8-byte values grew a
/// server by 132 MiB, 138 bytes an entry; the entry's payer adds 8.
pub(super) const ENTRY_OVERHEAD: usize = 160;

/// What holding `value` at `key` costs, in bytes (the key counted twice: a sealed entry keeps
/// a copy of it).
pub(super) fn entry_cost(key: &str, value: &[u8]) -> usize {
    2 * key.len() + value.len() + ENTRY_OVERHEAD
}
/// Most keys one connection may create: a rank creates a handful per rendezvous, NCCL group
/// and clock sync; a launcher one per round.
pub(super) const MAX_KEYS_PER_CONNECTION: usize = 16384;
/// Most keys one `wait` may name: a rank waits for every rank's address (the world size).
pub(super) const MAX_WAIT_KEYS: usize = 65536;
/// Most keys all waiting requests together may name.
pub(super) const MAX_WAITING_KEYS: usize = 4 * MAX_WAIT_KEYS;

/// A key as error messages show it: at most 48 characters.
pub(super) fn shown(key: &str) -> String {
    const SHOWN: usize = 48;
    match key.char_indices().nth(SHOWN) {
        None => format!("{key:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &key[..cut], key.len()),
    }
}

/// What one connection has used of the table, and who it is.
#[derive(Debug, Default)]
pub(super) struct ConnectionUse {
    /// Keys this connection created.
    created: usize,
    /// The rank it proved to be (with per-rank keys): its entries are charged to that rank.
    rank: Option<u32>,
}

impl ConnectionUse {
    /// A connection of `rank` (with per-rank keys; `None` otherwise).
    pub(super) fn of(rank: Option<u32>) -> Self {
        ConnectionUse { created: 0, rank }
    }
}

/// Keys and the bytes they cost ([`entry_cost`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Use {
    /// Keys.
    pub(super) keys: usize,
    /// Their cost in bytes.
    pub(super) bytes: usize,
}

impl Use {
    fn add(&mut self, cost: usize) {
        self.keys += 1;
        self.bytes += cost;
    }

    fn remove(&mut self, cost: usize) {
        self.keys -= 1;
        self.bytes -= cost;
    }

    /// A quarter less: what a rank's own keys may use of its share.
    fn three_quarters(self) -> Use {
        Use {
            keys: self.keys - self.keys / 4,
            bytes: self.bytes - self.bytes / 4,
        }
    }

    fn within(self, limit: Use) -> bool {
        self.keys <= limit.keys && self.bytes <= limit.bytes
    }
}

/// Who an entry is charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Payer {
    /// A store without per-rank keys: the job-wide limits alone.
    Job,
    /// Rank `rank`, which wrote it; `library`: a key [`keys::owner`] gives an owner.
    Rank { rank: u32, library: bool },
    /// A forward-only counter, in the room kept for them.
    Reserved,
}

/// One value and who pays for it.
struct Entry {
    value: Vec<u8>,
    payer: Payer,
}

/// What one rank's entries use.
#[derive(Debug, Default, Clone, Copy)]
struct Account {
    /// All of its entries.
    all: Use,
    /// Those of its keys no rank owns (its program's, and counters like arrivals).
    own: Use,
}

/// The store's keys and values.
#[derive(Default)]
pub(super) struct Table {
    map: HashMap<String, Entry>,
    /// Keys set by `set_once`: nothing may change them afterwards.
    sealed: HashSet<String>,
    /// What the entries held cost ([`entry_cost`]).
    bytes: usize,
    /// What the forward-only counters use of that.
    reserved: Use,
    /// Whether entries are charged to the rank that writes them (a per-rank store).
    per_rank: bool,
    /// The job's world size, once the server knows it: it sizes the ranks' shares.
    world: Option<usize>,
    /// What each rank's entries use (a per-rank store).
    accounts: HashMap<u32, Account>,
    /// Keys named by the requests waiting now.
    pub(super) waiting_keys: usize,
    /// The server is stopping: waits end.
    pub(super) shutdown: bool,
}

fn refuse(msg: String) -> Reply {
    Reply::Error(msg)
}

/// The refusal of a change to a forward-only counter other than its one step.
fn not_a_step(key: &str, what: &str) -> Reply {
    refuse(format!(
        "{} only moves forward: the store accepts a compare-and-set from its current value \
         (absent: 0) to that value plus one, in decimal, and nothing else; {what} is refused",
        shown(key)
    ))
}

impl Table {
    /// A table whose entries are charged to the rank that writes them, each rank held to its
    /// share ([`Table::share`]).
    pub(super) fn per_rank() -> Self {
        Table {
            per_rank: true,
            ..Table::default()
        }
    }

    /// Sets the job's world size, which sizes each rank's share.
    pub(super) fn set_world(&mut self, world: usize) {
        self.world = Some(world.max(1));
    }

    /// What one rank's entries may use in all: the store's room (less what is kept for the
    /// forward-only counters) divided by the world size, or by [`SHARE_PARTS`] in a larger job
    /// or one whose size the server was not told.
    pub(super) fn share(&self) -> Use {
        let parts = self.world.unwrap_or(SHARE_PARTS).clamp(1, SHARE_PARTS);
        Use {
            keys: (MAX_KEYS - RESERVED_KEYS) / parts,
            bytes: (MAX_TOTAL_BYTES - RESERVED_BYTES) / parts,
        }
    }

    /// The value of `key`, if it exists.
    pub(super) fn get(&self, key: &str) -> Option<&Vec<u8>> {
        self.map.get(key).map(|e| &e.value)
    }

    /// Whether `key` exists.
    pub(super) fn contains(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// How many keys the table holds, and what they cost ([`entry_cost`]).
    pub(super) fn usage(&self) -> (usize, usize) {
        (self.map.len(), self.bytes)
    }

    /// What rank `rank`'s entries use of its share.
    pub(super) fn rank_usage(&self, rank: u32) -> Use {
        self.accounts.get(&rank).map(|a| a.all).unwrap_or_default()
    }

    /// Checks a key's length (before any use of it).
    pub(super) fn check_key(key: &str) -> Result<(), Reply> {
        if key.len() > MAX_KEY_BYTES {
            return Err(refuse(format!(
                "a key of {} bytes is longer than the store's limit of {MAX_KEY_BYTES}",
                key.len()
            )));
        }
        Ok(())
    }

    /// Checks that `key` may change (it was not set by `set_once`).
    fn check_mutable(&self, key: &str) -> Result<(), Reply> {
        if self.sealed.contains(key) {
            return Err(refuse(format!(
                "key {} was set once and cannot change",
                shown(key)
            )));
        }
        Ok(())
    }

    /// Who pays for `key` written by `user`.
    fn payer(&self, key: &str, user: &ConnectionUse) -> Payer {
        if keys::forward_only(key) {
            return Payer::Reserved;
        }
        match (self.per_rank, user.rank) {
            (true, Some(rank)) => Payer::Rank {
                rank,
                library: keys::owner(key).is_some(),
            },
            _ => Payer::Job,
        }
    }

    /// Checks that rank `rank` may hold an entry of `cost` bytes (replacing one of `old`, with
    /// its payer, if the key exists) within its share.
    fn check_share(
        &self,
        rank: u32,
        library: bool,
        old: Option<(usize, Payer)>,
        cost: usize,
    ) -> Result<(), Reply> {
        let account = self.accounts.get(&rank).copied().unwrap_or_default();
        // An entry this rank already pays for is replaced; another's becomes this rank's.
        let replaced = match old {
            Some((c, Payer::Rank { rank: r, .. })) if r == rank => Some(c),
            _ => None,
        };
        let after = |used: Use| match replaced {
            Some(c) => Use {
                keys: used.keys,
                bytes: used.bytes - c + cost,
            },
            None => Use {
                keys: used.keys + 1,
                bytes: used.bytes + cost,
            },
        };
        // A change that does not grow what the rank holds is always taken.
        if replaced.is_some_and(|c| cost <= c) {
            return Ok(());
        }
        let share = self.share();
        if !after(account.all).within(share) {
            return Err(refuse(format!(
                "rank {rank} holds its share of the store ({} keys, {} KiB at most: the store's \
                 room split among the job's ranks, at most {SHARE_PARTS} ways); its entries \
                 are refused, every other rank's are not",
                share.keys,
                share.bytes >> 10
            )));
        }
        let own = share.three_quarters();
        if !library && !after(account.own).within(own) {
            return Err(refuse(format!(
                "rank {rank}'s own keys hold three quarters of its share of the store ({} keys, \
                 {} KiB): the rest is kept for the library's entries of the rank (its address, \
                 NCCL's and the trace clock's keys)",
                own.keys,
                own.bytes >> 10
            )));
        }
        Ok(())
    }

    /// Takes an entry of `cost` off `payer`'s use.
    fn uncharge(&mut self, payer: Payer, cost: usize) {
        match payer {
            Payer::Job => {}
            Payer::Reserved => self.reserved.remove(cost),
            Payer::Rank { rank, library } => {
                if let Some(a) = self.accounts.get_mut(&rank) {
                    a.all.remove(cost);
                    if !library {
                        a.own.remove(cost);
                    }
                }
            }
        }
    }

    /// Charges an entry of `cost` to `payer`.
    fn charge(&mut self, payer: Payer, cost: usize) {
        match payer {
            Payer::Job => {}
            Payer::Reserved => self.reserved.add(cost),
            Payer::Rank { rank, library } => {
                let a = self.accounts.entry(rank).or_default();
                a.all.add(cost);
                if !library {
                    a.own.add(cost);
                }
            }
        }
    }

    /// Stores `value` at `key` within the limits, counting a new key against `user` and
    /// charging the entry to its payer.
    fn put(&mut self, key: String, value: Vec<u8>, user: &mut ConnectionUse) -> Result<(), Reply> {
        Self::check_key(&key)?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(refuse(format!(
                "a value of {} bytes is larger than the store's limit of {MAX_VALUE_BYTES}",
                value.len()
            )));
        }
        let payer = self.payer(&key, user);
        let cost = entry_cost(&key, &value);
        let old = self
            .map
            .get(&key)
            .map(|e| (entry_cost(&key, &e.value), e.payer));
        if old.is_none() && user.created >= MAX_KEYS_PER_CONNECTION {
            return Err(refuse(format!(
                "this connection created {MAX_KEYS_PER_CONNECTION} keys, the most one may"
            )));
        }
        // The forward-only counters have room of their own; every other entry shares the rest.
        let (room, used) = if payer == Payer::Reserved {
            (
                Use {
                    keys: MAX_KEYS,
                    bytes: MAX_TOTAL_BYTES,
                },
                Use {
                    keys: self.map.len(),
                    bytes: self.bytes,
                },
            )
        } else {
            (
                Use {
                    keys: MAX_KEYS - RESERVED_KEYS,
                    bytes: MAX_TOTAL_BYTES - RESERVED_BYTES,
                },
                Use {
                    keys: self.map.len() - self.reserved.keys,
                    bytes: self.bytes - self.reserved.bytes,
                },
            )
        };
        if old.is_none() && used.keys >= room.keys {
            return Err(refuse(format!(
                "the store holds its limit of {} keys ({MAX_KEYS} less {RESERVED_KEYS} kept \
                 for its forward-only counters)",
                room.keys
            )));
        }
        let old_cost = old.map_or(0, |(c, _)| c);
        if cost > old_cost && used.bytes - old_cost + cost > room.bytes {
            return Err(refuse(format!(
                "the store holds its limit of {} MiB of keys and values",
                MAX_TOTAL_BYTES >> 20
            )));
        }
        if let Payer::Rank { rank, library } = payer {
            self.check_share(rank, library, old, cost)?;
        }
        if let Some((c, p)) = old {
            self.uncharge(p, c);
        } else {
            user.created += 1;
        }
        self.charge(payer, cost);
        self.bytes = self.bytes - old_cost + cost;
        self.map.insert(key, Entry { value, payer });
        Ok(())
    }

    /// `set`: overwrites a key that was not set once (never a forward-only counter).
    pub(super) fn set(&mut self, key: String, value: Vec<u8>, user: &mut ConnectionUse) -> Reply {
        if keys::forward_only(&key) {
            return not_a_step(&key, "a set");
        }
        match self
            .check_mutable(&key)
            .and_then(|()| self.put(key, value, user))
        {
            Ok(()) => Reply::Ok,
            Err(reply) => reply,
        }
    }

    /// `set_once`: sets an absent key and seals it; else answers what it holds (never a
    /// forward-only counter).
    pub(super) fn set_once(
        &mut self,
        key: String,
        value: Vec<u8>,
        user: &mut ConnectionUse,
    ) -> Reply {
        if let Err(reply) = Self::check_key(&key) {
            return reply;
        }
        if keys::forward_only(&key) {
            return not_a_step(&key, "a set_once");
        }
        if let Some(current) = self.map.get(&key) {
            return Reply::Value(current.value.clone());
        }
        match self.put(key.clone(), value, user) {
            Ok(()) => {
                self.sealed.insert(key);
                Reply::Ok
            }
            Err(reply) => reply,
        }
    }

    /// `add`: adds to a counter (missing = 0); never a forward-only counter (a decimal count,
    /// not `add`'s 8 bytes).
    pub(super) fn add(&mut self, key: String, delta: i64, user: &mut ConnectionUse) -> Reply {
        if let Err(reply) = Self::check_key(&key).and_then(|()| self.check_mutable(&key)) {
            return reply;
        }
        if keys::forward_only(&key) {
            return not_a_step(&key, "an add");
        }
        let current = match self.map.get(&key) {
            None => 0,
            Some(e) => match <[u8; 8]>::try_from(e.value.as_slice()) {
                Ok(b) => i64::from_le_bytes(b),
                Err(_) => {
                    return refuse(format!(
                        "key {} holds a {}-byte value, not a counter made by add",
                        shown(&key),
                        e.value.len()
                    ));
                }
            },
        };
        let new = current.wrapping_add(delta);
        match self.put(key, new.to_le_bytes().to_vec(), user) {
            Ok(()) => Reply::Int(new),
            Err(reply) => reply,
        }
    }

    /// `compare_set`: replaces the value if it is `expected`; else answers what it holds. On a
    /// forward-only counter, only a step by one ([`keys::forward_step`]).
    pub(super) fn compare_set(
        &mut self,
        key: String,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
        user: &mut ConnectionUse,
    ) -> Reply {
        if let Err(reply) = Self::check_key(&key).and_then(|()| self.check_mutable(&key)) {
            return reply;
        }
        if keys::forward_only(&key) && !keys::forward_step(expected.as_deref(), &desired) {
            return not_a_step(&key, "this compare-and-set, which does not step it by one,");
        }
        let current = self.map.get(&key).map(|e| &e.value);
        if current.map(Vec::as_slice) != expected.as_deref() {
            return match current {
                Some(v) => Reply::Value(v.clone()),
                None => Reply::Missing,
            };
        }
        match self.put(key, desired, user) {
            Ok(()) => Reply::Ok,
            Err(reply) => reply,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_refuse_without_echoing_and_sealed_keys_never_change() {
        let mut t = Table::default();
        let mut me = ConnectionUse::default();
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        match t.set(long.clone(), vec![1], &mut me) {
            Reply::Error(m) => assert!(!m.contains(&long[..60]) && m.len() < 200, "{m}"),
            other => panic!("{other:?}"),
        }
        match t.set("big".into(), vec![0; MAX_VALUE_BYTES + 1], &mut me) {
            Reply::Error(m) => assert!(m.contains("limit"), "{m}"),
            other => panic!("{other:?}"),
        }
        let key = "x".repeat(MAX_KEY_BYTES);
        assert_eq!(t.set(key.clone(), vec![1, 2], &mut me), Reply::Ok);
        match t.add(key, 1, &mut me) {
            Reply::Error(m) => assert!(m.len() < 200 && m.contains("512 bytes"), "{m}"),
            other => panic!("{other:?}"),
        }

        assert_eq!(t.set_once("addr/1".into(), vec![1], &mut me), Reply::Ok);
        assert_eq!(
            t.set_once("addr/1".into(), vec![2], &mut me),
            Reply::Value(vec![1]),
            "the first value stays"
        );
        assert!(matches!(
            t.set("addr/1".into(), vec![2], &mut me),
            Reply::Error(_)
        ));
        assert!(matches!(
            t.add("addr/1".into(), 1, &mut me),
            Reply::Error(_)
        ));
        assert!(matches!(
            t.compare_set("addr/1".into(), Some(vec![1]), vec![2], &mut me),
            Reply::Error(_)
        ));
        assert_eq!(t.get("addr/1"), Some(&vec![1]));
    }

    #[test]
    fn a_connection_creates_a_bounded_number_of_keys_and_the_total_is_bounded() {
        let mut t = Table::default();
        let mut me = ConnectionUse::default();
        for i in 0..MAX_KEYS_PER_CONNECTION {
            assert_eq!(t.add(format!("c/{i}"), 1, &mut me), Reply::Int(1));
        }
        assert!(matches!(
            t.set("one more".into(), vec![], &mut me),
            Reply::Error(_)
        ));
        // Changing an existing key is still allowed.
        assert_eq!(t.add("c/0".into(), 1, &mut me), Reply::Int(2));

        let mut other = ConnectionUse::default();
        let mut refused = None;
        for i in 0..(MAX_TOTAL_BYTES / MAX_VALUE_BYTES + 2) {
            if let Reply::Error(m) = t.set(format!("v/{i}"), vec![0; MAX_VALUE_BYTES], &mut other) {
                refused = Some((i, m));
                break;
            }
        }
        let (i, m) = refused.expect("the total quota refuses at some point");
        assert!(i <= MAX_TOTAL_BYTES / MAX_VALUE_BYTES, "{i}");
        assert!(m.contains("64 MiB"), "{m}");
    }

    /// Small entries hit the cap on keys, and every entry is charged its overhead: the
    /// quota's bytes bound what the table holds, not only the bytes of keys and values.
    #[test]
    fn small_entries_are_charged_their_cost_and_the_keys_are_capped() {
        let mut t = Table::default();
        let mut refused = None;
        'fill: for c in 0.. {
            let mut conn = ConnectionUse::default();
            for i in 0..MAX_KEYS_PER_CONNECTION {
                if let Reply::Error(m) = t.add(format!("{c}/{i}"), 1, &mut conn) {
                    refused = Some(m);
                    break 'fill;
                }
            }
        }
        let m = refused.unwrap();
        assert!(m.contains("262128 keys"), "{m}");
        let (keys, bytes) = t.usage();
        assert_eq!(keys, MAX_KEYS - RESERVED_KEYS);
        assert!(bytes >= keys * ENTRY_OVERHEAD, "{bytes}");
        // The room kept for the forward-only counters is still there.
        let generation = format!("{}/{}", keys::PROCESS_GROUP, keys::MESH_GENERATION);
        let mut late = ConnectionUse::default();
        assert_eq!(
            t.compare_set(generation.clone(), None, b"1".to_vec(), &mut late),
            Reply::Ok
        );
        assert_eq!(
            t.compare_set(generation, Some(b"1".to_vec()), b"2".to_vec(), &mut late),
            Reply::Ok
        );
    }

    /// The shares of a per-rank store: a rank that fills its share is refused, another rank
    /// still writes, and a rank's own keys leave a quarter of its share to the library's.
    #[test]
    fn each_rank_is_held_to_its_share_and_its_library_entries_keep_a_quarter() {
        let mut t = Table::per_rank();
        t.set_world(8);
        let share = t.share();
        assert_eq!(share.keys, (MAX_KEYS - RESERVED_KEYS) / SHARE_PARTS);
        let mut one = ConnectionUse::of(Some(1));
        // Rank 1's own keys, 64 KiB values: refused at three quarters of its share.
        let value = vec![7u8; 64 << 10];
        let mut refused = None;
        for i in 0.. {
            if let Reply::Error(m) = t.set(format!("junk/{i}"), value.clone(), &mut one) {
                refused = Some(m);
                break;
            }
        }
        let m = refused.unwrap();
        assert!(m.contains("rank 1's own keys hold three quarters"), "{m}");
        let held = t.rank_usage(1);
        assert!(held.bytes <= share.bytes - share.bytes / 4, "{held:?}");
        assert!(held.bytes > share.bytes / 2, "{held:?}");
        // Its library entries still fit (its next address), up to the whole share.
        assert_eq!(
            t.set_once("ddp/pg/7/addr/1".into(), vec![1; 200], &mut one),
            Reply::Ok
        );
        let mut refused = None;
        for g in 8.. {
            if let Reply::Error(m) =
                t.set_once(format!("ddp/pg/{g}/addr/1"), value.clone(), &mut one)
            {
                refused = Some(m);
                break;
            }
        }
        let m = refused.unwrap();
        assert!(m.contains("rank 1 holds its share"), "{m}");
        assert!(t.rank_usage(1).within(share));
        // Replacing its own entry with a smaller one is taken.
        assert_eq!(t.set("junk/0".into(), vec![1], &mut one), Reply::Ok);
        // Another rank's writes, library and own, are untouched.
        let mut two = ConnectionUse::of(Some(2));
        assert_eq!(
            t.set_once("ddp/pg/7/addr/2".into(), vec![2; 200], &mut two),
            Reply::Ok
        );
        assert_eq!(t.add("two/counter".into(), 1, &mut two), Reply::Int(1));
        // Taking over rank 1's entry moves its charge to rank 2.
        let before = t.rank_usage(1);
        assert_eq!(t.set("junk/1".into(), vec![3], &mut two), Reply::Ok);
        assert_eq!(t.rank_usage(1).keys, before.keys - 1);
        assert_eq!(t.rank_usage(2).keys, 3);
    }

    /// With a world of 2 the two shares are the whole room: one rank filling its share leaves
    /// the other its own, to the byte.
    #[test]
    fn in_a_small_job_the_shares_together_are_the_store() {
        let mut t = Table::per_rank();
        t.set_world(2);
        let share = t.share();
        assert_eq!(2 * share.bytes, MAX_TOTAL_BYTES - RESERVED_BYTES);
        let big = vec![0u8; MAX_VALUE_BYTES];
        for rank in [1u32, 0] {
            let mut conn = ConnectionUse::of(Some(rank));
            let mut stored = 0;
            // The library's entries (rank-owned keys) may use the whole share.
            while let Reply::Ok = t.set_once(
                format!("x/{rank}/{stored}/addr/{rank}"),
                big.clone(),
                &mut conn,
            ) {
                stored += 1;
            }
            assert!(stored >= 31, "rank {rank} stored {stored} MiB");
        }
        let (_, bytes) = t.usage();
        assert!(bytes <= MAX_TOTAL_BYTES - RESERVED_BYTES, "{bytes}");
    }

    /// The process group's generation takes a step by one with a compare-and-set, and no other
    /// change, in any store.
    #[test]
    fn the_generation_counter_takes_only_a_step_by_one() {
        let generation = format!("{}/{}", keys::PROCESS_GROUP, keys::MESH_GENERATION);
        for mut t in [Table::default(), Table::per_rank()] {
            let mut me = ConnectionUse::of(Some(3));
            let refused = |r: Reply| match r {
                Reply::Error(m) => assert!(m.contains("only moves forward"), "{m}"),
                other => panic!("{other:?}"),
            };
            refused(t.set(generation.clone(), b"0".to_vec(), &mut me));
            refused(t.set_once(generation.clone(), b"1".to_vec(), &mut me));
            refused(t.add(generation.clone(), 1, &mut me));
            refused(t.compare_set(generation.clone(), None, b"0".to_vec(), &mut me));
            refused(t.compare_set(generation.clone(), None, b"2".to_vec(), &mut me));
            assert_eq!(
                t.compare_set(generation.clone(), None, b"1".to_vec(), &mut me),
                Reply::Ok
            );
            // A step from a value it does not hold is no change: it is told what is there.
            assert_eq!(
                t.compare_set(
                    generation.clone(),
                    Some(b"4".to_vec()),
                    b"5".to_vec(),
                    &mut me
                ),
                Reply::Value(b"1".to_vec())
            );
            refused(t.compare_set(
                generation.clone(),
                Some(b"1".to_vec()),
                b"0".to_vec(),
                &mut me,
            ));
            refused(t.compare_set(
                generation.clone(),
                Some(b"1".to_vec()),
                b"1".to_vec(),
                &mut me,
            ));
            assert_eq!(
                t.compare_set(
                    generation.clone(),
                    Some(b"1".to_vec()),
                    b"2".to_vec(),
                    &mut me
                ),
                Reply::Ok
            );
            assert_eq!(t.get(&generation), Some(&b"2".to_vec()));
            // Charged to no rank.
            assert_eq!(t.rank_usage(3), Use::default());
        }
    }

    #[test]
    fn shown_keys_are_bounded() {
        assert_eq!(shown("a/b"), "\"a/b\"");
        let s = shown(&"é".repeat(1000));
        assert!(s.chars().count() < 80 && s.contains("2000 bytes"), "{s}");
    }
}
