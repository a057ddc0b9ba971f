//! Multi-process test of the sharded data loader: real rank processes (`data_worker`) each
//! read their shard for a few epochs; together they must cover the dataset exactly as the
//! DistributedSampler documents, with the same number of batches on every rank.

use std::collections::BTreeMap;
use std::time::Duration;

use ddp_testkit::data_report::EpochReport;

const DEADLINE: Duration = Duration::from_secs(120);

struct Run {
    len: usize,
    world: usize,
    batch: usize,
    drop_last: bool,
    drop_last_batch: bool,
    epochs: u64,
}

/// Launches `world` ranks (`ddp_testkit::RankJob`: one deadline, every rank killed and reaped
/// past it) and returns each rank's reports, indexed `[rank][epoch]`.
fn launch(run: &Run) -> Vec<Vec<EpochReport>> {
    let job = ddp_testkit::RankJob::new(env!("CARGO_BIN_EXE_data_worker"), run.world)
        .env("DATA_LEN", run.len.to_string())
        .env("BATCH_SIZE", run.batch.to_string())
        .env("DROP_LAST", run.drop_last.to_string())
        .env("DROP_LAST_BATCH", run.drop_last_batch.to_string())
        .env("EPOCHS", run.epochs.to_string())
        .env("SEED", "1234")
        .env("NUM_WORKERS", "2")
        .deadline(DEADLINE)
        .run()
        .expect("spawn data_worker");
    let outputs = job
        .ranks
        .iter()
        .map(|r| (r.success(), r.stdout.clone(), r.output()));

    let mut reports = Vec::new();
    for (rank, (ok, out, all)) in outputs.enumerate() {
        assert!(ok, "rank {rank} failed:\n{}\n{all}", job.report());
        let epochs: Vec<EpochReport> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("report line"))
            .collect();
        assert_eq!(epochs.len() as u64, run.epochs, "rank {rank} epochs");
        for (e, r) in epochs.iter().enumerate() {
            assert_eq!((r.rank, r.epoch), (rank, e as u64));
        }
        reports.push(epochs);
    }
    reports
}

/// Checks one run against the documented semantics.
fn check(run: &Run) {
    let reports = launch(run);
    let (len, w, b) = (run.len, run.world, run.batch);
    let per_rank = if run.drop_last {
        len / w
    } else {
        len.div_ceil(w)
    };
    let kept_per_rank = if run.drop_last_batch {
        per_rank - per_rank % b
    } else {
        per_rank
    };
    let expected_batches = if run.drop_last_batch {
        per_rank / b
    } else {
        per_rank.div_ceil(b)
    };
    let mut orders = Vec::new();
    for e in 0..run.epochs as usize {
        let epoch: Vec<&EpochReport> = reports.iter().map(|r| &r[e]).collect();
        for r in &epoch {
            assert_eq!(r.batches, expected_batches, "rank {} batch count", r.rank);
            assert_eq!(r.batch_sizes.len(), r.batches);
            assert_eq!(r.ids.len(), kept_per_rank, "rank {} items", r.rank);
            assert!(r.batch_sizes.iter().all(|&s| s >= 1 && s <= b));
            assert!(r.ids.iter().all(|&i| (0..len as i64).contains(&i)));
        }
        let mut counts: BTreeMap<i64, usize> = BTreeMap::new();
        for r in &epoch {
            for &i in &r.ids {
                *counts.entry(i).or_default() += 1;
            }
        }
        let total: usize = counts.values().sum();
        if run.drop_last_batch && kept_per_rank < per_rank {
            // Batch-level drops remove items; what is left must still be duplicate-free
            // under drop_last, and bounded by the padding otherwise.
            assert!(total <= per_rank * w);
        } else if run.drop_last {
            assert!(counts.values().all(|&c| c == 1), "a sample was seen twice");
            assert_eq!(counts.len(), len - len % w, "wrong number of samples seen");
        } else {
            assert_eq!(counts.len(), len, "not every sample was seen");
            let pad = per_rank * w - len;
            assert_eq!(total - len, pad, "duplicates beyond the padding");
            // Reassemble the global order: its tail is a repeat of its head (the padding).
            let global: Vec<i64> = (0..per_rank)
                .flat_map(|k| epoch.iter().map(move |r| r.ids[k]))
                .collect();
            for i in 0..pad {
                assert_eq!(global[len + i], global[i % len], "padding is not the head");
            }
        }
        if run.drop_last && run.drop_last_batch && kept_per_rank < per_rank {
            assert!(counts.values().all(|&c| c == 1));
        }
        orders.push(epoch.iter().map(|r| r.ids.clone()).collect::<Vec<_>>());
    }
    if run.epochs > 1 && per_rank >= 8 && len >= 20 {
        assert_ne!(orders[0], orders[1], "epoch did not change the order");
    }
}

#[test]
fn ranks_cover_the_dataset_with_padding() {
    // 1000 items on 3 ranks: 334 per rank (2 padded); batch 8 does not divide 334.
    check(&Run {
        len: 1000,
        world: 3,
        batch: 8,
        drop_last: false,
        drop_last_batch: false,
        epochs: 2,
    });
    // A batch size that divides the shard: 250 per rank on 4 ranks, batch 25.
    check(&Run {
        len: 1000,
        world: 4,
        batch: 25,
        drop_last: false,
        drop_last_batch: false,
        epochs: 2,
    });
}

#[test]
fn ranks_see_every_sample_once_with_drop_last() {
    // 1001 items on 4 ranks: 250 per rank, 1 dropped; batch 7 does not divide 250.
    check(&Run {
        len: 1001,
        world: 4,
        batch: 7,
        drop_last: true,
        drop_last_batch: false,
        epochs: 2,
    });
    // Batch 10 divides 250.
    check(&Run {
        len: 1001,
        world: 4,
        batch: 10,
        drop_last: true,
        drop_last_batch: false,
        epochs: 1,
    });
    // Both drop_last flags: every rank drops its partial batch alike.
    check(&Run {
        len: 1001,
        world: 4,
        batch: 7,
        drop_last: true,
        drop_last_batch: true,
        epochs: 1,
    });
}

#[test]
fn tiny_and_empty_datasets_give_equal_epochs_without_hanging() {
    // Empty dataset: an empty epoch on every rank.
    for drop_last in [false, true] {
        check(&Run {
            len: 0,
            world: 3,
            batch: 4,
            drop_last,
            drop_last_batch: false,
            epochs: 2,
        });
    }
    // Fewer items than ranks: padding repeats them (one per rank); drop_last empties the epoch.
    for drop_last in [false, true] {
        check(&Run {
            len: 2,
            world: 3,
            batch: 4,
            drop_last,
            drop_last_batch: false,
            epochs: 1,
        });
    }
}

#[test]
fn bad_rank_is_a_clear_error() {
    // One process claiming rank 3 of a world of 3.
    let job = ddp_testkit::RankJob::new(env!("CARGO_BIN_EXE_data_worker"), 3)
        .only_ranks([0])
        .rank_env(0, "RANK", "3")
        .env("DATA_LEN", "10")
        .env("BATCH_SIZE", "2")
        .deadline(DEADLINE)
        .run()
        .expect("spawn data_worker");
    let r = job.rank(0);
    let err = &r.stderr;
    assert!(!r.success() && !r.timed_out, "{}", job.report());
    assert!(
        err.contains("rank 3 is out of range for world size 3"),
        "{err}"
    );
}
