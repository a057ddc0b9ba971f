//! The store's messages: typed [`Request`]s (client → server) and [`Reply`]s (server →
//! client), encoded with the crate's one codec ([`crate::wire`]) and sent one per frame.
//!
//! The first request of every connection is [`Request::Hello`]: a magic, the protocol
//! [`VERSION`], the rank the client claims to be (with per-rank keys) and its message of a
//! password-authenticated key exchange. A server with a key answers [`Reply::Challenge`] (its
//! own message and its confirmation of the session key), the client answers
//! [`Request::Proof`] (its confirmation), and the server accepts with [`Reply::Ok`] or
//! refuses. Neither the token nor anything to test a guess of it against crosses the wire
//! ([`crate::auth`]).

use std::time::Duration;

use crate::wire::{Malformed, Parsed, Reader, Writer};

/// Magic at the start of every handshake ("DDPS").
pub(crate) const MAGIC: [u8; 4] = *b"DDPS";
/// Protocol version; bumped on incompatible changes.
pub(crate) const VERSION: u8 = 5;

/// A request from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// The handshake: the client's protocol version, the rank it claims to be (`None`: a
    /// client of a job whose processes share one key) and its key exchange message (empty: the
    /// client holds no key).
    Hello {
        version: u8,
        rank: Option<u32>,
        exchange: Vec<u8>,
    },
    /// The client's confirmation of the session key, answering [`Reply::Challenge`].
    Proof { mac: Vec<u8> },
    /// Set `key` to `value`.
    Set { key: String, value: Vec<u8> },
    /// Wait up to `timeout` for `key` and return its value.
    Get { key: String, timeout: Duration },
    /// The value of `key` if it exists now.
    TryGet { key: String },
    /// Add `delta` to the counter at `key`.
    Add { key: String, delta: i64 },
    /// Wait up to `timeout` until all `keys` exist.
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
    /// Set `key` to `desired` if its value is `expected` now (`None`: if it does not exist).
    CompareSet {
        key: String,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    },
    /// When this connection ends, however it ends, add 1 to the counter at `key`.
    OnClose { key: String },
    /// Set `key` to `value` if it does not exist, and never let it change afterwards.
    SetOnce { key: String, value: Vec<u8> },
}

/// A reply from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Done (handshake accepted, key set, keys present).
    Ok,
    /// The value asked for.
    Value(Vec<u8>),
    /// `try_get` of a key that does not exist.
    Missing,
    /// The counter's new value.
    Int(i64),
    /// A wait ran past its timeout; the key still missing.
    Timeout(String),
    /// The server's key exchange message and its confirmation of the session key, answering
    /// [`Request::Hello`].
    Challenge { exchange: Vec<u8>, mac: Vec<u8> },
    /// The handshake was refused, and why.
    Refused(String),
    /// The request failed, and why.
    Error(String),
}

const HELLO: u8 = 1;
const SET: u8 = 2;
const GET: u8 = 3;
const TRY_GET: u8 = 4;
const ADD: u8 = 5;
const WAIT: u8 = 6;
const COMPARE_SET: u8 = 7;
const ON_CLOSE: u8 = 8;
const PROOF: u8 = 9;
const SET_ONCE: u8 = 10;

const OK: u8 = 0x80;
const VALUE: u8 = 0x81;
const MISSING: u8 = 0x82;
const INT: u8 = 0x83;
const TIMEOUT: u8 = 0x84;
const REFUSED: u8 = 0x85;
const ERROR: u8 = 0x86;
const CHALLENGE: u8 = 0x87;

