//! The recorder: whether tracing is on, the process's one [`Recorder`] and its events, thread
//! numbers, and writing the rank file (on request, on a group's drop, at exit).

use std::cell::Cell;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicI64, AtomicU8, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub(super) use super::event::{Event, Kind};
use super::writer::{self, Meta};
use super::{ClockSync, DEFAULT_MAX_EVENTS, MAX_EVENTS_VAR, TRACE_VAR, rank_file_name};

const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

/// Whether tracing is on: decided once, from the environment, on the first call.
static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
/// The recorder, created when tracing turns on.
static GLOBAL: OnceLock<Recorder> = OnceLock::new();

#[inline]
pub(super) fn enabled() -> bool {
    match STATE.load(Relaxed) {
        OFF => false,
        ON => true,
        _ => decide(),
    }
}

#[cold]
#[inline(never)]
fn decide() -> bool {
    let on = match std::env::var_os(TRACE_VAR).filter(|d| !d.is_empty()) {
        Some(dir) => {
            let mut created = false;
            let rec = GLOBAL.get_or_init(|| {
                created = true;
                Recorder::from_env(PathBuf::from(dir))
            });
            if created {
                register_exit_hook();
                register_sigterm_flush();
                tracing::debug!(
                    dir = %rec.dir.display(),
                    max_events = rec.cap,
                    "trace recording on ({TRACE_VAR})"
                );
            }
            true
        }
        None => false,
    };
    STATE.store(if on { ON } else { OFF }, Relaxed);
    on
}

/// The process's recorder when tracing is on.
#[inline]
pub(super) fn global() -> Option<&'static Recorder> {
    if enabled() { GLOBAL.get() } else { None }
}

/// Writes the rank file if tracing is on, logging (not returning) a failure. Called when a
/// process group is dropped.
pub fn flush_best_effort() {
    if let Some(r) = global() {
        match r.flush() {
            Ok(path) => tracing::debug!("trace written to {}", path.display()),
            Err(e) => tracing::warn!("trace: cannot write this rank's trace file: {e}"),
        }
    }
}

fn register_exit_hook() {
    extern "C" fn at_exit() {
        // Never unwind into libc. Thread-locals with destructors (tracing's) may be gone by
        // now: report with eprintln only.
        let _ = std::panic::catch_unwind(|| {
            if let Some(r) = GLOBAL.get()
                && let Err(e) = r.flush_at_exit()
            {
                eprintln!("ddp-comm: cannot write the trace file at exit: {e}");
            }
        });
    }
    // SAFETY: `at_exit` is a plain `extern "C" fn()` that catches every panic.
    if unsafe { libc::atexit(at_exit) } != 0 {
        tracing::warn!("trace: cannot register the exit hook; call trace::flush() before exiting");
    }
}

/// Set by [`leave_sigterm_to_the_program`].
static PROGRAM_HANDLES_SIGTERM: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Tells the trace's SIGTERM watcher that this program ends itself on SIGTERM (a handler of
/// its own through signal-hook, tokio or `ctrlc`, installed after tracing turned on, e.g. to
/// save a checkpoint and exit): a SIGTERM then writes the trace and leaves the process running
/// for that handler, instead of ending it as SIGTERM's default action would. The trace is
/// written again at exit. Call it where the handler is installed.
///
/// ```no_run
/// // … after installing the program's own SIGTERM handler (signal-hook, tokio, ctrlc):
/// ddp_trace::leave_sigterm_to_the_program();
/// ```
pub fn leave_sigterm_to_the_program() {
    PROGRAM_HANDLES_SIGTERM.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// With tracing on, a SIGTERM (what the launcher sends the ranks it stops after another rank
/// failed, and what schedulers send) writes the trace, marked with a `sigterm` instant, before
/// the process ends as SIGTERM's default action ends it. Only if SIGTERM has its default
/// action when tracing turns on: a handler of the program's own is left alone. A program that
/// installs its handler later (so both run) calls [`leave_sigterm_to_the_program`]: then the
/// watcher writes the trace and lets the program end itself.
fn register_sigterm_flush() {
    use signal_hook::consts::SIGTERM;
    if !sigterm_is_default() {
        tracing::debug!("trace: SIGTERM has a handler already; a SIGTERM will not write the trace");
        return;
    }
    let mut signals = match signal_hook::iterator::Signals::new([SIGTERM]) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(
                "trace: cannot watch for SIGTERM ({e}); a SIGTERM will not write the trace"
            );
            return;
        }
    };
    let watcher = std::thread::Builder::new()
        .name("ddp-trace-sigterm".into())
        .spawn(move || {
            for _ in signals.forever() {
                if let Some(r) = GLOBAL.get() {
                    drop(super::instant("sigterm", "signal"));
                    if let Err(e) = r.flush_at_exit() {
                        eprintln!("ddp-comm: cannot write the trace file on SIGTERM: {e}");
                    }
                }
                if PROGRAM_HANDLES_SIGTERM.load(std::sync::atomic::Ordering::SeqCst) {
                    // The program's own handler ends the process (and the exit hook writes
                    // the trace once more).
                    continue;
                }
                // Resets SIGTERM to its default action and raises it: the process ends
                // killed by SIGTERM, as it would have without tracing.
                let _ = signal_hook::low_level::emulate_default_handler(SIGTERM);
                std::process::exit(128 + SIGTERM);
            }
        });
    if let Err(e) = watcher {
        tracing::warn!(
            "trace: cannot start the SIGTERM watcher ({e}); a SIGTERM will not write the trace"
        );
    }
}

