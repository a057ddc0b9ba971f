//! The task rows that run several NCCL ranks on the one GPU a machine has, each rank an
//! emulated GPU host (`ddprun --emulate-gpu-hosts`: its own `NCCL_HOSTID`, NCCL's socket
//! transport on loopback): train-cnn end to end at 2 and 4 ranks, and the ResNet-18 benchmark
//! with PyTorch beside it, launched the same way.

use std::path::Path;

use cargo_tasks::resnet::{self, Measured, ResnetRuns};

use super::steps::{DDPRUN_TRAIN_ARGS, StepError, Steps, compare_epochs, last_epoch};

/// How far ZeRO-1's losses on NCCL may be from the unsharded run's (relative): the same
/// optimisation, but NCCL's reductions are not promised bitwise between the two layouts.
const SHARDED_VS_UNSHARDED_TOLERANCE: f64 = 1e-3;

/// [`super::Task::EmulatedHosts`]: `ddprun --nproc-per-node N --emulate-gpu-hosts -- train-cnn
/// --backend cuda --sync-bn` at 2 and 4 ranks with `DDP_NCCL=required`: gradients and
/// SyncBatchNorm statistics over NCCL between processes on one GPU; then 2 ranks with the
/// optimizer state sharded (ZeRO-1), whose losses must match the unsharded run's.
pub(super) fn emulated_hosts(s: &Steps) -> Result<(), StepError> {
    let train = s.bin("train-cnn").display().to_string();
    for (ranks, shard) in [("2", false), ("4", false), ("2", true)] {
        let out_dir = format!(
            "/tmp/gpu-check-emulated-{ranks}{}",
            if shard { "-sharded" } else { "" }
        );
        let shard_flag: &[&str] = if shard { &["--shard-optimizer"] } else { &[] };
        let mut args = vec![
            "--nproc-per-node",
            ranks,
            "--emulate-gpu-hosts",
            "--",
            &train,
        ];
        args.extend(DDPRUN_TRAIN_ARGS);
        args.extend(["--seed", "7", "--out", &out_dir]);
        args.extend(shard_flag);
        let out = s.run_ok(
            &s.bin("ddprun"),
            &args,
            &[("DDP_NCCL", "required"), ("RUST_LOG", "burn_ddp=info")],
        )?;
        for (needle, what) in [
            ("emulated GPU hosts", "ddprun's first line"),
            ("emulated GPU host \"gpu-host-1\"", "rank 1's announcement"),
            (
                "all-reduced by NCCL",
                "an NCCL communicator between the ranks",
            ),
        ] {
            if !out.contains(needle) {
                return Err(format!("{ranks} ranks: no {what} ({needle:?} not in the log)").into());
            }
        }
        if shard {
            let unsharded = last_epoch(Path::new("/tmp/gpu-check-emulated-2"))?;
            let sharded = last_epoch(Path::new(&out_dir))?;
            let (lines, worst) = compare_epochs(
                ("sharded", &sharded),
                ("unsharded", &unsharded),
                SHARDED_VS_UNSHARDED_TOLERANCE,
            )?;
            for l in &lines {
                s.line(&l.replace("OUTCOME ", "OUTCOME ZeRO-1 on NCCL, 2 ranks: "));
            }
            if worst > SHARDED_VS_UNSHARDED_TOLERANCE {
                return Err(format!(
                    "ZeRO-1 on NCCL: losses {worst:.1e} (relative) from the unsharded run's, \
                     above {SHARDED_VS_UNSHARDED_TOLERANCE}"
                )
                .into());
            }
            continue;
        }
        s.line(&format!(
            "OUTCOME ddprun {ranks} ranks on one GPU (emulated GPU hosts): train-cnn trained, \
             gradients and SyncBatchNorm statistics over NCCL"
        ));
    }
    Ok(())
}

/// [`super::Task::ResnetBench`]: ResNet-18 steps on the GPU: Burn alone, burn-ddp in a world of
/// one and on 2 ranks sharing the GPU (emulated GPU hosts), BatchNorm and SyncBatchNorm; the
/// same for PyTorch (eager, DDP under ddprun with the same variables) where python3 imports
/// torch. One BENCH table, printed also when a run fails or the row's deadline cuts it: then
/// it holds the rows measured before, and an OUTCOME line says it is partial.
pub(super) fn resnet_bench(s: &Steps) -> Result<(), StepError> {
    // A batch of 128 images of 3 × 32 × 32 per rank.
    let r = ResnetRuns {
        nproc: 2,
        batch: 128,
        steps: 20,
        warmup: 5,
        device: "cuda".into(),
        no_torch: false,
    };
    let mut rows = Vec::new();
    let result = resnet_rows(s, &r, &mut rows);
    if result.is_err() && !rows.is_empty() {
        s.line(&format!(
            "OUTCOME the ResNet table is partial: {} row(s) measured before a run failed or the \
             row's deadline came",
            rows.len()
        ));
    }
    if !rows.is_empty() {
        for line in resnet::table(&r, &rows).lines() {
            s.line(&format!("BENCH {line}"));
        }
    }
    result
}

/// The runs of [`resnet_bench`], Burn's first, each measured row pushed onto `rows` as it ends.
fn resnet_rows(s: &Steps, r: &ResnetRuns, rows: &mut Vec<Measured>) -> Result<(), StepError> {
    let common = r.program_args();
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let train = s.bin("train-cnn").display().to_string();
    let ddprun = s.bin("ddprun");
    let mut bench = |program: &Path, args: Vec<&str>| -> Result<(), StepError> {
        let out = s.run_ok(program, &args, &[("DDP_NCCL", "required")])?;
        rows.push(resnet::parse(&out)?);
        Ok(())
    };
    // Burn.
    let mut alone = vec!["bench", "--mode", "alone"];
    alone.extend(&common);
    bench(Path::new(&train), alone)?;
    for sync_bn in [false, true] {
        let extra: &[&str] = if sync_bn { &["--sync-bn"] } else { &[] };
        let mut one = vec!["bench"];
        one.extend(&common);
        one.extend(extra);
        bench(Path::new(&train), one)?;
        let mut two = vec![
            "--nproc-per-node",
            "2",
            "--emulate-gpu-hosts",
            "--no-prefix",
        ];
        two.extend(["--", train.as_str(), "bench"]);
        two.extend(&common);
        two.extend(extra);
        bench(&ddprun, two)?;
    }
    // PyTorch, where this machine's python3 has it.
    let script = s.bin("resnet18_torch.py");
    let script = script.display().to_string();
    let has_torch = Path::new(&script).is_file()
        && s.run(
            Path::new("python3"),
            &["-c", "import torch.distributed"],
            &[],
        )
        .is_ok_and(|(exit, _)| exit.success());
    if has_torch {
        let mut eager = vec![script.as_str()];
        eager.extend(&common);
        bench(Path::new("python3"), eager)?;
        for sync_bn in [false, true] {
            let extra: &[&str] = if sync_bn { &["--sync-bn"] } else { &[] };
            for (ranks, emulate) in [("1", None), ("2", Some("--emulate-gpu-hosts"))] {
                let mut args = vec!["--nproc-per-node", ranks, "--no-prefix"];
                args.extend(emulate);
                args.extend(["--", "python3", script.as_str(), "--ddp"]);
                args.extend(&common);
                args.extend(extra);
                bench(&ddprun, args)?;
            }
        }
    } else {
        s.line(
            "OUTCOME no torch in python3 here (or no resnet18_torch.py in the bundle): the \
             ResNet table has Burn's rows only",
        );
    }
    Ok(())
}