/// A hello's rank field when the client claims no rank.
const NO_RANK: u32 = u32::MAX;

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Request {
    /// The frame's payload.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let w = Writer::default();
        match self {
            Request::Hello {
                version,
                rank,
                exchange,
            } => w
                .u8(HELLO)
                .raw(&MAGIC)
                .u8(*version)
                .u32(rank.unwrap_or(NO_RANK))
                .bytes(exchange),
            Request::Proof { mac } => w.u8(PROOF).bytes(mac),
            Request::Set { key, value } => w.u8(SET).bytes(key.as_bytes()).bytes(value),
            Request::Get { key, timeout } => w.u8(GET).u64(micros(*timeout)).bytes(key.as_bytes()),
            Request::TryGet { key } => w.u8(TRY_GET).bytes(key.as_bytes()),
            Request::Add { key, delta } => w.u8(ADD).bytes(key.as_bytes()).i64(*delta),
            Request::Wait { keys, timeout } => {
                let mut w = w.u8(WAIT).u64(micros(*timeout)).u32(keys.len() as u32);
                for k in keys {
                    w = w.bytes(k.as_bytes());
                }
                w
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => w
                .u8(COMPARE_SET)
                .bytes(key.as_bytes())
                .u8(expected.is_some() as u8)
                .bytes(expected.as_deref().unwrap_or_default())
                .bytes(desired),
            Request::OnClose { key } => w.u8(ON_CLOSE).bytes(key.as_bytes()),
            Request::SetOnce { key, value } => w.u8(SET_ONCE).bytes(key.as_bytes()).bytes(value),
        }
        .finish()
    }

    /// Parses a frame's payload. A hello with another magic is [`Malformed`].
    pub(crate) fn decode(frame: &[u8]) -> Parsed<Request> {
        let mut r = Reader::new(frame);
        let req = match r.u8()? {
            HELLO => {
                if r.array::<4>()? != MAGIC {
                    return Err(Malformed);
                }
                let version = r.u8()?;
                if version != VERSION {
                    // Another version's hello may not parse as ours: stop here.
                    return Ok(Request::Hello {
                        version,
                        rank: None,
                        exchange: Vec::new(),
                    });
                }
                let rank = Some(r.u32()?).filter(|&r| r != NO_RANK);
                Request::Hello {
                    version,
                    rank,
                    exchange: r.bytes()?.to_vec(),
                }
            }
            PROOF => Request::Proof {
                mac: r.bytes()?.to_vec(),
            },
            SET => Request::Set {
                key: r.string()?,
                value: r.bytes()?.to_vec(),
            },
            GET => {
                let timeout = Duration::from_micros(r.u64()?);
                Request::Get {
                    key: r.string()?,
                    timeout,
                }
            }
            TRY_GET => Request::TryGet { key: r.string()? },
            ADD => Request::Add {
                key: r.string()?,
                delta: r.i64()?,
            },
            WAIT => {
                let timeout = Duration::from_micros(r.u64()?);
                let n = r.u32()? as usize;
                let mut keys = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    keys.push(r.string()?);
                }
                Request::Wait { keys, timeout }
            }
            COMPARE_SET => {
                let key = r.string()?;
                let has_expected = r.u8()?;
                let expected = r.bytes()?.to_vec();
                Request::CompareSet {
                    key,
                    expected: match has_expected {
                        0 => None,
                        1 => Some(expected),
                        _ => return Err(Malformed),
                    },
                    desired: r.bytes()?.to_vec(),
                }
            }
            ON_CLOSE => Request::OnClose { key: r.string()? },
            SET_ONCE => Request::SetOnce {
                key: r.string()?,
                value: r.bytes()?.to_vec(),
            },
            _ => return Err(Malformed),
        };
        r.end()?;
        Ok(req)
    }
}

