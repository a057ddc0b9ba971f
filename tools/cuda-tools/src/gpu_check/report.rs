//! The one table `gpu-check run` prints: a header about the machine, one row per check
//! (result, seconds taken, seconds allowed, a note), then the `BENCH |` / `OUTCOME` lines the
//! checks printed and an excerpt of each failure. Also the pure helpers that read a check's
//! log.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

/// What a CUDA driver answers when it cannot load a PTX module, as the programs print it
/// (cubecl-cuda: `Unable to load the PTX: DriverError(CUDA_ERROR_INVALID_PTX, …)`).
const PTX_REFUSALS: [&str; 4] = [
    "CUDA_ERROR_INVALID_PTX",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
    "Unable to load the PTX",
];

/// The line of a check's log that says the driver refused a PTX module, if one does.
pub fn ptx_refusal(log: &str) -> Option<&str> {
    log.lines()
        .find(|l| PTX_REFUSALS.iter().any(|r| l.contains(r)))
        .map(str::trim)
}

/// The result of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The check ran and passed.
    Pass,
    /// The check ran (or could not run: no driver) and failed.
    Fail,
    /// The check ran past its limit and was killed.
    Timeout,
    /// The bundle lacks the check's binary.
    Missing,
    /// Not run: needs more GPUs than visible, or the time budget is spent.
    Skipped,
}

impl Status {
    /// The word in the table.
    pub fn word(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Timeout => "TIMEOUT",
            Status::Missing => "MISSING",
            Status::Skipped => "SKIPPED",
        }
    }

    /// Whether this row makes the run fail (everything but PASS and SKIPPED).
    pub fn is_failure(self) -> bool {
        !matches!(self, Status::Pass | Status::Skipped)
    }
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// What was checked (`LABEL::test_name` for one test of a test binary).
    pub label: String,
    /// The result.
    pub status: Status,
    /// Seconds the check ran (`None`: it did not run).
    pub secs: Option<f64>,
    /// Seconds it was allowed (`None`: it did not run).
    pub limit: Option<u64>,
    /// A short note: the first `OUTCOME`, the panic message, why it was skipped, ….
    pub note: String,
}

/// Everything `run` prints.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Lines above the table (machine, driver, libraries, settings).
    pub header: Vec<String>,
    /// The rows, in the order run.
    pub rows: Vec<Row>,
    /// Lines below the table: BENCH/OUTCOME lines, ldd problems, failure excerpts.
    pub notes: Vec<String>,
    /// Put before the label of every row added from now on (the fallback bundle's rows).
    pub label_prefix: String,
}

impl Report {
    /// Whether any row failed (FAIL, TIMEOUT or MISSING).
    pub fn failed(&self) -> bool {
        self.rows.iter().any(|r| r.status.is_failure())
    }

    /// The report as Markdown: `## title`, the header lines, the table, the notes and the
    /// final verdict (`gpu-check: ALL PASSED` or `gpu-check: FAILURES (…)`).
    pub fn render(&self, title: &str, verdict_detail: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "\n## {title}");
        for h in &self.header {
            let _ = writeln!(s, "{h}");
        }
        s.push('\n');
        let width = self
            .rows
            .iter()
            .map(|r| r.label.chars().count())
            .chain([58])
            .max()
            .unwrap_or(58);
        let line = |s: &mut String, a: &str, b: &str, c: &str, d: &str, e: &str| {
            let _ = writeln!(s, "| {a:<width$} | {b:<7} | {c:>7} | {d:>5} | {e} |");
        };
        line(&mut s, "check", "result", "seconds", "limit", "note");
        let _ = writeln!(
            s,
            "|{}|{}|{}|{}|{}|",
            "-".repeat(width + 2),
            "-".repeat(9),
            "-".repeat(9),
            "-".repeat(7),
            "-".repeat(6)
        );
        for r in &self.rows {
            let secs = r.secs.map_or("-".to_string(), |t| format!("{t:.1}"));
            let limit = r.limit.map_or("-".to_string(), |t| t.to_string());
            line(
                &mut s,
                &r.label,
                r.status.word(),
                &secs,
                &limit,
                &r.note.replace('|', "/"),
            );
        }
        if !self.notes.is_empty() {
            s.push('\n');
            for n in &self.notes {
                let _ = writeln!(s, "{n}");
            }
        }
        s.push('\n');
        let counts = |st: Status| self.rows.iter().filter(|r| r.status == st).count();
        if self.failed() {
            let _ = writeln!(
                s,
                "gpu-check: FAILURES ({} passed, {} failed, {} timed out, {} missing, {} skipped; {verdict_detail})",
                counts(Status::Pass),
                counts(Status::Fail),
                counts(Status::Timeout),
                counts(Status::Missing),
                counts(Status::Skipped),
            );
        } else {
            let _ = writeln!(
                s,
                "gpu-check: ALL PASSED ({} passed, {} skipped)",
                counts(Status::Pass),
                counts(Status::Skipped)
            );
        }
        s
    }
}

/// Every `BENCH |…` and `OUTCOME…` from its start to the end of its line (libtest may print
/// `test NAME ... ` before it on the same line).
pub fn bench_and_outcome_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| {
            let at = [l.find("BENCH |"), l.find("OUTCOME")]
                .into_iter()
                .flatten()
                .min()?;
            Some(l[at..].trim_end().to_string())
        })
        .collect()
}

/// The text of the first `OUTCOME` line, without the word (the note of a passing test).
pub fn first_outcome(log: &str) -> Option<String> {
    log.lines().find_map(|l| {
        let at = l.find("OUTCOME")?;
        Some(cut(l[at + "OUTCOME".len()..].trim(), 120))
    })
}

