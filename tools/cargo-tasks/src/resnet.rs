//! The ResNet-18 benchmark's launch description, shared by the two tools that run it: `cargo
//! xtask bench resnet` (ddp-bench-runs, which builds and launches the programs here) and
//! `gpu-check run`'s ResNet row (cuda-tools, on the GPU machine). Both programs, `train-cnn
//! bench` (the Burn side) and `scripts/resnet18_torch.py` (the PyTorch side), take the arguments
//! of [`ResnetRuns::program_args`] and print one `RESNET {json}` line, which [`parse`] reads and
//! [`table`] prints as one table with its ratios.

use serde::Deserialize;

/// The settings of one `bench resnet`.
#[derive(Debug, Clone)]
pub struct ResnetRuns {
    /// Ranks of the distributed rows.
    pub nproc: u32,
    /// Images per rank and step.
    pub batch: usize,
    /// Timed steps per row.
    pub steps: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// `cpu` or `cuda` (`cargo xtask bench resnet`); `train-cnn bench` also takes `burn-cpu`,
    /// which `bench resnet --device cpu` runs beside Flex.
    pub device: String,
    /// Leave PyTorch out (no install, Burn's rows only).
    pub no_torch: bool,
}

impl ResnetRuns {
    /// The arguments both programs take for these settings (`--device`, `--batch`, `--steps`,
    /// `--warmup`).
    pub fn program_args(&self) -> Vec<String> {
        vec![
            "--device".into(),
            self.device.clone(),
            "--batch".into(),
            self.batch.to_string(),
            "--steps".into(),
            self.steps.to_string(),
            "--warmup".into(),
            self.warmup.to_string(),
        ]
    }
}

/// What one row's rank 0 printed after `RESNET `.
#[derive(Debug, Clone, Deserialize)]
pub struct Measured {
    framework: String,
    version: String,
    mode: String,
    ranks: usize,
    norm: String,
    /// `cpu` (Flex for Burn's rows), `burn-cpu` or `cuda`.
    #[serde(default)]
    device: String,
    batch: usize,
    step_ms: f64,
    no_sync_ms: Option<f64>,
    own_sync_ms: Option<f64>,
}

impl Measured {
    fn images_per_s(&self) -> f64 {
        (self.batch * self.ranks) as f64 / self.step_ms * 1e3
    }

    /// What a step waits for the gradient synchronisation: the step minus the step without it.
    fn waited_sync_ms(&self) -> Option<f64> {
        self.no_sync_ms.map(|n| (self.step_ms - n).max(0.0))
    }

    /// The table's first column: the framework, and the backend where Burn has two on the CPU.
    fn framework_name(&self) -> String {
        let backend = match (self.framework.as_str(), self.device.as_str()) {
            (_, "burn-cpu") => " (burn-cpu)",
            ("Burn" | "burn-ddp", "cpu") => " (Flex)",
            _ => "",
        };
        format!("{} {}{backend}", self.framework, self.version)
    }

    fn run_name(&self) -> String {
        match self.mode.as_str() {
            "alone" if self.framework == "PyTorch" => "eager, no DDP".into(),
            "alone" => "alone, no burn-ddp".into(),
            _ => format!("DDP, {} rank(s)", self.ranks),
        }
    }
}

/// Rank 0's `RESNET` line in a program's output.
///
/// # Errors
/// No such line, or one that does not parse.
pub fn parse(stdout: &str) -> Result<Measured, String> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESNET "))
        .ok_or_else(|| format!("no RESNET line in: {stdout}"))?;
    serde_json::from_str(line).map_err(|e| format!("the RESNET line {line:?}: {e}"))
}

fn ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.1}"))
}

