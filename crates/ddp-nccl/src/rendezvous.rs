//! Sharing NCCL's unique id through the rendezvous store.
//!
//! Rank 0 asks NCCL for a unique id (`ncclGetUniqueId`, which also starts NCCL's bootstrap
//! listener on rank 0) and publishes it; the other ranks wait for the key and read it. Each
//! group creation gets a fresh generation number (an atomic counter per rank), so a job that
//! builds several NCCL groups in the same order on every rank never reads a stale id.
//!
//! Keys, in a [`PrefixStore`] namespace (default `nccl`; the keys are built in the store's
//! `keys` module):
//! - `{prefix}/generation/{rank}`: counter; its new value is the generation `g`.
//! - `{prefix}/{g}/arrived/{rank}`: set by each rank before it creates its communicator, so a
//!   rank whose creation times out can name the ranks that never came.
//! - `{prefix}/{g}/unique_id`: [`ID_MAGIC`], the world size (u64 LE) and the 128 id bytes.

use std::time::{Duration, Instant};

use ddp_comm::error::{CommError, Result};
use ddp_comm::store::{CompareSet, PrefixStore, Store, keys};
use ddp_comm::wire::{Malformed, Reader, Writer};

/// Size of `ncclUniqueId`.
pub const ID_BYTES: usize = 128;

/// First bytes of a published id, to reject a value that is not one.
pub const ID_MAGIC: [u8; 4] = *b"NCID";

/// The outcome of [`exchange_unique_id`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchanged {
    /// The generation of this group creation (1 for the first).
    pub generation: i64,
    /// NCCL's unique id, identical on every rank.
    pub id: [u8; ID_BYTES],
}

/// Encodes the value rank 0 publishes.
pub fn encode_id(world_size: usize, id: &[u8; ID_BYTES]) -> Vec<u8> {
    Writer::with_capacity(4 + 8 + ID_BYTES)
        .raw(&ID_MAGIC)
        .u64(world_size as u64)
        .raw(id)
        .finish()
}

/// Decodes rank 0's value and checks it describes a world of `world_size` ranks.
pub fn decode_id(bytes: &[u8], world_size: usize) -> Result<[u8; ID_BYTES]> {
    let mut r = Reader::new(bytes);
    let parsed = (|| {
        if r.array::<4>()? != ID_MAGIC {
            return Err(Malformed);
        }
        let theirs = r.u64()?;
        let id = r.array::<ID_BYTES>()?;
        r.end()?;
        Ok((theirs, id))
    })();
    let Ok((theirs, id)) = parsed else {
        return Err(CommError::Mismatch(format!(
            "the NCCL unique id published by rank 0 is malformed ({} bytes); is another job \
             using the same rendezvous store and key prefix?",
            bytes.len()
        )));
    };
    if theirs != world_size as u64 {
        return Err(CommError::Mismatch(format!(
            "rank 0 creates an NCCL group of {theirs} ranks but this rank expects {world_size} \
             (WORLD_SIZE differs between ranks?)"
        )));
    }
    Ok(id)
}

/// Publishes (rank 0) or fetches (others) the unique id of a new NCCL group.
///
/// `make_id` is called on rank 0 only. Others wait up to `timeout` for rank 0's key; on timeout
/// the error names rank 0.
pub fn exchange_unique_id<S: Store + ?Sized>(
    store: &mut S,
    prefix: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES]>,
) -> Result<Exchanged> {
    if rank >= world_size {
        return Err(CommError::InvalidArgument(format!(
            "rank {rank} is out of range for a world of {world_size}"
        )));
    }
    let mut store = PrefixStore::new(store, prefix);
    let generation = store.add(&keys::nccl_generation(rank), 1)?;
    store.set(&keys::nccl_arrived(generation, rank), b"1")?;
    let id_key = keys::nccl_unique_id(generation);
    let key = store.key(&id_key);
    let id = if rank == 0 {
        let id = make_id()?;
        // Once and for all: another process holding the job's key cannot replace the id
        // and redirect the ranks (and one that published first is caught here).
        match store.set_once(&id_key, &encode_id(world_size, &id))? {
            CompareSet::Swapped => {}
            CompareSet::Current(_) => {
                return Err(CommError::Mismatch(format!(
                    "another process already published the NCCL unique id under {key:?}: \
                     two rank 0s, or a process that is not one of this job's ranks"
                )));
            }
        }
        id
    } else {
        let start = Instant::now();
        let bytes = store.get(&id_key, timeout).map_err(|e| match e {
            CommError::Timeout { .. } => CommError::Timeout {
                op: format!(
                    "waiting for rank 0 to publish the NCCL unique id (store key {key:?}); did \
                     rank 0 fail before creating its NCCL group?"
                ),
                peer: Some(0),
                after: start.elapsed(),
            },
            other => other,
        })?;
        decode_id(&bytes, world_size)?
    };
    tracing::debug!(rank, world_size, generation, "NCCL unique id exchanged");
    Ok(Exchanged { generation, id })
}

