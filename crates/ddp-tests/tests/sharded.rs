//! Multi-process tests of the sharded optimizer (`DdpOptimizer::sharded`, ZeRO stage 1): real
//! rank processes (`src/bin/shard_worker.rs`) on loopback with the CPU backend. Sharded
//! training must be bitwise the unsharded one — SGD with momentum and weight decay, Adam — at
//! 2, 3 and 4 ranks (uneven shards), with SyncBatchNorm, a branch only one rank uses and a
//! layer no rank uses, also through a checkpoint saved and resumed in the middle (sharded to
//! unsharded and back, and at another world size); and each rank must hold only its part of
//! the optimizer state.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ddp_testkit::{JobResult, RankJob, read_f32};

const DEADLINE: Duration = Duration::from_secs(240);

/// One job's outputs; the folder is removed on drop.
struct Run {
    result: JobResult,
    dir: PathBuf,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Run {
    /// Rank 0's final parameters (with SyncBatchNorm's running statistics) after checking
    /// that every rank's are bitwise the same.
    fn params(&self, world: usize) -> Vec<f32> {
        self.read_all(world, "rank")
    }

    fn read_all(&self, world: usize, prefix: &str) -> Vec<f32> {
        assert!(self.result.success(), "{}", self.result.report());
        let rank0 = read_f32(&self.dir.join(format!("{prefix}0.f32")));
        for r in 1..world {
            let p = read_f32(&self.dir.join(format!("{prefix}{r}.f32")));
            assert!(same_bits(&p, &rank0), "rank {r} differs from rank 0");
        }
        assert!(!rank0.is_empty() && rank0.iter().all(|x| x.is_finite()));
        rank0
    }

    /// The optimizer-state bytes each rank printed.
    fn state_bytes(&self) -> Vec<usize> {
        self.result
            .ranks
            .iter()
            .map(|r| {
                r.stdout
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("STATE rank={} bytes=", r.rank)))
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or_else(|| {
                        panic!("rank {} printed no STATE line: {}", r.rank, r.output())
                    })
            })
            .collect()
    }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Runs `world` ranks of the worker with `args` (and `--out` a fresh folder, or `dir`).
fn launch_in(world: usize, dir: &Path, args: &[&str]) -> Run {
    launch_job(world, dir, args, |job| job)
}

