//! A panic reported as one error line: [`report_panics_as_errors`].
//!
//! Collectives that run inside Burn's forward and backward passes (SyncBatchNorm's statistics
//! exchange) cannot return an error through Burn's module and autodiff APIs, so when another
//! rank dies or a collective times out there, they panic with the reason. Rust's default hook
//! then prints `thread 'main' panicked at src/…:LINE:COL:` and a hint about `RUST_BACKTRACE`
//! before the reason; the hook installed here prints the reason alone, as the program's error.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether [`report_panics_as_errors`] has installed its hook in this process.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Makes every panic of this process print one line, `PROGRAM: error: MESSAGE` (with
/// ` (in thread NAME)` after `error` for a thread other than `main`), instead of Rust's
/// `thread '…' panicked at …` report; with `RUST_BACKTRACE` set (not `0`), the backtrace
/// follows it. The panic itself is unchanged: it unwinds as before and, in `main`, ends the
/// process with exit code 101, so the launcher still sees a failed rank.
///
/// Call it at the start of `main`, once; a second call does nothing. It replaces any hook
/// installed before it.
///
/// ```
/// burn_ddp::report_panics_as_errors("my-trainer");
/// // A rank that loses a peer inside SyncBatchNorm's backward now prints e.g.
/// // "my-trainer: error: SyncBatchNorm backward: rank 1 closed its connection …"
/// ```
pub fn report_panics_as_errors(program: &'static str) {
    if INSTALLED.swap(true, Ordering::SeqCst) {
        return;
    }
    let backtrace = std::env::var("RUST_BACKTRACE").is_ok_and(|v| v != "0");
    std::panic::set_hook(Box::new(move |info| {
        let thread = std::thread::current();
        eprintln!(
            "{}",
            error_line(program, thread.name(), panic_message(info.payload()))
        );
        if backtrace {
            eprintln!("{}", std::backtrace::Backtrace::force_capture());
        }
    }));
}

/// The message a panic carried: its `&str` or `String` payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a thread panicked without a message")
}

/// `PROGRAM: error[ (in thread NAME)]: MESSAGE`.
fn error_line(program: &str, thread: Option<&str>, message: &str) -> String {
    match thread {
        Some("main") | None => format!("{program}: error: {message}"),
        Some(name) => format!("{program}: error (in thread {name}): {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_program_the_thread_and_the_message() {
        assert_eq!(error_line("p", Some("main"), "boom"), "p: error: boom");
        assert_eq!(error_line("p", None, "boom"), "p: error: boom");
        assert_eq!(
            error_line("p", Some("ddp-comm"), "boom"),
            "p: error (in thread ddp-comm): boom"
        );
    }

    #[test]
    fn string_and_str_payloads_are_read() {
        let s: Box<dyn std::any::Any + Send> = Box::new("static text");
        assert_eq!(panic_message(s.as_ref()), "static text");
        let s: Box<dyn std::any::Any + Send> = Box::new(format!("formatted {}", 3));
        assert_eq!(panic_message(s.as_ref()), "formatted 3");
        let s: Box<dyn std::any::Any + Send> = Box::new(7_u32);
        assert_eq!(
            panic_message(s.as_ref()),
            "a thread panicked without a message"
        );
    }
}