impl Reply {
    /// The frame's payload.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let w = Writer::default();
        match self {
            Reply::Ok => w.u8(OK),
            Reply::Value(v) => w.u8(VALUE).bytes(v),
            Reply::Missing => w.u8(MISSING),
            Reply::Int(v) => w.u8(INT).i64(*v),
            Reply::Timeout(key) => w.u8(TIMEOUT).bytes(key.as_bytes()),
            Reply::Challenge { exchange, mac } => w.u8(CHALLENGE).bytes(exchange).bytes(mac),
            Reply::Refused(why) => w.u8(REFUSED).bytes(why.as_bytes()),
            Reply::Error(msg) => w.u8(ERROR).bytes(msg.as_bytes()),
        }
        .finish()
    }

    /// Parses a frame's payload.
    pub(crate) fn decode(frame: &[u8]) -> Parsed<Reply> {
        let mut r = Reader::new(frame);
        let reply = match r.u8()? {
            OK => Reply::Ok,
            VALUE => Reply::Value(r.bytes()?.to_vec()),
            MISSING => Reply::Missing,
            INT => Reply::Int(r.i64()?),
            TIMEOUT => Reply::Timeout(r.string()?),
            CHALLENGE => Reply::Challenge {
                exchange: r.bytes()?.to_vec(),
                mac: r.bytes()?.to_vec(),
            },
            REFUSED => Reply::Refused(r.string()?),
            ERROR => Reply::Error(r.string()?),
            _ => return Err(Malformed),
        };
        r.end()?;
        Ok(reply)
    }

    /// A short name for messages about an unexpected reply.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Reply::Ok => "ok",
            Reply::Value(_) => "value",
            Reply::Missing => "missing",
            Reply::Int(_) => "integer",
            Reply::Timeout(_) => "timeout",
            Reply::Challenge { .. } => "challenge",
            Reply::Refused(_) => "refused",
            Reply::Error(_) => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_and_reply_round_trips() {
        let t = Duration::from_millis(1500);
        let requests = [
            Request::Hello {
                version: VERSION,
                rank: Some(3),
                exchange: vec![7; 33],
            },
            Request::Hello {
                version: VERSION,
                rank: None,
                exchange: Vec::new(),
            },
            Request::Proof { mac: vec![1; 32] },
            Request::Set {
                key: "k".into(),
                value: vec![1, 2, 3],
            },
            Request::Get {
                key: "k".into(),
                timeout: t,
            },
            Request::TryGet { key: "k".into() },
            Request::Add {
                key: "c".into(),
                delta: -3,
            },
            Request::Wait {
                keys: vec!["a".into(), "b".into()],
                timeout: t,
            },
            Request::CompareSet {
                key: "s".into(),
                expected: None,
                desired: vec![4],
            },
            Request::CompareSet {
                key: "s".into(),
                expected: Some(vec![]),
                desired: vec![5, 6],
            },
            Request::OnClose { key: "gone".into() },
            Request::SetOnce {
                key: "addr/1".into(),
                value: vec![7],
            },
        ];
        for req in requests {
            assert_eq!(Request::decode(&req.encode()), Ok(req));
        }
        let replies = [
            Reply::Ok,
            Reply::Value(vec![9; 10]),
            Reply::Missing,
            Reply::Int(i64::MIN),
            Reply::Timeout("k".into()),
            Reply::Challenge {
                exchange: vec![2; 33],
                mac: vec![3; 32],
            },
            Reply::Refused("refused".into()),
            Reply::Error("boom".into()),
        ];
        for reply in replies {
            assert_eq!(Reply::decode(&reply.encode()), Ok(reply));
        }
    }

    #[test]
    fn garbage_trailing_bytes_and_bad_magic_are_malformed() {
        assert_eq!(Request::decode(b"GET / HTTP/1.0\r\n\r\n"), Err(Malformed));
        assert_eq!(Request::decode(&[]), Err(Malformed));
        let mut set = Request::TryGet { key: "k".into() }.encode();
        set.push(0);
        assert_eq!(Request::decode(&set), Err(Malformed));
        let mut hello = Request::Hello {
            version: VERSION,
            rank: None,
            exchange: Vec::new(),
        }
        .encode();
        hello[1] = b'X';
        assert_eq!(Request::decode(&hello), Err(Malformed));
        assert_eq!(Reply::decode(&[0x7f]), Err(Malformed));
    }
}
