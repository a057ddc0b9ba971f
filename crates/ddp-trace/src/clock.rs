//! One clock across ranks: each rank's offset to rank 0's trace clock, measured by ping-pong
//! rounds over the rendezvous store (only when tracing is on).
//!
//! Protocol (keys in the store's `ddp/trace` namespace): rank `k > 0` sets `ping/{k}/{i}` and
//! waits for `pong/{k}/{i}`, which rank 0 sets to its clock as soon as it sees the ping. Rank 0
//! serves the ranks one after another, [`ROUNDS`] rounds each.
//!
//! Rank 0 reads its clock when the store hands it the ping, i.e. when the ping *reached the
//! store* (rank 0 serves the store in its own process, so that hand-over is a loopback hop),
//! which is the middle of the ping's own round trip — the `set` and its acknowledgement —
//! not the middle of the whole exchange: the `get` of the answer starts only after the
//! acknowledgement, so the answer's arrival lags by a further round trip. Taking the middle of
//! the whole exchange put rank 0's reading at a quarter of it instead of half, a bias of one
//! one-way latency.
//!
//! Which round to trust: the one whose *whole exchange* (ping sent to answer received) was
//! shortest. Rank 0's reading can only have happened inside that exchange, so its length bounds
//! the error whatever delayed it; a round picked by the quickest ping alone could be one in
//! which rank 0's thread woke late (a loaded machine: milliseconds), and nothing in the ping
//! shows that. [`ClockSync::bound_us`] is that causal bound; the typical error is far smaller
//! (half the ping's round trip plus the store's hop to rank 0).

use std::time::{Duration, Instant};

use ddp_store::error::Result;
use ddp_store::store::{PrefixStore, Store, keys};

/// Ping-pong rounds per rank.
pub(super) const ROUNDS: usize = 8;
/// How long rank 0 waits for the first ping of all ranks together (a rank that does not
/// trace never pings: rank 0 then gives up on it after this).
const FIRST_PING: Duration = Duration::from_secs(5);
/// How long a rank waits for rank 0's first answer: rank 0 serves lower ranks first, and
/// gives up on those that never ping by [`FIRST_PING`]. A rank whose rank 0 does not trace
/// (a misconfiguration) waits this long once, then keeps its own clock.
const FIRST_PONG: Duration = Duration::from_secs(10);
/// How long either side waits in later rounds.
const ROUND: Duration = Duration::from_secs(5);

/// One ping-pong round, every time in microseconds on the clock that read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSample {
    /// This rank's clock when it sent the ping.
    pub sent_us: i64,
    /// This rank's clock when the store acknowledged the ping.
    pub acked_us: i64,
    /// Rank 0's clock when it saw the ping.
    pub peer_us: i64,
    /// This rank's clock when the answer arrived.
    pub received_us: i64,
}

impl ClockSample {
    /// The ping's round trip, `acked - sent`: rank 0's reading lies (up to the store's hop to
    /// rank 0) at its middle.
    pub fn rtt_us(&self) -> i64 {
        self.acked_us - self.sent_us
    }
}

/// The measured offset of a clock to rank 0's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSync {
    /// Add this to a local time to get rank 0's time (0 on rank 0).
    pub offset_us: i64,
    /// The ping's round trip in the round the offset comes from.
    pub rtt_us: i64,
    /// The offset is certain to within ± this many µs: rank 0 read its clock somewhere inside
    /// that round's exchange, at most this far from where the estimate puts it.
    pub bound_us: i64,
    /// Rounds measured.
    pub rounds: usize,
}

/// The offset from the round with the shortest whole exchange (`received − sent`): rank 0
/// read its clock `peer_us` when the ping reached the store, halfway through the ping's round
/// trip, so `offset = peer − (sent + acked) / 2`, certain to within
/// `bound = received − (sent + acked) / 2` (the reading cannot lie outside the exchange).
/// Rounds whose times go backwards (a clock that jumped) are ignored; `None` when no round is
/// left.
///
/// ```
/// use ddp_trace::{estimate_offset, ClockSample};
/// // This clock is 1000 µs behind rank 0's; the second round's exchange is the shortest (40 µs).
/// let rounds = [
///     ClockSample { sent_us: 0, acked_us: 300, peer_us: 1_150, received_us: 600 },
///     ClockSample { sent_us: 500, acked_us: 520, peer_us: 1_510, received_us: 540 },
/// ];
/// let sync = estimate_offset(&rounds).unwrap();
/// assert_eq!((sync.offset_us, sync.rtt_us, sync.bound_us, sync.rounds), (1_000, 20, 30, 2));
/// ```
pub fn estimate_offset(samples: &[ClockSample]) -> Option<ClockSync> {
    let best = samples
        .iter()
        .filter(|s| s.rtt_us() >= 0 && s.received_us >= s.acked_us)
        .min_by_key(|s| s.received_us - s.sent_us)?;
    let middle = (best.sent_us + best.acked_us) / 2;
    Some(ClockSync {
        offset_us: best.peer_us - middle,
        rtt_us: best.rtt_us(),
        bound_us: best.received_us - middle,
        rounds: samples.len(),
    })
}

/// Runs the protocol above as `rank` of `world`, reading this rank's clock with `now_us`.
/// Rank 0 answers every other rank and returns offset 0; a rank that never heard from rank 0
/// returns the store's error.
pub(super) fn sync_with_rank0(
    store: &mut impl Store,
    rank: usize,
    world: usize,
    now_us: impl Fn() -> i64,
) -> Result<ClockSync> {
    let mut ns = PrefixStore::new(store, keys::TRACE);
    if rank == 0 {
        let first_deadline = Instant::now() + FIRST_PING;
        for peer in 1..world {
            for round in 0..ROUNDS {
                let wait = if round == 0 {
                    first_deadline.saturating_duration_since(Instant::now())
                } else {
                    ROUND
                };
                if let Err(e) = ns.get(&keys::trace_ping(peer, round), wait) {
                    tracing::warn!(
                        peer,
                        "trace: rank {peer} did not take part in the clock synchronisation ({e}); does it trace too?"
                    );
                    break;
                }
                ns.set(&keys::trace_pong(peer, round), &now_us().to_le_bytes())?;
            }
        }
        return Ok(ClockSync {
            offset_us: 0,
            rtt_us: 0,
            bound_us: 0,
            rounds: 0,
        });
    }
    let mut samples = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        let sent_us = now_us();
        ns.set(&keys::trace_ping(rank, round), &sent_us.to_le_bytes())?;
        let acked_us = now_us();
        let wait = if round == 0 { FIRST_PONG } else { ROUND };
        let reply = ns.get(&keys::trace_pong(rank, round), wait)?;
        let received_us = now_us();
        let peer_us = i64::from_le_bytes(reply.as_slice().try_into().map_err(|_| {
            ddp_store::CommError::Store {
                addr: "rank 0".into(),
                msg: format!("malformed clock reply of {} bytes", reply.len()),
            }
        })?);
        samples.push(ClockSample {
            sent_us,
            acked_us,
            peer_us,
            received_us,
        });
    }
    estimate_offset(&samples).ok_or_else(|| ddp_store::CommError::Store {
        addr: "rank 0".into(),
        msg: "every clock round trip was negative (the local clock went backwards)".into(),
    })
}