/// Whether SIGTERM has its default action (terminate) in this process.
fn sigterm_is_default() -> bool {
    // SAFETY: a null new action makes sigaction only read the current one into `old`.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGTERM, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_DFL
    }
}

thread_local! {
    /// This thread's number in traces (0: none yet). No destructor: usable at exit too.
    static TID: Cell<u32> = const { Cell::new(0) };
}
static NEXT_TID: AtomicU32 = AtomicU32::new(1);
/// The name of every numbered thread.
static THREADS: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

/// This thread's number in traces; the first call names it (its Rust name, else `thread N`).
pub(super) fn thread_id() -> u32 {
    TID.with(|t| {
        if t.get() == 0 {
            let id = NEXT_TID.fetch_add(1, Relaxed);
            let name = std::thread::current()
                .name()
                .map_or_else(|| format!("thread {id}"), str::to_string);
            lock(&THREADS).push((id, name));
            t.set(id);
        }
        t.get()
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The events of one process and what its file needs besides them.
pub(super) struct Recorder {
    dir: PathBuf,
    /// The monotonic instant timestamps count from, and the wall clock then.
    base: Instant,
    base_wall_ns: i128,
    rank: AtomicUsize,
    offset_us: AtomicI64,
    cap: usize,
    dropped: AtomicU64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    events: Vec<Event>,
    sync: Option<ClockSync>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("dir", &self.dir)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl Recorder {
    /// A recorder writing to `dir` as `rank`, keeping at most `cap` events.
    pub(super) fn new(dir: PathBuf, rank: usize, cap: usize) -> Self {
        let base = Instant::now();
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Recorder {
            dir,
            base,
            base_wall_ns: wall.as_nanos() as i128,
            rank: AtomicUsize::new(rank),
            offset_us: AtomicI64::new(0),
            cap,
            dropped: AtomicU64::new(0),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The rank from `RANK` (else 0), the cap from `DDP_TRACE_MAX_EVENTS`.
    fn from_env(dir: PathBuf) -> Self {
        let num = |var: &str| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
        };
        let cap = num(MAX_EVENTS_VAR).unwrap_or(DEFAULT_MAX_EVENTS);
        Recorder::new(dir, num("RANK").unwrap_or(0), cap)
    }

    pub(super) fn set_rank(&self, rank: usize) {
        self.rank.store(rank, Relaxed);
    }

    pub(super) fn set_offset(&self, offset_us: i64, sync: Option<ClockSync>) {
        self.offset_us.store(offset_us, Relaxed);
        lock(&self.inner).sync = sync;
    }

    /// Nanoseconds from the base instant to `t`.
    #[inline]
    pub(super) fn since_base_ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_nanos() as u64
    }

    /// This process's trace clock now, before any offset: microseconds since the Unix epoch.
    pub(super) fn local_clock_us(&self) -> i64 {
        ((self.base_wall_ns + self.since_base_ns(Instant::now()) as i128) / 1000) as i64
    }

    /// Keeps `ev`, or counts it as dropped when the cap is reached.
    pub(super) fn record(&self, ev: Event) {
        let mut inner = lock(&self.inner);
        if inner.events.len() >= self.cap {
            drop(inner);
            self.dropped.fetch_add(1, Relaxed);
            return;
        }
        inner.events.push(ev);
    }

    /// The path of this rank's file.
    pub(super) fn path(&self) -> PathBuf {
        self.dir.join(rank_file_name(self.rank.load(Relaxed)))
    }

    /// Writes the rank file; returns its path.
    pub(super) fn flush(&self) -> io::Result<PathBuf> {
        let json = self.to_json(lock(&self.inner));
        self.write_file(&json)
    }

    /// [`Recorder::flush`] for the exit hook: gives up rather than wait long for a thread
    /// that holds the lock while the process exits.
    fn flush_at_exit(&self) -> io::Result<PathBuf> {
        for _ in 0..200 {
            match self.inner.try_lock() {
                Ok(g) => return self.write_file(&self.to_json(g)),
                Err(TryLockError::Poisoned(p)) => {
                    return self.write_file(&self.to_json(p.into_inner()));
                }
                Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            "the trace was locked by another thread for 200 ms",
        ))
    }

    /// Sorts the events (in place) and renders the file.
    fn to_json(&self, mut inner: MutexGuard<'_, Inner>) -> Vec<u8> {
        // Parents before their children when they start together.
        inner
            .events
            .sort_by_key(|e| (e.start_ns, std::cmp::Reverse(e.dur_ns)));
        let meta = Meta {
            rank: self.rank.load(Relaxed),
            base_wall_ns: self.base_wall_ns,
            offset_us: self.offset_us.load(Relaxed),
            sync: inner.sync,
            dropped: self.dropped.load(Relaxed),
            max_events: self.cap,
        };
        let threads = lock(&THREADS).clone();
        let mut out = Vec::with_capacity(inner.events.len() * 160 + 1024);
        writer::write_trace(&mut out, &meta, &inner.events, &threads)
            .expect("writing into a Vec cannot fail");
        out
    }

    /// Writes `json` to the rank file atomically (a temporary file next to it, renamed). One
    /// writer at a time: the exit hook and the SIGTERM watcher may both flush at the end.
    fn write_file(&self, json: &[u8]) -> io::Result<PathBuf> {
        static WRITING: Mutex<()> = Mutex::new(());
        let _one_writer = lock(&WRITING);
        let path = self.path();
        std::fs::create_dir_all(&self.dir)?;
        let tmp = tmp_path(&path);
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        Ok(path)
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}
