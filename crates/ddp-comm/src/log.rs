//! Whether log lines may carry ANSI colour codes: only when they end up on a terminal, and
//! never with `NO_COLOR` set (<https://no-color.org>).
//!
//! A rank's stderr is a pipe to its launcher even when the launcher writes to a terminal, so
//! the launcher decides for its ranks: it sets [`COLOR_VAR`] to `1` when its own stderr is a
//! terminal (and `NO_COLOR` is unset), else `0`. Programs pass [`colour_wanted`] to their
//! subscriber:
//!
//! ```
//! tracing_subscriber::fmt()
//!     .with_ansi(ddp_comm::log::colour_wanted())
//!     .with_writer(std::io::stderr)
//!     .init();
//! ```

use std::io::IsTerminal;

/// Set by the launcher for its ranks: `1` when their output reaches a terminal, `0` when not.
pub const COLOR_VAR: &str = "DDP_LOG_COLOR";

/// Whether this process's log lines may be coloured (see the module).
pub fn colour_wanted() -> bool {
    colour_for(
        std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty()),
        std::env::var(COLOR_VAR).ok().as_deref(),
        std::io::stderr().is_terminal(),
    )
}

/// The rule: `NO_COLOR` wins, then the launcher's word, then whether stderr is a terminal.
pub fn colour_for(no_color: bool, launcher_says: Option<&str>, stderr_is_terminal: bool) -> bool {
    if no_color {
        return false;
    }
    match launcher_says.map(str::trim) {
        Some("1") => true,
        Some("0") => false,
        _ => stderr_is_terminal,
    }
}

#[cfg(test)]
mod tests {
    use super::colour_for;

    #[test]
    fn colour_only_for_a_terminal_and_never_with_no_color() {
        assert!(colour_for(false, None, true));
        assert!(!colour_for(false, None, false));
        assert!(!colour_for(true, None, true));
        assert!(!colour_for(true, Some("1"), true));
        // A rank writes into a pipe; its launcher knows whether the end is a terminal.
        assert!(colour_for(false, Some("1"), false));
        assert!(!colour_for(false, Some("0"), true));
        assert!(!colour_for(false, Some("junk"), false));
    }
}