/// The markdown table and the ratios, each measured in this run.
pub fn table(r: &ResnetRuns, rows: &[Measured]) -> String {
    let mut s = format!(
        "\n## ResNet-18 (CIFAR layout, 11,173,962 parameters), 3×32×32 synthetic images, batch {} \
         per rank, SGD momentum 0.9, {}: medians of {} steps after {} warm-up\n\n",
        r.batch, r.device, r.steps, r.warmup
    );
    s += "| framework | run | norm | ms/step | images/s | step without gradient sync, ms | \
          sync the step waits for, ms | burn-ddp's own sync clock, ms |\n";
    s += "|---|---|---|---:|---:|---:|---:|---:|\n";
    for m in rows {
        s += &format!(
            "| {} | {} | {} | {:.1} | {:.1} | {} | {} | {} |\n",
            m.framework_name(),
            m.run_name(),
            m.norm,
            m.step_ms,
            m.images_per_s(),
            ms(m.no_sync_ms),
            ms(m.waited_sync_ms()),
            ms(m.own_sync_ms),
        );
    }
    if r.device == "cpu" {
        s += "\nPyTorch has no SyncBatchNorm row on the CPU: its SyncBatchNorm runs on GPUs only \
              (\"SyncBatchNorm layers only work with GPU modules\").\n";
    }
    s += "\n";
    let find_on = |device: &str, framework: &str, mode: &str, ranks: usize, norm: &str| {
        rows.iter().find(|m| {
            m.framework == framework
                && m.mode == mode
                && m.ranks == ranks
                && m.norm == norm
                && (m.device == device || device != "burn-cpu" && m.device != "burn-cpu")
        })
    };
    // Flex's rows (or CUDA's) and PyTorch's; burn-cpu's have their own lines below.
    let find = |framework: &str, mode: &str, ranks: usize, norm: &str| {
        find_on(&r.device, framework, mode, ranks, norm)
    };
    let n = r.nproc as usize;
    let ratio = |a: Option<&Measured>, b: Option<&Measured>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.3}", a.step_ms / b.step_ms),
        _ => "–".into(),
    };
    let bn = "BatchNorm";
    let sbn = "SyncBatchNorm";
    s += &format!(
        "- DDP overhead (world of one ÷ alone, step time): burn-ddp {}, PyTorch {}\n",
        ratio(find("burn-ddp", "ddp", 1, bn), find("Burn", "alone", 1, bn)),
        ratio(
            find("PyTorch", "ddp", 1, bn),
            find("PyTorch", "alone", 1, bn)
        ),
    );
    s += &format!(
        "- SyncBatchNorm overhead at {n} ranks (SyncBatchNorm ÷ BatchNorm): burn-ddp {}, PyTorch {}\n",
        ratio(
            find("burn-ddp", "ddp", n, sbn),
            find("burn-ddp", "ddp", n, bn)
        ),
        ratio(
            find("PyTorch", "ddp", n, sbn),
            find("PyTorch", "ddp", n, bn)
        ),
    );
    s += &format!(
        "- burn-ddp ÷ PyTorch at {n} ranks, step time: BatchNorm {}, SyncBatchNorm {}; one \
         process alone: {}\n",
        ratio(
            find("burn-ddp", "ddp", n, bn),
            find("PyTorch", "ddp", n, bn)
        ),
        ratio(
            find("burn-ddp", "ddp", n, sbn),
            find("PyTorch", "ddp", n, sbn)
        ),
        ratio(
            find("Burn", "alone", 1, bn),
            find("PyTorch", "alone", 1, bn)
        ),
    );
    s += &format!(
        "- gradient sync a step waits for at {n} ranks (BatchNorm): burn-ddp {} ms, PyTorch {} ms\n",
        ms(find("burn-ddp", "ddp", n, bn).and_then(Measured::waited_sync_ms)),
        ms(find("PyTorch", "ddp", n, bn).and_then(Measured::waited_sync_ms)),
    );
    if rows.iter().any(|m| m.device == "burn-cpu") {
        let cpu = |framework: &str, mode: &str, ranks: usize, norm: &str| {
            find_on("burn-cpu", framework, mode, ranks, norm)
        };
        s += &format!(
            "- burn-cpu ÷ Flex, step time: alone {}, world of one {}, {n} ranks BatchNorm {}, \
             {n} ranks SyncBatchNorm {}\n",
            ratio(cpu("Burn", "alone", 1, bn), find("Burn", "alone", 1, bn)),
            ratio(
                cpu("burn-ddp", "ddp", 1, bn),
                find("burn-ddp", "ddp", 1, bn)
            ),
            ratio(
                cpu("burn-ddp", "ddp", n, bn),
                find("burn-ddp", "ddp", n, bn)
            ),
            ratio(
                cpu("burn-ddp", "ddp", n, sbn),
                find("burn-ddp", "ddp", n, sbn)
            ),
        );
        s += &format!(
            "- on burn-cpu: DDP overhead {}, SyncBatchNorm overhead at {n} ranks {}; one process \
             alone ÷ PyTorch's {}\n",
            ratio(cpu("burn-ddp", "ddp", 1, bn), cpu("Burn", "alone", 1, bn)),
            ratio(
                cpu("burn-ddp", "ddp", n, sbn),
                cpu("burn-ddp", "ddp", n, bn)
            ),
            ratio(cpu("Burn", "alone", 1, bn), find("PyTorch", "alone", 1, bn)),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_from_both_programs_make_one_table_with_ratios() {
        let burn = parse(
            "noise\nRESNET {\"framework\":\"burn-ddp\",\"version\":\"0.1.0\",\"mode\":\"ddp\",\
             \"ranks\":2,\"norm\":\"BatchNorm\",\"device\":\"cpu\",\"batch\":8,\"size\":32,\
             \"steps\":10,\"step_ms\":200.0,\"no_sync_ms\":150.0,\"own_sync_ms\":40.0}\n",
        )
        .unwrap();
        let torch = parse(
            "RESNET {\"framework\":\"PyTorch\",\"version\":\"2.15.0\",\"mode\":\"ddp\",\
             \"ranks\":2,\"norm\":\"BatchNorm\",\"device\":\"cpu\",\"batch\":8,\"size\":32,\
             \"steps\":10,\"step_ms\":100.0,\"no_sync_ms\":120.0,\"own_sync_ms\":null,\
             \"threads\":1}",
        )
        .unwrap();
        assert_eq!(burn.waited_sync_ms(), Some(50.0));
        assert_eq!(torch.waited_sync_ms(), Some(0.0));
        let r = ResnetRuns {
            nproc: 2,
            batch: 8,
            steps: 10,
            warmup: 3,
            device: "cpu".into(),
            no_torch: false,
        };
        let on_burn_cpu = parse(
            "RESNET {\"framework\":\"burn-ddp\",\"version\":\"0.1.0\",\"mode\":\"ddp\",\
             \"ranks\":2,\"norm\":\"BatchNorm\",\"device\":\"burn-cpu\",\"batch\":8,\"size\":32,\
             \"steps\":10,\"step_ms\":300.0,\"no_sync_ms\":250.0,\"own_sync_ms\":40.0}",
        )
        .unwrap();
        let t = table(&r, &[burn, on_burn_cpu, torch]);
        assert!(t.contains("| burn-ddp 0.1.0 (Flex) | DDP, 2 rank(s) | BatchNorm | 200.0 | 80.0 | 150.0 | 50.0 | 40.0 |"), "{t}");
        assert!(
            t.contains("| burn-ddp 0.1.0 (burn-cpu) | DDP, 2 rank(s) | BatchNorm | 300.0 |"),
            "{t}"
        );
        assert!(t.contains("2 ranks BatchNorm 1.500"), "{t}");
        assert!(
            t.contains("burn-ddp ÷ PyTorch at 2 ranks, step time: BatchNorm 2.000"),
            "{t}"
        );
        assert!(
            t.contains("waits for at 2 ranks (BatchNorm): burn-ddp 50.0 ms, PyTorch 0.0 ms"),
            "{t}"
        );
        assert!(parse("RESNET {").is_err());
        assert!(parse("nothing").is_err());
    }
}
