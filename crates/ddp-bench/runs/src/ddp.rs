//! `cargo xtask bench ddp`: `ddp_bench` alone (the compute baseline) and on N ranks per
//! transport (TCP: every rank its own emulated host).

use std::process::Command;

use cargo_tasks::run;

/// `cargo xtask bench ddp`: the same rank program alone (the baseline) and on `nproc` ranks,
/// per transport; every run compares the `compression` wire formats.
///
/// # Errors
/// An unknown transport, a failed build or a failed run.
pub fn run_ddp(
    nproc: u32,
    transports: &[String],
    compression: &[String],
    extra: &[String],
) -> Result<(), String> {
    crate::check_transports(transports)?;
    let release = crate::build_with_ddprun("ddp_bench", false)?;
    let bench = release.join("ddp_bench");
    let wire = ["--compression".to_string(), compression.join(",")];
    println!("\n## 1 rank (no communication: the compute baseline)\n");
    run(Command::new(&bench).args(&wire).args(extra))?;
    for t in transports {
        println!("\n## {nproc} ranks, {t}\n");
        let mut cmd = Command::new(release.join("ddprun"));
        cmd.arg("--nproc-per-node")
            .arg(nproc.to_string())
            .arg("--no-prefix")
            .arg("--");
        if t == "tcp" {
            // Every rank its own host identity: the group connects them over TCP (loopback).
            cmd.args([
                "sh",
                "-c",
                "DDP_HOST_ID=emulated-host-$RANK exec \"$@\"",
                "sh",
            ]);
        }
        run(cmd.arg(&bench).args(&wire).args(extra))?;
    }
    Ok(())
}