/// [`launch_in`] with the job set up further by `setup` (variables for some ranks).
fn launch_job(
    world: usize,
    dir: &Path,
    args: &[&str],
    setup: impl FnOnce(RankJob) -> RankJob,
) -> Run {
    std::fs::create_dir_all(dir).expect("temp dir");
    let job = RankJob::new(env!("CARGO_BIN_EXE_shard_worker"), world)
        .args(args)
        .arg("--out")
        .arg(dir)
        .env("DDP_TIMEOUT_SECS", "60")
        .env("RAYON_NUM_THREADS", "1")
        .deadline(DEADLINE);
    let result = setup(job).run().expect("spawn shard_worker");
    Run {
        result,
        dir: dir.to_path_buf(),
    }
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "burn-ddp-sharded-{name}-{}-{}",
        std::process::id(),
        ddp_testkit::free_port()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn launch(world: usize, name: &str, args: &[&str]) -> Run {
    launch_in(world, &fresh_dir(name), args)
}

/// Sharded and unsharded training at `world` ranks with `optim`: bitwise the same parameters,
/// and each sharded rank holding a part of the unsharded state (together about all of it).
fn sharded_equals_unsharded(world: usize, optim: &str) {
    sharded_equals_unsharded_with(world, optim, &[]);
}

/// [`sharded_equals_unsharded`] with more rank-program arguments.
fn sharded_equals_unsharded_with(world: usize, optim: &str, more: &[&str]) {
    let args = [&["--optim", optim, "--steps", "6"][..], more].concat();
    let tag = more.join("");
    let plain = launch(world, &format!("plain-{world}-{optim}{tag}"), &args);
    let sharded = launch(
        world,
        &format!("sharded-{world}-{optim}{tag}"),
        &[&args[..], &["--shard"]].concat(),
    );
    assert!(
        same_bits(&sharded.params(world), &plain.params(world)),
        "{world} ranks, {optim}: sharded training differs from unsharded"
    );
    // The unsharded state differs between ranks by a few bytes only (the parameter ids are
    // written as decimal keys).
    let whole = plain.state_bytes();
    let whole = *whole.iter().min().unwrap();
    let parts = sharded.state_bytes();
    for (r, &b) in parts.iter().enumerate() {
        assert!(
            b < whole,
            "rank {r} holds {b} bytes of state, unsharded {whole}"
        );
    }
    // Each burnpack carries a header and per-parameter scalars besides the moments.
    let sum: usize = parts.iter().sum();
    assert!(
        sum <= whole + world * 4096,
        "the shards ({parts:?}) add up to more than the whole state ({whole})"
    );
}

/// Gradients clipped by their global norm (`with_global_norm_clipping`, PyTorch's
/// `clip_grad_norm_`): the sharded optimizer, whose owners each hold a part of the gradients,
/// computes the same norm as the unsharded one (every rank prints the same bits), the
/// clipping is active (the norm exceeds the threshold, and the training differs from an
/// unclipped one), and the training stays bitwise the unsharded one.
#[test]
fn gradients_clipped_by_the_global_norm_sharded_are_bitwise_unsharded() {
    for (world, optim) in [(2, "adam"), (3, "sgd")] {
        let args = ["--optim", optim, "--steps", "6", "--clip-norm", "0.05"];
        let plain = launch(world, &format!("clip-plain-{world}"), &args);
        let sharded = launch(
            world,
            &format!("clip-sharded-{world}"),
            &[&args[..], &["--shard"]].concat(),
        );
        let norms = |run: &Run| -> Vec<String> {
            run.result
                .ranks
                .iter()
                .flat_map(|r| {
                    r.stdout
                        .lines()
                        .filter_map(|l| l.strip_prefix(&format!("GRADNORM rank={} ", r.rank)))
                        .map(str::to_string)
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let (p, s) = (norms(&plain), norms(&sharded));
        assert_eq!(p.len(), 6 * world, "{p:?}");
        assert_eq!(p, s, "{world} ranks: the sharded norms differ");
        for r in 1..world {
            assert_eq!(
                p[..6],
                p[6 * r..6 * (r + 1)],
                "rank {r}'s norms differ from rank 0's"
            );
        }
        let first: f64 = p[0]
            .rsplit("norm=")
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!(first > 0.05, "the norm {first} never needed clipping");
        assert!(
            same_bits(&sharded.params(world), &plain.params(world)),
            "{world} ranks, {optim}: clipped sharded training differs from unsharded"
        );
        let unclipped = launch(
            world,
            &format!("clip-none-{world}"),
            &["--optim", optim, "--steps", "6", "--shard"],
        );
        assert!(!same_bits(&unclipped.params(world), &plain.params(world)));
    }
}

/// An optimizer that has stepped unsharded and is then sharded (`into_sharded`) keeps its
/// state whole until its next step, then each rank keeps its own part: the training is still
/// bitwise the unsharded one, and every rank ends with less state.
#[test]
fn an_optimizer_sharded_after_it_stepped_keeps_its_state() {
    let world = 3;
    let args = ["--optim", "adam", "--steps", "6"];
    let plain = launch(world, "late-plain", &args);
    let late = launch(
        world,
        "late-sharded",
        &[&args[..], &["--shard-after", "2"]].concat(),
    );
    assert!(
        same_bits(&late.params(world), &plain.params(world)),
        "sharded after step 2: the training differs from the unsharded one"
    );
    let whole = *plain.state_bytes().iter().min().unwrap();
    for (r, b) in late.state_bytes().into_iter().enumerate() {
        assert!(
            b < whole,
            "rank {r} holds {b} bytes of state, unsharded {whole}"
        );
    }
}

/// Gradients and parameters over 64 KiB: the collectives' direct reduce-scatter and ring
/// all-gather, not the inline path. Three ranks: one bucket whose shards take two 4 MiB
/// rounds; four ranks: 6 MB buckets that split parameters between them.
#[test]
fn a_wide_model_over_the_large_path_is_bitwise_unsharded() {
    for (world, bucket) in [(3, "40000000"), (4, "6000000")] {
        let more = ["--hidden", "300000", "--bucket-bytes", bucket];
        sharded_equals_unsharded_with(world, "adam", &more);
    }
}

#[test]
fn two_ranks_sharded_sgd_momentum_is_bitwise_unsharded() {
    sharded_equals_unsharded(2, "sgd");
}

#[test]
fn three_ranks_sharded_sgd_momentum_is_bitwise_unsharded() {
    sharded_equals_unsharded(3, "sgd");
}

#[test]
fn four_ranks_sharded_sgd_momentum_is_bitwise_unsharded() {
    sharded_equals_unsharded(4, "sgd");
}

#[test]
fn two_ranks_sharded_adam_is_bitwise_unsharded() {
    sharded_equals_unsharded(2, "adam");
}

#[test]
fn three_ranks_sharded_adam_is_bitwise_unsharded() {
    sharded_equals_unsharded(3, "adam");
}

#[test]
fn four_ranks_sharded_adam_is_bitwise_unsharded() {
    sharded_equals_unsharded(4, "adam");
}

/// A checkpoint saved after step 3 and resumed by a new model and optimizer (sharded, or the
/// other kind) continues bitwise as the uninterrupted unsharded run: every parameter and
/// SyncBatchNorm's running statistics. (Before the checkpoint committed Burn's pending
/// `RunningState` update, it held the statistics of step 2, and the resumed run's running
/// mean and variance were up to 0.06 off while the parameters matched.)
#[test]
fn a_sharded_checkpoint_resumes_bitwise_sharded_or_unsharded_and_back() {
    for (world, optim) in [
        (2, "adam"),
        (3, "adam"),
        (4, "adam"),
        (2, "sgd"),
        (4, "sgd"),
    ] {
        let args = ["--optim", optim, "--steps", "6"];
        let plain = launch(world, &format!("ck-plain-{world}-{optim}"), &args).params(world);
        let cases: [(&str, &[&str]); 3] = [
            ("sharded to sharded", &["--shard", "--save-at", "3"]),
            (
                "sharded to unsharded",
                &["--shard", "--save-at", "3", "--resume-unsharded"],
            ),
            (
                "unsharded to sharded",
                &["--save-at", "3", "--resume-unsharded"],
            ),
        ];
        for (what, more) in cases {
            let run = launch(
                world,
                &format!("ck-{world}-{optim}"),
                &[&args[..], more].concat(),
            );
            assert!(
                same_bits(&run.params(world), &plain),
                "{world} ranks, {optim}, {what}: the resumed run differs from the uninterrupted one"
            );
        }
    }
}

/// A sharded checkpoint written by 3 ranks and resumed by 2 (fewer ranks, each owning more),
/// and one written by 2 and resumed by 4 (more ranks, some owning parameters no rank of the
/// saving job held alone): the sharded resume equals the same checkpoint resumed unsharded at
/// the new world size, so the state is cut anew for it and nothing is lost or mixed up.
#[test]
fn a_sharded_checkpoint_resumes_at_another_world_size() {
    for (saved_by, resumed_by) in [(3, 2), (2, 4)] {
        let tag = format!("{saved_by}-{resumed_by}");
        let first = launch(
            saved_by,
            &format!("resize-first-{tag}"),
            &["--optim", "adam", "--steps", "3", "--shard"],
        );
        // The job that saved: its step-3 checkpoint is the last file it wrote.
        let saved = launch(
            saved_by,
            &format!("resize-saved-{tag}"),
            &[
                "--optim",
                "adam",
                "--steps",
                "3",
                "--shard",
                "--save-at",
                "3",
            ],
        );
        assert!(same_bits(&saved.params(saved_by), &first.params(saved_by)));
        let ckpt = saved.dir.join("ckpt.bin");
        let ckpt = ckpt.to_str().unwrap();
        let resume = |shard: bool, name: &str| {
            let mut args = vec!["--optim", "adam", "--steps", "6", "--resume-from", ckpt];
            if shard {
                args.push("--shard");
            }
            launch(resumed_by, &format!("{name}-{tag}"), &args)
        };
        let sharded = resume(true, "resize-sharded");
        let plain = resume(false, "resize-plain");
        assert!(
            same_bits(&sharded.params(resumed_by), &plain.params(resumed_by)),
            "{saved_by} → {resumed_by} ranks: the sharded resume differs from the unsharded one"
        );
    }
}

/// Every rank on a host of its own (`DDP_HOST_ID`), so the group runs over TCP, with the
/// gradients sent as bf16 (`DDP_COMPRESSION`, which shared memory never uses): the sharded
/// optimizer's compressed reduce-scatter rounds every contribution as the unsharded
/// all-reduce does, so the training is still bitwise the unsharded one. The bf16 run differs
/// from the f32 one, so the compression was on.
#[test]
fn over_tcp_with_bf16_gradients_sharded_is_bitwise_unsharded() {
    let world = 3;
    for optim in ["adam", "sgd"] {
        let run = |shard: bool, compression: &str| {
            let mut args = vec!["--optim", optim, "--steps", "6", "--hidden", "600"];
            if shard {
                args.push("--shard");
            }
            let name = format!("tcp-{optim}-{shard}-{compression}");
            launch_job(world, &fresh_dir(&name), &args, |mut job| {
                job = job.env("DDP_COMPRESSION", compression);
                for r in 0..world {
                    job = job.rank_env(r, "DDP_HOST_ID", format!("host-{r}"));
                }
                job
            })
        };
        let sharded = run(true, "bf16").params(world);
        let plain = run(false, "bf16").params(world);
        assert!(
            same_bits(&sharded, &plain),
            "{optim} over TCP with bf16 gradients: sharded differs from unsharded"
        );
        let f32_run = run(true, "none").params(world);
        assert!(
            !same_bits(&sharded, &f32_run),
            "{optim}: the bf16 run equals the f32 one: the gradients were not compressed"
        );
    }
}

/// Two emulated hosts of three and two ranks (`DDP_HOST_ID` per host: shared memory inside a
/// host, TCP across), where the group's node-aware reduce-scatter carries the sharded
/// optimizer's gradients and its node-aware all-gather the parameters' buckets: the training
/// is still bitwise the unsharded one (whose all-reduce is node-aware too).
#[test]
fn on_emulated_nodes_sharded_is_bitwise_unsharded() {
    let world = 5;
    let run = |shard: bool| {
        let mut args = vec!["--optim", "adam", "--steps", "4", "--hidden", "600"];
        if shard {
            args.push("--shard");
        }
        launch_job(
            world,
            &fresh_dir(&format!("nodes-{shard}")),
            &args,
            |mut job| {
                for r in 0..world {
                    job = job.rank_env(r, "DDP_HOST_ID", format!("node-{}", r / 3));
                }
                job
            },
        )
    };
    let sharded = run(true).params(world);
    let plain = run(false).params(world);
    assert!(
        same_bits(&sharded, &plain),
        "on 3 + 2 emulated nodes: sharded differs from unsharded"
    );
}

/// A rank SIGKILLed in the middle of sharded Adam training with SyncBatchNorm (wherever the
/// kill lands: SyncBatchNorm's collectives inside forward or backward, the gradients'
/// reduce-scatter, the parameters' all-gather): every other rank exits non-zero within
/// seconds, by the dead connection and not the collective timeout, with a readable error
/// naming the dead rank, never a panic report or a hang.
#[test]
fn a_rank_killed_mid_sharded_training_fails_every_other_rank() {
    let (world, victim) = (3, 1);
    let dir = fresh_dir("killed");
    std::fs::create_dir_all(&dir).expect("temp dir");
    /// Removes the job's folder however the test ends.
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Remove(dir.clone());
    let mut job = RankJob::new(env!("CARGO_BIN_EXE_shard_worker"), world)
        .args([
            "--optim",
            "adam",
            "--shard",
            "--report-steps",
            "--hidden",
            "64",
        ])
        .args(["--steps", "100000000"])
        .arg("--out")
        .arg(&dir)
        // Only the dead connection, not this timeout, can end the survivors in time.
        .env("DDP_TIMEOUT_SECS", "100")
        .env("RAYON_NUM_THREADS", "1")
        .deadline(Duration::from_secs(150))
        .spawn()
        .expect("spawn shard_worker");
    let all: Vec<usize> = (0..world).collect();
    assert!(
        job.wait_for_output(&all, "STEP 5", Duration::from_secs(90)),
        "the ranks did not reach step 5:\n{}",
        all.iter()
            .map(|&r| job.output_so_far(r))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let killed_at = job.kill(victim).expect("kill");
    let res = job.wait();
    for r in res.ranks.iter().filter(|r| r.rank != victim) {
        assert!(
            r.code().is_some_and(|c| c != 0),
            "rank {} must fail:\n{}",
            r.rank,
            res.report()
        );
        assert!(
            r.stderr.contains(&format!("rank {victim}")),
            "rank {}'s error must name rank {victim}:\n{}",
            r.rank,
            res.report()
        );
        assert!(
            !r.stderr.contains("panicked at") && r.stderr.contains("shard_worker"),
            "rank {} must print one error line, not a panic report:\n{}",
            r.rank,
            res.report()
        );
    }
    res.assert_others_exited_within(victim, killed_at, Duration::from_secs(10));
}
