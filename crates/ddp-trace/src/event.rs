//! What the recorder keeps and the writer writes: one span or instant. A leaf module, so that
//! `recorder` (which records them and calls the writer) and `writer` (which turns them into
//! JSON) depend on it and not on each other.

use super::ArgValue;

/// What a span is in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// `"ph":"X"`: a start and a duration.
    Complete,
    /// `"ph":"i"`: a point in time.
    Instant,
}

/// One recorded span or instant.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Event {
    pub name: &'static str,
    pub cat: &'static str,
    pub kind: Kind,
    /// Start, nanoseconds after the recorder's base instant.
    pub start_ns: u64,
    pub dur_ns: u64,
    pub tid: u32,
    pub args: Vec<(&'static str, ArgValue)>,
}
