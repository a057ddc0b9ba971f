//! Per-rank timelines in Chrome trace-event format (`DDP_TRACE=DIR`), the answer to "why is
//! multi-GPU slower than one GPU" that Horovod Timeline and the PyTorch profiler give.
//!
//! When the environment variable [`TRACE_VAR`] (`DDP_TRACE`) names a directory, every rank
//! records spans — every collective of `ddp_comm::ProcessGroup`, the rendezvous,
//! and whatever the program marks with [`span`] — and writes them to `DIR/rank-<R>.trace.json`
//! ([`rank_file_name`]). The launcher (`ddprun --trace DIR`, `ddprun::LaunchConfig::trace`) sets the
//! variable for its ranks and, when the job has ended, merges the rank files into
//! `DIR/trace.json` ([`merge_dir`]): one track per rank, on one clock. Open it in
//! <https://ui.perfetto.dev> or `chrome://tracing`.
//!
//! # Cost
//! With `DDP_TRACE` unset, [`enabled`] is one relaxed atomic load (the variable is read once,
//! on the first call) and [`span`] returns an inert guard: no clock read, no allocation, no
//! lock. With tracing on, a span costs two monotonic clock reads and one uncontended lock
//! when it ends (plus a `Vec` for its arguments, if it has any).
//!
//! # Clock
//! Spans are timed with [`std::time::Instant`] and placed on the wall clock
//! ([`std::time::SystemTime`]) sampled once when recording starts. When a process group forms
//! with tracing on, every rank measures its offset to rank 0's clock over the rendezvous store
//! (ping-pong rounds; the round with the smallest round trip wins, see [`estimate_offset`])
//! and shifts its timestamps by it, so the ranks' tracks line up in the merged file.
//!
//! # When the file is written
//! [`flush`] writes the file (all events so far; later flushes rewrite it). It also happens,
//! best-effort, when a `ddp_comm::ProcessGroup` is dropped, when the process
//! exits normally (returning from `main`, [`std::process::exit`], a panic that ends `main`),
//! and on SIGTERM — what the launcher sends the ranks it stops once another rank has failed —
//! if SIGTERM had its default action when tracing turned on: a watcher thread writes the file,
//! marked with a `sigterm` instant, then the process ends killed by SIGTERM as it would have.
//! A rank killed otherwise (SIGKILL, an abort, a segfault, a SIGTERM it handles itself) writes
//! nothing after its last flush; the launcher then merges the other ranks and names the
//! missing one. Call [`flush`] yourself (e.g. every N steps) to keep a partial timeline.
//!
//! # Restarts
//! A launcher that restarts the group (`ddprun --max-restarts`) points `DDP_TRACE` of restart
//! `K` at `DIR/attempt-K` ([`attempt_dir_name`]); the merge puts every attempt's ranks on
//! tracks of their own ([`track_pid`]), so the failure and the restart are on one timeline.
//!
//! # Several nodes
//! Each node's launcher merges the rank files it finds into `DIR/trace-node<N>.json`. The
//! clock offsets are measured to rank 0 across nodes too, so rank files gathered from all
//! nodes into one directory merge into one timeline: `ddprun --merge-trace DIR`, or
//! [`merge_dir`].
//!
//! # Memory
//! At most [`DEFAULT_MAX_EVENTS`] events are kept (or `DDP_TRACE_MAX_EVENTS`); later ones are
//! dropped and counted, and the count is written into the file's metadata
//! (`otherData.dropped_events` and the `process_name` event's args).
//!
//! # Format
//! ```text
//! {"traceEvents":[
//!   {"name":"process_name","ph":"M","pid":1,"tid":0,"args":{"name":"rank 1"}},
//!   {"name":"thread_name","ph":"M","pid":1,"tid":1,"args":{"name":"main"}},
//!   {"name":"all_reduce","cat":"collective","ph":"X","ts":1712345678901234.567,"dur":812.250,
//!    "pid":1,"tid":1,"args":{"op":"all_reduce","dtype":"f32","bytes":4096,...}},
//!   ...],
//!  "displayTimeUnit":"ms",
//!  "otherData":{"rank":1,"clock_offset_us":-3,"clock_rtt_us":41,"clock_bound_us":60,"dropped_events":0,...}}
//! ```
//! `ts` and `dur` are microseconds (`ts` since the Unix epoch on rank 0's clock), `pid` is
//! the rank, `tid` a small per-process thread number named by a `thread_name` event.
//!
//! # Example
//! ```
//! use ddp_trace as trace;
//! fn train_step(step: u64) {
//!     let _step = trace::span("step", "train").arg("step", step);
//!     {
//!         let _fill = trace::span("bucket_fill", "ddp").arg("bucket", 0u64).arg("bytes", 4096u64);
//!         // … copy gradients …
//!     } // `bucket_fill` ends here
//!     trace::instant("checkpoint", "train");
//! } // `step` ends here
//! train_step(0);
//! // Without DDP_TRACE nothing was recorded and there is nothing to write.
//! if !trace::enabled() {
//!     assert_eq!(trace::flush()?, None);
//! }
//! # Ok::<(), std::io::Error>(())
//! ```
//!

