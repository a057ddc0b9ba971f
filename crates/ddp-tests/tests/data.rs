//! Multi-process test of the sharded data loader: real rank processes (`data_worker`) each
//! read their shard for a few epochs; together they must cover the dataset exactly as the
//! DistributedSampler documents, with the same number of batches on every rank.

use std::collections::BTreeMap;
use std::time::Duration;

use ddp_testkit::data_report::{ConsumedBatch, EpochReport};

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

/// `--nnodes 1:2` over two `ddprun` on loopback (emulated hosts), node 1's ddprun SIGKILLed in
/// the middle of epoch 0: node 0 goes on alone (WORLD_SIZE 1) from the committed loader
/// position, and over the attempts every sample of each epoch is consumed exactly once — what
/// an attempt consumed counts up to the position the next one resumed from.
#[test]
fn a_lost_node_leaves_every_sample_of_each_epoch_read_exactly_once() {
    use std::process::{Command, Stdio};
    use std::time::Instant;
    let worker = env!("CARGO_BIN_EXE_data_worker");
    let ddprun = std::path::Path::new(worker).with_file_name("ddprun");
    assert!(
        ddprun.exists(),
        "{} is missing: build the launcher first (`cargo build -p ddprun`; `cargo test --workspace` does)",
        ddprun.display()
    );
    let dir = std::env::temp_dir().join(format!("ddp-elastic-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state.json");
    let port = ddp_testkit::free_port().to_string();
    let len = 101;
    let start = |node: &str| {
        Command::new(&ddprun)
            .args([
                "--nnodes",
                "1:2",
                "--node-rank",
                node,
                "--master-port",
                &port,
            ])
            .args(["--max-restarts", "1", "--rdzv-last-call", "0.5"])
            .args([
                "--rdzv-heartbeat-secs",
                "2",
                "--grace-secs",
                "1",
                "--",
                worker,
            ])
            .env(
                "DDP_JOB_TOKEN",
                "elastic-data-0123456789abcdef0123456789abcdef",
            )
            .env("DDP_HOST_ID", format!("host-{node}"))
            .env("DATA_LEN", len.to_string())
            .env("BATCH_SIZE", "3")
            .env("EPOCHS", "2")
            .env("SEED", "5")
            .env("NUM_WORKERS", "1")
            .env("BATCH_SLEEP_MS", "60")
            .env("STATE_FILE", &state)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ddprun")
    };
    let mut nodes = ddp_testkit::Launchers(vec![start("0"), start("1")]);
    let deadline = Instant::now() + DEADLINE;
    // Kill node 1 once the job has committed a few batches of epoch 0.
    loop {
        let committed = std::fs::read(&state)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        if committed.is_some_and(|s| s["epoch"] == 0 && s["samples_done"].as_u64() >= Some(18)) {
            break;
        }
        assert!(Instant::now() < deadline, "the job never committed a batch");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut node1 = nodes.0.pop().unwrap();
    node1.kill().unwrap();
    let _ = node1.wait_with_output();
    // Node 0's output, read on a thread; the deadline kills it (dropping `nodes`).
    let mut node0 = nodes.0.pop().unwrap();
    let (out, err) = (node0.stdout.take().unwrap(), node0.stderr.take().unwrap());
    nodes.0.push(node0);
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let (out, err) = (read(Box::new(out)), read(Box::new(err)));
    let status = loop {
        if let Some(s) = nodes.0[0].try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "node 0 overran its deadline");
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = out.join().unwrap();
    assert!(status.success(), "node 0 failed: {}", err.join().unwrap());
    let lines: Vec<ConsumedBatch> = stdout
        .lines()
        .filter_map(|l| l.split_once("] ").map(|(_, rest)| rest))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    // Node 0's rank 0 in both attempts; node 1's lines died with it (its pipe was node 1's).
    let resumed_at = lines
        .iter()
        .find(|c| c.attempt == 1)
        .map(|c| (c.epoch, c.before))
        .expect("an attempt after the loss");
    assert!(
        lines
            .iter()
            .all(|c| c.world == if c.attempt == 0 { 2 } else { 1 })
    );
    // Rank 1's share of attempt 0 is the interleaved half of each position: rebuild it from
    // the sampler (node 1's output is gone), rank 0's from its lines.
    for epoch in 0..2u64 {
        let mut counted: Vec<i64> = Vec::new();
        for c in lines.iter().filter(|c| c.epoch == epoch) {
            let committed = c.attempt == 1 || (c.epoch, c.before) < resumed_at;
            if committed {
                counted.extend(&c.ids);
                if c.attempt == 0 {
                    // Rank 1 read the other half of the same global positions.
                    let rank1 = burn_ddp::data::DistributedSampler::new(len, 2, 1)
                        .unwrap()
                        .with_seed(5);
                    let mut s = rank1;
                    s.set_epoch(epoch);
                    let first = (c.before.unwrap() / 2) as usize;
                    let shard = s.indices();
                    counted.extend(
                        shard[first..(first + c.ids.len()).min(shard.len())]
                            .iter()
                            .map(|&i| i as i64),
                    );
                }
            }
        }
        let mut sorted = counted.clone();
        sorted.sort_unstable();
        let distinct: std::collections::BTreeSet<i64> = sorted.iter().copied().collect();
        assert_eq!(distinct.len(), len, "epoch {epoch}: every sample read");
        assert!(
            sorted.len() - len <= 1,
            "epoch {epoch}: {} samples read twice (the sampler pads fewer than the world size)",
            sorted.len() - len
        );
    }
    eprintln!("resumed at {resumed_at:?} with 1 rank after node 1 was lost");
}
