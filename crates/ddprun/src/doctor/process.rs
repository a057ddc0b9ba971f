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
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        assert_eq!(settle(pid, "sleeping"), "sleeping");
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        assert_eq!(settle(pid, "stopped"), "stopped");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(super::state(pid), "gone");
    }
}