/// The ranks that never reached the rendezvous of `generation` (used to name the peers that
/// made a communicator creation time out). Errors reading the store count as "not arrived".
pub fn missing_ranks<S: Store + ?Sized>(
    store: &mut S,
    prefix: &str,
    generation: i64,
    world_size: usize,
) -> Vec<usize> {
    let mut store = PrefixStore::new(store, prefix);
    (0..world_size)
        .filter(|&r| {
            !matches!(
                store.try_get(&keys::nccl_arrived(generation, r)),
                Ok(Some(_))
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddp_comm::store::{StoreClient, StoreServer};

    const T: Duration = Duration::from_secs(10);

    fn fake_id(seed: u8) -> [u8; ID_BYTES] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
    }

    #[test]
    fn encode_decode_round_trip_and_checks() {
        let id = fake_id(7);
        let enc = encode_id(4, &id);
        assert_eq!(decode_id(&enc, 4).unwrap(), id);
        let err = decode_id(&enc, 2).unwrap_err();
        assert!(matches!(err, CommError::Mismatch(_)), "{err}");
        assert!(err.to_string().contains("4 ranks"), "{err}");
        let err = decode_id(&enc[..20], 4).unwrap_err();
        assert!(err.to_string().contains("malformed"), "{err}");
        let mut bad = enc.clone();
        bad[0] = b'X';
        assert!(decode_id(&bad, 4).is_err());
    }

    #[test]
    fn three_ranks_get_rank_zeros_id_for_each_generation() {
        let server = StoreServer::bind("127.0.0.1:0", Some("tok".into())).unwrap();
        let ep = server.local_addr().to_string();
        let world = 3;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let ep = ep.clone();
                std::thread::spawn(move || {
                    let mut store = StoreClient::connect(&ep, Some("tok"), T).unwrap();
                    let mut got = Vec::new();
                    for round in 0..2u8 {
                        let ex = exchange_unique_id(&mut store, "nccl", rank, world, T, || {
                            assert_eq!(rank, 0, "only rank 0 makes the id");
                            Ok(fake_id(round))
                        })
                        .unwrap();
                        got.push(ex);
                    }
                    got
                })
            })
            .collect();
        let results: Vec<Vec<Exchanged>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for per_rank in &results {
            assert_eq!(per_rank[0].generation, 1);
            assert_eq!(per_rank[0].id, fake_id(0));
            assert_eq!(per_rank[1].generation, 2);
            assert_eq!(per_rank[1].id, fake_id(1));
        }
        let mut store = StoreClient::connect(&ep, Some("tok"), T).unwrap();
        assert!(missing_ranks(&mut store, "nccl", 2, world).is_empty());
        assert_eq!(missing_ranks(&mut store, "nccl", 3, world), vec![0, 1, 2]);
    }

    #[test]
    fn absent_rank_zero_is_a_timeout_naming_rank_zero() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let ep = server.local_addr().to_string();
        let mut store = StoreClient::connect(&ep, None, T).unwrap();
        let err = exchange_unique_id(&mut store, "p", 1, 2, Duration::from_millis(100), || {
            unreachable!("rank 1 never makes the id")
        })
        .unwrap_err();
        assert!(matches!(err, CommError::Timeout { .. }), "{err}");
        assert_eq!(err.peer(), Some(0));
        assert!(err.to_string().contains("unique id"), "{err}");
        assert_eq!(missing_ranks(&mut store, "p", 1, 2), vec![0]);
    }

    #[test]
    fn world_size_disagreement_is_a_mismatch() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let ep = server.local_addr().to_string();
        let mut r0 = StoreClient::connect(&ep, None, T).unwrap();
        let mut r1 = StoreClient::connect(&ep, None, T).unwrap();
        exchange_unique_id(&mut r0, "nccl", 0, 2, T, || Ok(fake_id(1))).unwrap();
        let err = exchange_unique_id(&mut r1, "nccl", 1, 3, T, || unreachable!()).unwrap_err();
        assert!(matches!(err, CommError::Mismatch(_)), "{err}");
    }

    #[test]
    fn rank_out_of_range_and_failing_id_creation_are_errors() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let ep = server.local_addr().to_string();
        let mut store = StoreClient::connect(&ep, None, T).unwrap();
        let err = exchange_unique_id(&mut store, "nccl", 2, 2, T, || unreachable!()).unwrap_err();
        assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
        let err = exchange_unique_id(&mut store, "nccl", 0, 1, T, || {
            Err(CommError::InvalidArgument("no id".into()))
        })
        .unwrap_err();
        assert!(err.to_string().contains("no id"), "{err}");
    }
}