#![warn(missing_docs)]

mod clock;
mod event;
mod merge;
mod recorder;
#[cfg(test)]
mod tests;
mod writer;

use std::borrow::Cow;
use std::io;
use std::path::PathBuf;
use std::time::Instant;

pub use clock::{ClockSample, ClockSync, estimate_offset};
pub use merge::{
    MERGED_FILE, MergeSummary, TraceError, attempt_dir_name, merge_dir, merge_into, track_pid,
};
#[doc(hidden)]
pub use recorder::flush_best_effort;
pub use recorder::leave_sigterm_to_the_program;

use recorder::{Kind, Recorder};

/// The environment variable that turns tracing on: the directory the rank files go to.
pub const TRACE_VAR: &str = "DDP_TRACE";
/// The environment variable that overrides [`DEFAULT_MAX_EVENTS`].
pub const MAX_EVENTS_VAR: &str = "DDP_TRACE_MAX_EVENTS";
/// How many events a rank keeps by default (about 50 MiB); later ones are counted, not kept.
pub const DEFAULT_MAX_EVENTS: usize = 1 << 19;

/// The name of rank `rank`'s trace file inside the trace directory: `rank-<R>.trace.json`.
///
/// ```
/// assert_eq!(ddp_trace::rank_file_name(3), "rank-3.trace.json");
/// ```
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank}.trace.json")
}

/// Whether this process records a trace (`DDP_TRACE` was set to a non-empty value when this
/// was first called). One relaxed atomic load after the first call.
///
/// Use it to skip computing expensive arguments:
/// ```
/// use ddp_trace as trace;
/// let mut span = trace::span("write_back", "ddp");
/// if trace::enabled() {
///     span = span.arg("params", format!("{:?}", ["w", "b"]));
/// }
/// ```
#[inline]
pub fn enabled() -> bool {
    recorder::enabled()
}

/// Sets this process's rank (the `pid` of its events and the number in its file name) and
/// its clock's offset to rank 0's in microseconds (added to every timestamp, also of events
/// recorded before). A no-op when tracing is off.
///
/// `ddp_comm::ProcessGroup::init` calls it (with the measured offset); the
/// rank defaults to `RANK` from the environment, else 0.
///
/// ```
/// ddp_trace::init(0, 0);
/// ```
pub fn init(rank: usize, clock_offset_us: i64) {
    if let Some(r) = recorder::global() {
        r.set_rank(rank);
        r.set_offset(clock_offset_us, None);
    }
}

/// Writes this rank's trace file, `DIR/rank-<R>.trace.json` (creating `DIR`), with every event
/// recorded so far, and returns its path; `Ok(None)` when tracing is off. The file is replaced
/// atomically (written next to it, then renamed), so a reader never sees half a file.
///
/// ```
/// if let Some(path) = ddp_trace::flush()? {
///     eprintln!("trace written to {}", path.display());
/// }
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn flush() -> io::Result<Option<PathBuf>> {
    match recorder::global() {
        Some(r) => r.flush().map(Some),
        None => Ok(None),
    }
}

/// Starts a span named `name` in category `cat` (both shown by the viewers; the category can
/// be filtered on). It ends when the returned guard is dropped. Inert when tracing is off.
///
/// ```
/// use ddp_trace as trace;
/// {
///     let _wait = trace::span("loader_wait", "data").arg("batch", 17u64);
///     // … wait for the next batch …
/// }
/// ```
#[must_use = "a span ends when its guard is dropped: bind it, `let _span = trace::span(..)`"]
#[inline]
pub fn span(name: &'static str, cat: &'static str) -> Span {
    if !enabled() {
        return Span::inert();
    }
    Span::start(name, cat, Kind::Complete)
}

/// Records an instant event (a vertical mark on the rank's thread) named `name`, at the time
/// of this call. Arguments can be attached as to a [`Span`]; it is recorded when the returned
/// value is dropped (at the end of the statement when not bound).
///
/// ```
/// ddp_trace::instant("epoch_end", "train").arg("epoch", 3u64);
/// ```
#[inline]
pub fn instant(name: &'static str, cat: &'static str) -> Span {
    if !enabled() {
        return Span::inert();
    }
    Span::start(name, cat, Kind::Instant)
}