/// The line after the first `panicked at` (Rust prints the message there), cut to 120
/// characters.
pub fn panic_message(log: &str) -> Option<String> {
    let mut lines = log.lines();
    lines.find(|l| l.contains("panicked at"))?;
    lines.next().map(|l| cut(l.trim(), 120))
}

/// What a failure shows below the table: the panic and 4 lines after it, or else the log's
/// last 10 lines; each cut to 400 characters and indented.
pub fn failure_excerpt(log: &str) -> Vec<String> {
    let lines: Vec<&str> = log.lines().collect();
    let part = match lines.iter().position(|l| l.contains("panicked at")) {
        Some(i) => &lines[i..(i + 5).min(lines.len())],
        None => &lines[lines.len().saturating_sub(10)..],
    };
    part.iter()
        .map(|l| format!("    {}", cut(l, 400)))
        .collect()
}

/// `s` cut to at most `max` characters.
pub fn cut(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

/// The time now as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    utc(secs)
}

/// `secs` after the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The line printed as soon as row number `n` ends: `gpu-check: [n] PASS  12.3 s  label — note`.
pub fn progress_line(n: usize, row: &Row) -> String {
    let secs = row.secs.map_or("-".to_string(), |t| format!("{t:.1} s"));
    let note = if row.note.is_empty() {
        String::new()
    } else {
        format!(" — {}", cut(&row.note, 160))
    };
    format!(
        "gpu-check: [{n}] {:<7} {secs:>8}  {}{note}",
        row.status.word(),
        row.label
    )
}

/// NCCL's own log lines (`host:pid:tid NCCL WARN …`, `… NCCL INFO …`), the first `max`.
pub fn nccl_lines(log: &str, max: usize) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(" NCCL WARN ") || l.contains(" NCCL INFO "))
        .take(max)
        .map(|l| cut(l.trim(), 200))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(label: &str, status: Status, secs: Option<f64>, note: &str) -> Row {
        Row {
            label: label.into(),
            status,
            secs,
            limit: secs.map(|_| 150),
            note: note.into(),
        }
    }

    #[test]
    fn the_table_has_one_line_per_row_and_a_verdict() {
        let report = Report {
            header: vec!["GPU: none".into()],
            rows: vec![
                row("a::first", Status::Pass, Some(1.25), "loss 0.1 | 0.2"),
                row(
                    "b",
                    Status::Skipped,
                    None,
                    "needs 2 CUDA devices (1 visible)",
                ),
            ],
            notes: vec!["BENCH | x | 1 |".into()],
            ..Report::default()
        };
        assert!(!report.failed());
        let text = report.render("burn-ddp GPU check", "logs in /tmp/x");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"## burn-ddp GPU check"));
        assert!(lines.contains(&"GPU: none"));
        let first = lines.iter().find(|l| l.starts_with("| a::first")).unwrap();
        assert!(
            first.contains("| PASS    |     1.2 |   150 | loss 0.1 / 0.2 |"),
            "{first}"
        );
        let skipped = lines.iter().find(|l| l.starts_with("| b ")).unwrap();
        assert!(
            skipped.contains("| SKIPPED |       - |     - | needs 2"),
            "{skipped}"
        );
        // Every table line has the same width up to the note column.
        let table: Vec<&&str> = lines.iter().filter(|l| l.starts_with('|')).collect();
        assert_eq!(table.len(), 4);
        let note_col = table[0].rfind("| note").unwrap();
        assert!(
            table[2..]
                .iter()
                .all(|l| l.find("| loss").or(l.find("| needs")) == Some(note_col))
        );
        assert!(lines.contains(&"BENCH | x | 1 |"));
        assert_eq!(
            lines.last(),
            Some(&"gpu-check: ALL PASSED (1 passed, 1 skipped)")
        );
    }

    #[test]
    fn any_fail_timeout_or_missing_row_fails_the_run() {
        for bad in [Status::Fail, Status::Timeout, Status::Missing] {
            let report = Report {
                rows: vec![
                    row("ok", Status::Pass, Some(1.0), ""),
                    row("bad", bad, None, ""),
                ],
                ..Report::default()
            };
            assert!(report.failed());
            let text = report.render("t", "logs in /tmp/l");
            assert!(text.trim_end().ends_with("logs in /tmp/l)"), "{text}");
            assert!(text.contains("gpu-check: FAILURES (1 passed"), "{text}");
        }
    }

    #[test]
    fn logs_are_read_for_bench_outcome_and_panics() {
        let log = "running 1 test\n\
                   test kernels ... OUTCOME f32 max error 1e-6\n\
                   BENCH | shm, 2 ranks | 1M | 12 us |\n\
                   thread 'main' panicked at tests/x.rs:3:5:\n\
                   assertion failed: ok\n\
                   a\nb\nc\nd\n";
        assert_eq!(
            bench_and_outcome_lines(log),
            [
                "OUTCOME f32 max error 1e-6",
                "BENCH | shm, 2 ranks | 1M | 12 us |"
            ]
        );
        assert_eq!(first_outcome(log).as_deref(), Some("f32 max error 1e-6"));
        assert_eq!(panic_message(log).as_deref(), Some("assertion failed: ok"));
        let ex = failure_excerpt(log);
        assert_eq!(ex.len(), 5);
        assert!(ex[0].starts_with("    thread 'main' panicked"));
        let plain: String = (0..20).map(|i| format!("line {i}\n")).collect();
        let ex = failure_excerpt(&plain);
        assert_eq!(ex.first().map(String::as_str), Some("    line 10"));
        assert_eq!(ex.len(), 10);
        assert_eq!(panic_message(&plain), None);
        assert_eq!(cut("ééé", 2), "éé");
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_767_225_599), "2025-12-31T23:59:59Z");
        assert_eq!(utc_now().len(), 20);
    }
}
