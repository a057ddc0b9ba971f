//! The keys and values the store's server holds, and the limits that keep one client — even
//! one holding the job's key — from exhausting the host.
//!
//! Each limit is sized from the largest legitimate use, with room to spare:
//!
//! | limit | value | largest legitimate use |
//! |---|---|---|
//! | [`MAX_KEY_BYTES`] | 512 B | `ddp/launchers/gone/{launcher id}`, about 60 B |
//! | [`MAX_VALUE_BYTES`] | 1 MiB | the launchers' rendezvous state, about 200 B per node |
//! | [`MAX_TOTAL_BYTES`] | 64 MiB of entries' costs ([`entry_cost`]) | a 4096-rank job stores well under 4 MiB |
//! | [`MAX_KEYS`] | 262144 | a 4096-rank job with `DDP_TRACE`: under 40000 keys |
//! | [`MAX_KEYS_PER_CONNECTION`] | 16384 | rank 0 answers 8 clock rounds per rank with `DDP_TRACE`: 8192 keys at 1024 ranks |
//! | [`MAX_WAIT_KEYS`] | 65536 | every rank waits for every rank's address: one key per rank |
//! | [`MAX_WAITING_KEYS`] | 262144 | every connection waiting at once stays far below |
//!
//! Errors name a key only through [`shown`]: a reply never echoes unbounded input.

use std::collections::{HashMap, HashSet};

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
/// What an entry costs the server besides its key's and value's bytes: its slot in the map, the
/// key's and the value's own allocations (headers and the allocator's rounding) and the copy of
/// the key a sealed entry keeps. Measured: a million 5-byte keys with 8-byte values grew a
/// server by 132 MiB, 138 bytes an entry.
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

/// What one connection has used of the table.
#[derive(Debug, Default)]
pub(super) struct ConnectionUse {
    /// Keys this connection created.
    created: usize,
}

/// The store's keys and values.
#[derive(Default)]
pub(super) struct Table {
    map: HashMap<String, Vec<u8>>,
    /// Keys set by `set_once`: nothing may change them afterwards.
    sealed: HashSet<String>,
    /// What the entries held cost ([`entry_cost`]).
    bytes: usize,
    /// Keys named by the requests waiting now.
    pub(super) waiting_keys: usize,
    /// The server is stopping: waits end.
    pub(super) shutdown: bool,
}

fn refuse(msg: String) -> Reply {
    Reply::Error(msg)
}

impl Table {
    /// The value of `key`, if it exists.
    pub(super) fn get(&self, key: &str) -> Option<&Vec<u8>> {
        self.map.get(key)
    }

    /// Whether `key` exists.
    pub(super) fn contains(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// How many keys the table holds, and what they cost ([`entry_cost`]).
    pub(super) fn usage(&self) -> (usize, usize) {
        (self.map.len(), self.bytes)
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

    /// Stores `value` at `key` within the limits, counting a new key against `user`.
    fn put(&mut self, key: String, value: Vec<u8>, user: &mut ConnectionUse) -> Result<(), Reply> {
        Self::check_key(&key)?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(refuse(format!(
                "a value of {} bytes is larger than the store's limit of {MAX_VALUE_BYTES}",
                value.len()
            )));
        }
        let old = self.map.get(&key).map(|v| entry_cost(&key, v));
        if old.is_none() && user.created >= MAX_KEYS_PER_CONNECTION {
            return Err(refuse(format!(
                "this connection created {MAX_KEYS_PER_CONNECTION} keys, the most one may"
            )));
        }
        if old.is_none() && self.map.len() >= MAX_KEYS {
            return Err(refuse(format!(
                "the store holds its limit of {MAX_KEYS} keys"
            )));
        }
        let after = self.bytes - old.unwrap_or(0) + entry_cost(&key, &value);
        if after > MAX_TOTAL_BYTES {
            return Err(refuse(format!(
                "the store holds its limit of {} MiB of keys and values",
                MAX_TOTAL_BYTES >> 20
            )));
        }
        if old.is_none() {
            user.created += 1;
        }
        self.bytes = after;
        self.map.insert(key, value);
        Ok(())
    }

    /// `set`: overwrites a key that was not set once.
    pub(super) fn set(&mut self, key: String, value: Vec<u8>, user: &mut ConnectionUse) -> Reply {
        match self
            .check_mutable(&key)
            .and_then(|()| self.put(key, value, user))
        {
            Ok(()) => Reply::Ok,
            Err(reply) => reply,
        }
    }

    /// `set_once`: sets an absent key and seals it; else answers what it holds.
    pub(super) fn set_once(
        &mut self,
        key: String,
        value: Vec<u8>,
        user: &mut ConnectionUse,
    ) -> Reply {
        if let Err(reply) = Self::check_key(&key) {
            return reply;
        }
        if let Some(current) = self.map.get(&key) {
            return Reply::Value(current.clone());
        }
        match self.put(key.clone(), value, user) {
            Ok(()) => {
                self.sealed.insert(key);
                Reply::Ok
            }
            Err(reply) => reply,
        }
    }

    /// `add`: adds to a counter (missing = 0).
    pub(super) fn add(&mut self, key: String, delta: i64, user: &mut ConnectionUse) -> Reply {
        if let Err(reply) = Self::check_key(&key).and_then(|()| self.check_mutable(&key)) {
            return reply;
        }
        let current = match self.map.get(&key) {
            None => 0,
            Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                Ok(b) => i64::from_le_bytes(b),
                Err(_) => {
                    return refuse(format!(
                        "key {} holds a {}-byte value, not a counter made by add",
                        shown(&key),
                        v.len()
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

    /// `compare_set`: replaces the value if it is `expected`; else answers what it holds.
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
        let current = self.map.get(&key);
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
        assert!(m.contains("262144 keys"), "{m}");
        let (keys, bytes) = t.usage();
        assert_eq!(keys, MAX_KEYS);
        assert!(bytes >= keys * ENTRY_OVERHEAD, "{bytes}");
    }

    #[test]
    fn shown_keys_are_bounded() {
        assert_eq!(shown("a/b"), "\"a/b\"");
        let s = shown(&"é".repeat(1000));
        assert!(s.chars().count() < 80 && s.contains("2000 bytes"), "{s}");
    }
}
