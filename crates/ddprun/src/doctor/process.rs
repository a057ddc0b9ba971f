//! A rank's process state as the kernel reports it (`/proc/PID/stat`).

/// The state of process `pid` in words (`running`, `sleeping`, `disk sleep`, `stopped`,
/// `traced`, `zombie`, `dead`, `idle`), or `gone` when it has no entry.
pub(crate) fn state(pid: u32) -> String {
    let path = format!("/proc/{pid}/stat");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return "gone".into(),
        Err(e) => return format!("unknown ({path}: {e})"),
    };
    // `pid (comm) S …`: the command may hold spaces and parentheses; the state follows the
    // last `)`.
    let code = text
        .rfind(')')
        .and_then(|i| text[i + 1..].split_whitespace().next())
        .unwrap_or("?");
    match code {
        "R" => "running",
        "S" => "sleeping",
        "D" => "disk sleep",
        "T" => "stopped",
        "t" => "traced",
        "Z" => "zombie",
        "X" | "x" => "dead",
        "I" => "idle",
        other => return format!("in state {other}"),
    }
    .to_string()
}

/// The parent of process `pid`, from `/proc/PID/stat`.
fn parent(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Whether process `pid` descends from `ancestor` (within eight generations).
pub(crate) fn descends_from(pid: u32, ancestor: u32) -> bool {
    let mut p = pid;
    for _ in 0..8 {
        match parent(p) {
            Some(q) if q == ancestor => return true,
            Some(q) if q > 1 => p = q,
            _ => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    /// Waits up to 5 s for `pid` to be in `state`; its last state.
    fn settle(pid: u32, state: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let now = super::state(pid);
            if now == state || Instant::now() >= deadline {
                return now;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_sleeping_child_then_stopped_then_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert_eq!(settle(pid, "sleeping"), "sleeping");
        assert!(super::descends_from(pid, std::process::id()));
        assert!(!super::descends_from(std::process::id(), pid));
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        assert_eq!(settle(pid, "stopped"), "stopped");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(super::state(pid), "gone");
    }
}
