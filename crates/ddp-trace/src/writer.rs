//! Renders one rank's events as Chrome trace-event JSON (the format is described in the
//! [module docs](super)).

use std::collections::BTreeSet;
use std::io::{self, Write};

use super::ArgValue;
use super::clock::ClockSync;
use super::event::{Event, Kind};

/// What the file says besides the events.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Meta {
    pub rank: usize,
    /// The wall clock at the recorder's base instant, nanoseconds since the Unix epoch.
    pub base_wall_ns: i128,
    /// Added to every timestamp: this clock's offset to rank 0's.
    pub offset_us: i64,
    pub sync: Option<ClockSync>,
    pub dropped: u64,
    pub max_events: usize,
}

/// The value of `otherData.format` in rank files and merged files.
pub(super) const FORMAT: &str = "ddp-comm trace v1";

/// Writes `{"traceEvents":[metadata…, events…],"displayTimeUnit":"ms","otherData":{…}}`.
/// `events` are written in the order given (the recorder sorts them by start).
pub(super) fn write_trace(
    out: &mut impl Write,
    meta: &Meta,
    events: &[Event],
    threads: &[(u32, String)],
) -> io::Result<()> {
    let pid = meta.rank;
    out.write_all(b"{\"traceEvents\":[\n")?;
    let dropped = meta.dropped;
    write!(
        out,
        "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":0,\"args\":{{\"name\":\"rank {pid}\",\"dropped_events\":{dropped}}}}}"
    )?;
    write!(
        out,
        ",\n{{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":{pid},\"tid\":0,\"args\":{{\"sort_index\":{pid}}}}}"
    )?;
    if dropped > 0 {
        let label = format!("dropped {dropped} events (cap {})", meta.max_events);
        write!(
            out,
            ",\n{{\"name\":\"process_labels\",\"ph\":\"M\",\"pid\":{pid},\"tid\":0,\"args\":{{\"labels\":{}}}}}",
            json_str(&label)
        )?;
    }
    let used: BTreeSet<u32> = events.iter().map(|e| e.tid).collect();
    for (tid, name) in threads.iter().filter(|(t, _)| used.contains(t)) {
        write!(
            out,
            ",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"name\":{}}}}}",
            json_str(name)
        )?;
        write!(
            out,
            ",\n{{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"sort_index\":{tid}}}}}"
        )?;
    }
    let shift_ns = meta.base_wall_ns + i128::from(meta.offset_us) * 1000;
    for e in events {
        write!(
            out,
            ",\n{{\"name\":{},\"cat\":{},",
            json_str(e.name),
            json_str(e.cat)
        )?;
        let ts = Micros(shift_ns + i128::from(e.start_ns));
        match e.kind {
            Kind::Complete => {
                let dur = Micros(i128::from(e.dur_ns));
                write!(out, "\"ph\":\"X\",\"ts\":{ts},\"dur\":{dur},")?;
            }
            Kind::Instant => write!(out, "\"ph\":\"i\",\"s\":\"t\",\"ts\":{ts},")?,
        }
        write!(out, "\"pid\":{pid},\"tid\":{}", e.tid)?;
        if !e.args.is_empty() {
            write!(out, ",\"args\":{{")?;
            for (i, (k, v)) in e.args.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write!(out, "{}:", json_str(k))?;
                write_value(out, v)?;
            }
            out.write_all(b"}")?;
        }
        out.write_all(b"}")?;
    }
    let (offset, rtt, bound, rounds) = match meta.sync {
        Some(s) => (
            s.offset_us.to_string(),
            s.rtt_us.to_string(),
            s.bound_us.to_string(),
            s.rounds,
        ),
        None => ("null".into(), "null".into(), "null".into(), 0),
    };
    write!(
        out,
        "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{{\"format\":\"{FORMAT}\",\"rank\":{pid},\"clock_offset_us\":{},\"clock_sync_offset_us\":{offset},\"clock_rtt_us\":{rtt},\"clock_bound_us\":{bound},\"clock_rounds\":{rounds},\"events\":{},\"dropped_events\":{dropped},\"max_events\":{}}}}}\n",
        meta.offset_us,
        events.len(),
        meta.max_events
    )
}

/// Nanoseconds shown as microseconds with three decimals (exact, unlike an `f64`).
struct Micros(i128);

impl std::fmt::Display for Micros {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let n = self.0.unsigned_abs();
        write!(f, "{sign}{}.{:03}", n / 1000, n % 1000)
    }
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serialises")
}

fn write_value(out: &mut impl Write, v: &ArgValue) -> io::Result<()> {
    match v {
        ArgValue::Str(s) => out.write_all(json_str(s).as_bytes()),
        ArgValue::U64(n) => write!(out, "{n}"),
        ArgValue::I64(n) => write!(out, "{n}"),
        ArgValue::F64(x) if x.is_finite() => {
            // `{x:?}` keeps a decimal point, so the value reads back as a float.
            write!(out, "{x:?}")
        }
        ArgValue::F64(_) => out.write_all(b"null"),
        ArgValue::Bool(b) => write!(out, "{b}"),
    }
}
