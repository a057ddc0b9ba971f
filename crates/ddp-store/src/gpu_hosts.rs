//! Emulated GPU hosts: several NCCL ranks on the one GPU a machine has, each rank an NCCL host
//! of its own.
//!
//! NCCL refuses two ranks of one communicator on one GPU only when they are on the same host:
//! its duplicate check ("Duplicate GPU detected") compares the host hash *and* the bus id, and
//! the host hash is taken from `NCCL_HOSTID` when that is set. A rank with an `NCCL_HOSTID` of
//! its own is therefore another host to NCCL, reached through NCCL's network transport: with
//! `NCCL_NET=Socket` on the loopback interface, a multi-node NCCL job on one machine, with real
//! all-reduces, reduce-scatters, all-gathers and broadcasts between processes.
//!
//! It is never on by itself: `ddprun --emulate-gpu-hosts` (or the multi-process tests'
//! `nccl_rank_env`) sets [`rank_vars`] for each rank, [`EMULATED_HOST_VAR`] among them; a rank
//! that finds that variable says so in its first log lines
//! ([`announcement`]), and refuses a set-up where NCCL would not see what the variable says
//! ([`check`]). It is for tests and benchmarks on one GPU: the traffic between the ranks
//! takes sockets on loopback, not NVLink or PCIe peer copies, so it is no model of a real
//! job's speed.

/// Set (by the launcher) to this rank's emulated host name: the switch, and what the logs name.
pub const EMULATED_HOST_VAR: &str = "DDP_EMULATED_GPU_HOST";

/// NCCL's host identity override, read by its `getHostHash`.
pub const NCCL_HOSTID_VAR: &str = "NCCL_HOSTID";

/// The emulated host name of `rank`.
pub fn host_name(rank: usize) -> String {
    format!("gpu-host-{rank}")
}

/// The variables that make `rank` an emulated GPU host of its own: the switch, NCCL's host
/// identity, and NCCL's socket transport on loopback (no InfiniBand).
pub fn rank_vars(rank: usize) -> [(&'static str, String); 5] {
    [
        (EMULATED_HOST_VAR, host_name(rank)),
        (
            NCCL_HOSTID_VAR,
            format!("burn-ddp-emulated-{}", host_name(rank)),
        ),
        ("NCCL_NET", "Socket".to_string()),
        ("NCCL_SOCKET_IFNAME", "lo".to_string()),
        ("NCCL_IB_DISABLE", "1".to_string()),
    ]
}

/// This rank's emulated host, when the launcher switched emulation on.
pub fn emulated_host() -> Option<String> {
    std::env::var(EMULATED_HOST_VAR)
        .ok()
        .filter(|v| !v.trim().is_empty())
}

/// Refuses an emulated host without its own `NCCL_HOSTID` (NCCL would see one host and refuse
/// the second rank on the GPU with a message that does not say why).
///
/// # Errors
/// A readable line naming the variables.
pub fn check(lookup: impl Fn(&str) -> Option<String>) -> Result<(), String> {
    let Some(host) = lookup(EMULATED_HOST_VAR).filter(|v| !v.trim().is_empty()) else {
        return Ok(());
    };
    match lookup(NCCL_HOSTID_VAR) {
        Some(id) if !id.trim().is_empty() => Ok(()),
        _ => Err(format!(
            "{EMULATED_HOST_VAR}={host} asks for an emulated GPU host but {NCCL_HOSTID_VAR} is \
             not set, so NCCL would see every rank on one host and refuse two on one GPU; \
             launch with `ddprun --emulate-gpu-hosts`, which sets both"
        )),
    }
}

/// The line a rank logs when emulation is on: what it is and what it is not.
pub fn announcement(rank: usize, host: &str) -> String {
    format!(
        "rank {rank}: emulated GPU host {host:?} ({EMULATED_HOST_VAR}): NCCL sees this rank as a \
         host of its own ({NCCL_HOSTID_VAR}) and reaches the others through its socket transport \
         on loopback; several ranks may share one GPU. For tests and benchmarks, not for a real \
         job's speed"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn every_rank_is_a_host_of_its_own_to_nccl() {
        let a = rank_vars(0);
        let b = rank_vars(1);
        let id = |vars: &[(&str, String)]| {
            vars.iter()
                .find(|(k, _)| *k == NCCL_HOSTID_VAR)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_ne!(id(&a), id(&b));
        assert!(a.iter().any(|(k, v)| *k == "NCCL_NET" && v == "Socket"));
        let set: Vec<(&str, &str)> = a.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(check(lookup(&set)), Ok(()));
    }

    #[test]
    fn an_emulated_host_without_nccls_host_id_is_refused_and_none_is_fine() {
        let err = check(lookup(&[(EMULATED_HOST_VAR, "gpu-host-1")])).unwrap_err();
        assert!(err.contains("NCCL_HOSTID is not set"), "{err}");
        assert!(err.contains("--emulate-gpu-hosts"), "{err}");
        assert_eq!(check(lookup(&[])), Ok(()));
        assert_eq!(check(lookup(&[(NCCL_HOSTID_VAR, "mine")])), Ok(()));
    }
}
