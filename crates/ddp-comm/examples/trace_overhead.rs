//! What a span costs, with tracing off and on: time and heap allocations per call.
//!
//! ```text
//! cargo run --release -p ddp-comm --example trace_overhead                      # off
//! DDP_TRACE=/tmp/trace cargo run --release -p ddp-comm --example trace_overhead  # on
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use ddp_comm::trace;

/// Counts allocations, to show that the off path allocates nothing.
struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const N: u64 = 100_000;

fn measure(what: &str, mut f: impl FnMut(u64)) {
    f(0); // first call: decides on/off, numbers the thread
    let allocs = ALLOCS.load(Relaxed);
    let t = Instant::now();
    for i in 0..N {
        f(black_box(i));
    }
    let ns = t.elapsed().as_nanos() as f64 / N as f64;
    let per = (ALLOCS.load(Relaxed) - allocs) as f64 / N as f64;
    println!("{what:<32} {ns:>8.1} ns/call {per:>6.2} allocations/call");
}

fn main() {
    println!(
        "tracing {} ({} calls each)",
        if trace::enabled() { "ON" } else { "off" },
        N
    );
    measure("Instant::now() (for reference)", |_| {
        black_box(Instant::now());
    });
    measure("enabled()", |_| {
        black_box(trace::enabled());
    });
    measure("span() without args", |_| {
        let _s = trace::span("step", "bench");
    });
    measure("span() with 3 args", |i| {
        let _s = trace::span("all_reduce", "bench")
            .arg("bytes", i)
            .arg("dtype", "f32")
            .arg("seq", i);
    });
    let t = Instant::now();
    match trace::flush() {
        Ok(Some(path)) => println!(
            "flush of {} events: {:.1} ms → {}",
            2 * N + 3,
            t.elapsed().as_secs_f64() * 1e3,
            path.display()
        ),
        Ok(None) => println!("flush: nothing to write (tracing off)"),
        Err(e) => println!("flush failed: {e}"),
    }
}
