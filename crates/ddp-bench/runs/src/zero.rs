//! `cargo xtask bench zero`: the sharded optimizer (ZeRO stage 1) against the unsharded one,
//! per world size: step time, optimizer-state bytes and peak memory per rank, with ratios
//! against the unsharded run of the same size measured in the same invocation.

use std::process::Command;

use serde::Deserialize;

/// What `zero_bench`'s rank 0 prints after `ZERO `.
#[derive(Debug, Clone, Deserialize)]
struct Measured {
    mode: String,
    ranks: usize,
    params: usize,
    batch: usize,
    step_ms: f64,
    /// Rank 0's median times of the step's parts (absent from an older rank program).
    #[serde(default)]
    backward_ms: f64,
    #[serde(default)]
    sync_ms: f64,
    #[serde(default)]
    optimizer_ms: f64,
    #[serde(default)]
    gather_ms: f64,
    /// Live recovery's copies of the shards (absent from an older rank program).
    #[serde(default)]
    copies_ms: f64,
    state_bytes: Vec<u64>,
    peak_rss_bytes: Vec<u64>,
}

/// Runs `zero_bench` unsharded, sharded, and (on more than one rank) sharded with live
/// recovery's copies of the shards (`--live-copies` under `ddprun --recover live`) at each of
/// `nprocs` ranks, and prints the table.
pub fn run(nprocs: &[u32], extra: &[String]) -> Result<(), String> {
    let release = crate::build_with_ddprun("zero_bench", false)?;
    let mut rows = Vec::new();
    for &n in nprocs {
        let modes: &[(bool, bool)] = if n > 1 {
            &[(false, false), (true, false), (true, true)]
        } else {
            &[(false, false), (true, false)]
        };
        for &(shard, copies) in modes {
            let mut cmd = if n > 1 {
                let mut c = Command::new(release.join("ddprun"));
                c.args(["--nproc-per-node", &n.to_string(), "--no-prefix"]);
                if copies {
                    c.args(["--recover", "live", "--max-restarts", "1"]);
                }
                c.arg("--").arg(release.join("zero_bench"));
                c
            } else {
                Command::new(release.join("zero_bench"))
            };
            if shard {
                cmd.arg("--shard");
            }
            if copies {
                cmd.arg("--live-copies");
            }
            cmd.args(extra);
            eprintln!(
                "bench zero: {n} rank(s), {}",
                match (shard, copies) {
                    (false, _) => "unsharded",
                    (true, false) => "sharded",
                    (true, true) => "sharded, live-recovery copies",
                }
            );
            let out = cmd
                .output()
                .map_err(|e| format!("cannot run zero_bench: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "zero_bench on {n} rank(s) failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            rows.push(parse(&String::from_utf8_lossy(&out.stdout))?);
        }
    }
    print!("{}", table(&rows));
    Ok(())
}

fn parse(stdout: &str) -> Result<Measured, String> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("ZERO "))
        .ok_or_else(|| format!("zero_bench printed no ZERO line: {stdout}"))?;
    serde_json::from_str(line).map_err(|e| format!("zero_bench's ZERO line {line:?}: {e}"))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// The markdown table: one row per run, ratios against the unsharded run of the same size.
fn table(rows: &[Measured]) -> String {
    let mut s = String::new();
    if let Some(r) = rows.first() {
        s += &format!(
            "\n## Optimizer state sharded (ZeRO-1) vs not: Adam, {:.1} M parameters, batch {} per rank, CPU ranks\n\n",
            r.params as f64 / 1e6,
            r.batch
        );
    }
    s += "| ranks | optimizer | step ms (median) | vs unsharded | optimizer state per rank, MiB (max) | vs unsharded | peak RSS per rank, MiB (max) | vs unsharded |\n";
    s += "|---|---|---|---|---|---|---|---|\n";
    for r in rows {
        let base = rows
            .iter()
            .find(|b| b.ranks == r.ranks && b.mode == "unsharded")
            .unwrap_or(r);
        let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        s += &format!(
            "| {} | {} | {:.1} | {:.3} | {:.1} | {:.3} | {:.1} | {:.3} |\n",
            r.ranks,
            r.mode,
            r.step_ms,
            ratio(r.step_ms, base.step_ms),
            mib(max(&r.state_bytes)),
            ratio(max(&r.state_bytes) as f64, max(&base.state_bytes) as f64),
            mib(max(&r.peak_rss_bytes)),
            ratio(
                max(&r.peak_rss_bytes) as f64,
                max(&base.peak_rss_bytes) as f64
            ),
        );
    }
    for copies in rows
        .iter()
        .filter(|r| r.mode == "sharded, live-recovery copies")
    {
        if let Some(sharded) = rows
            .iter()
            .find(|b| b.ranks == copies.ranks && b.mode == "sharded")
        {
            s += &format!(
                "\n{} ranks: the sharded step with live recovery's copies is {:.3} × the sharded \
                 step without them.\n",
                copies.ranks,
                copies.step_ms / sharded.step_ms
            );
        }
    }
    s += "\nWhere rank 0's step goes (medians, ms):\n\n";
    s += "| ranks | optimizer | backward | gradient sync | optimizer step | parameter all-gather | shard copies (live recovery) |\n";
    s += "|---|---|---|---|---|---|---|\n";
    for r in rows {
        s += &format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            r.ranks, r.mode, r.backward_ms, r.sync_ms, r.optimizer_ms, r.gather_ms, r.copies_ms
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_ratios_against_the_unsharded_run_of_the_same_size() {
        let out = "noise\nZERO {\"mode\":\"unsharded\",\"ranks\":2,\"params\":1000000,\"batch\":8,\"step_ms\":100.0,\"state_bytes\":[800,800],\"peak_rss_bytes\":[2097152,2097152]}\n";
        let a = parse(out).unwrap();
        let b = Measured {
            mode: "sharded".into(),
            step_ms: 104.0,
            state_bytes: vec![400, 400],
            ..a.clone()
        };
        let t = table(&[a, b]);
        assert!(t.contains("| 2 | unsharded | 100.0 | 1.000 |"), "{t}");
        assert!(
            t.contains("| 2 | sharded | 104.0 | 1.040 | 0.0 | 0.500 | 2.0 | 1.000 |"),
            "{t}"
        );
        assert!(parse("nothing").is_err());
        let c = Measured {
            mode: "sharded, live-recovery copies".into(),
            step_ms: 130.0,
            ..parse(out).unwrap()
        };
        let sharded = Measured {
            mode: "sharded".into(),
            step_ms: 104.0,
            ..parse(out).unwrap()
        };
        let t = table(&[sharded, c]);
        assert!(
            t.contains("2 ranks: the sharded step with live recovery's copies is 1.250 × the sharded step without them."),
            "{t}"
        );
    }

    #[test]
    fn the_step_s_parts_get_a_table_of_their_own() {
        let out = "ZERO {\"mode\":\"sharded\",\"ranks\":4,\"params\":10,\"batch\":8,\"step_ms\":9.0,\"backward_ms\":1.0,\"sync_ms\":2.0,\"optimizer_ms\":3.5,\"gather_ms\":2.25,\"copies_ms\":0.5,\"state_bytes\":[1],\"peak_rss_bytes\":[1]}";
        let t = table(&[parse(out).unwrap()]);
        assert!(
            t.contains("| 4 | sharded | 1.0 | 2.0 | 3.5 | 2.2 | 0.5 |"),
            "{t}"
        );
    }
}