/// A value of a span argument (`args` in the trace file).
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValue {
    /// A string.
    Str(Cow<'static, str>),
    /// An unsigned integer.
    U64(u64),
    /// A signed integer.
    I64(i64),
    /// A float (`null` in the file when not finite).
    F64(f64),
    /// A boolean.
    Bool(bool),
}

impl From<&'static str> for ArgValue {
    fn from(v: &'static str) -> Self {
        ArgValue::Str(Cow::Borrowed(v))
    }
}
impl From<String> for ArgValue {
    fn from(v: String) -> Self {
        ArgValue::Str(Cow::Owned(v))
    }
}
impl From<bool> for ArgValue {
    fn from(v: bool) -> Self {
        ArgValue::Bool(v)
    }
}
impl From<f64> for ArgValue {
    fn from(v: f64) -> Self {
        ArgValue::F64(v)
    }
}
impl From<f32> for ArgValue {
    fn from(v: f32) -> Self {
        ArgValue::F64(v.into())
    }
}
macro_rules! from_int {
    ($variant:ident, $wide:ty: $($t:ty),*) => {$(
        impl From<$t> for ArgValue {
            fn from(v: $t) -> Self {
                ArgValue::$variant(v as $wide)
            }
        }
    )*};
}
from_int!(U64, u64: u8, u16, u32, u64, usize);
from_int!(I64, i64: i8, i16, i32, i64, isize);

/// A span being recorded; it ends when dropped (see [`span`]). Inert when tracing is off.
#[derive(Debug)]
pub struct Span {
    open: Option<Open>,
}

#[derive(Debug)]
struct Open {
    rec: &'static Recorder,
    name: &'static str,
    cat: &'static str,
    kind: Kind,
    start: Instant,
    tid: u32,
    args: Vec<(&'static str, ArgValue)>,
}

impl Span {
    /// A span that records nothing.
    #[doc(hidden)]
    pub const fn inert() -> Span {
        Span { open: None }
    }

    fn start(name: &'static str, cat: &'static str, kind: Kind) -> Span {
        let Some(rec) = recorder::global() else {
            return Span::inert();
        };
        Span {
            open: Some(Open {
                rec,
                name,
                cat,
                kind,
                tid: recorder::thread_id(),
                args: Vec::new(),
                start: Instant::now(),
            }),
        }
    }

    /// Adds an argument (shown when the span is selected in the viewer). A no-op when the
    /// span is inert; the value is still evaluated by the caller, so pass cheap values or
    /// use [`Span::arg_with`].
    ///
    /// ```
    /// let _s = ddp_trace::span("all_reduce", "ddp").arg("bytes", 1usize << 20).arg("dtype", "f32");
    /// ```
    #[inline]
    pub fn arg(mut self, key: &'static str, value: impl Into<ArgValue>) -> Span {
        self.set_arg(key, value);
        self
    }

    /// Adds an argument computed by `value`, which only runs when the span records.
    ///
    /// ```
    /// let _s = ddp_trace::span("presence", "ddp").arg_with("ranks", || format!("{:?}", [0, 1]));
    /// ```
    #[inline]
    pub fn arg_with<V: Into<ArgValue>>(
        mut self,
        key: &'static str,
        value: impl FnOnce() -> V,
    ) -> Span {
        if let Some(o) = &mut self.open {
            o.args.push((key, value().into()));
        }
        self
    }

    /// Adds an argument to a span already bound (e.g. a size known only at its end).
    ///
    /// ```
    /// let mut s = ddp_trace::span("recv", "io");
    /// s.set_arg("bytes", 512u64);
    /// ```
    #[inline]
    pub fn set_arg(&mut self, key: &'static str, value: impl Into<ArgValue>) {
        if let Some(o) = &mut self.open {
            o.args.push((key, value.into()));
        }
    }

    /// Whether this span records (tracing is on).
    pub fn is_recording(&self) -> bool {
        self.open.is_some()
    }

    /// Ends the span now (the same as dropping it).
    pub fn end(self) {}
}

impl Drop for Span {
    #[inline]
    fn drop(&mut self) {
        if let Some(o) = self.open.take() {
            let end = Instant::now();
            o.rec.record(recorder::Event {
                name: o.name,
                cat: o.cat,
                kind: o.kind,
                start_ns: o.rec.since_base_ns(o.start),
                dur_ns: match o.kind {
                    Kind::Complete => end.saturating_duration_since(o.start).as_nanos() as u64,
                    Kind::Instant => 0,
                },
                tid: o.tid,
                args: o.args,
            });
        }
    }
}

/// Hook of `ddp_comm::ProcessGroup::init` once a group of more than one
/// rank is up: sets the rank and measures the clock offset to rank 0 over the store. Does
/// nothing (not even a store request) when tracing is off; never fails the group.
#[doc(hidden)]
pub fn on_group_ready(rank: usize, world: usize, store: &mut impl ddp_store::store::Store) {
    let Some(rec) = recorder::global() else {
        return;
    };
    rec.set_rank(rank);
    let sync = {
        let _span = span("clock_sync", "setup").arg("world", world);
        clock::sync_with_rank0(store, rank, world, || rec.local_clock_us())
    };
    match sync {
        Ok(s) => {
            tracing::debug!(
                rank,
                offset_us = s.offset_us,
                rtt_us = s.rtt_us,
                bound_us = s.bound_us,
                "trace clock synchronised with rank 0"
            );
            rec.set_offset(s.offset_us, Some(s));
        }
        Err(e) => tracing::warn!(
            rank,
            "trace: cannot measure the clock offset to rank 0 ({e}); this rank's timestamps stay on its own clock"
        ),
    }
}
