//! Launcher tests: real rank processes (`sh` scripts) started, watched and stopped.

use super::*;
use ddp_comm::env::{DEFAULT_MASTER_PORT, TOKEN_VAR};

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        nproc_per_node: n,
        job_token: Some("tok".into()),
        ..LaunchConfig::default()
    }
}

#[test]
fn common_env_single_node_picks_a_free_port_and_thread_hint() {
    let env = common_env(&cfg(2)).unwrap();
    assert_eq!(env["WORLD_SIZE"], "2");
    assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
    assert_eq!(env["GROUP_RANK"], "0");
    assert_eq!(env["MASTER_ADDR"], "127.0.0.1");
    assert_ne!(env["MASTER_PORT"].parse::<u16>().unwrap(), 0);
    assert_eq!(env[TOKEN_VAR], "tok");
    let cores = std::thread::available_parallelism().unwrap().get();
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        assert_eq!(env["OMP_NUM_THREADS"], (cores / 2).max(1).to_string());
    }
    let one = common_env(&cfg(1)).unwrap();
    assert!(
        !one.contains_key("RAYON_NUM_THREADS") || std::env::var_os("RAYON_NUM_THREADS").is_some()
    );
}

#[test]
fn common_env_multi_node_defaults_and_overrides() {
    let c = LaunchConfig {
        nnodes: 3,
        node_rank: 2,
        master_addr: "10.1.2.3".into(),
        threads_per_rank: Some(7),
        ..cfg(4)
    };
    let env = common_env(&c).unwrap();
    assert_eq!(env["WORLD_SIZE"], "12");
    assert_eq!(env["GROUP_RANK"], "2");
    assert_eq!(env["MASTER_PORT"], DEFAULT_MASTER_PORT.to_string());
    assert_eq!(env["OMP_NUM_THREADS"], "7");
    assert_eq!(env["RAYON_NUM_THREADS"], "7");
    let env = common_env(&LaunchConfig {
        master_port: Some(1234),
        ..c
    })
    .unwrap();
    assert_eq!(env["MASTER_PORT"], "1234");
}

#[test]
fn invalid_configs_give_one_clear_error() {
    let cases = [
        (
            LaunchConfig {
                nproc_per_node: 0,
                ..cfg(1)
            },
            "nproc_per_node",
        ),
        (
            LaunchConfig {
                nnodes: 0,
                ..cfg(1)
            },
            "nnodes",
        ),
        (
            LaunchConfig {
                nnodes: 2,
                node_rank: 2,
                ..cfg(1)
            },
            "node_rank 2",
        ),
        (
            LaunchConfig {
                master_addr: " ".into(),
                ..cfg(1)
            },
            "master_addr",
        ),
        (
            LaunchConfig {
                master_port: Some(0),
                ..cfg(1)
            },
            "master_port",
        ),
        (
            LaunchConfig {
                threads_per_rank: Some(0),
                ..cfg(1)
            },
            "threads_per_rank",
        ),
        (
            LaunchConfig {
                live_recovery: true,
                max_restarts: 0,
                ..cfg(1)
            },
            "--recover live needs --max-restarts",
        ),
    ];
    for (c, needle) in cases {
        let err = common_env(&c).unwrap_err().to_string();
        assert!(err.contains(needle), "{err} should mention {needle}");
    }
}

#[test]
fn generated_tokens_differ_per_job() {
    if std::env::var_os(TOKEN_VAR).is_some() {
        return; // the environment fixes the token
    }
    let c = LaunchConfig {
        job_token: None,
        ..cfg(1)
    };
    let a = common_env(&c).unwrap()[TOKEN_VAR].clone();
    let b = common_env(&c).unwrap()[TOKEN_VAR].clone();
    assert_eq!(a.len(), 32);
    assert_ne!(a, b);
    let err = common_env(&LaunchConfig { nnodes: 2, ..c }).unwrap_err();
    assert!(
        matches!(err, LaunchError::MissingToken { nnodes: 2 }),
        "{err}"
    );
    assert!(err.to_string().contains(TOKEN_VAR));
}

#[test]
fn report_exit_codes_and_summaries() {
    let ok = LaunchReport {
        exits: vec![RankExit::Code(0); 2],
        first_rank: 0,
        first_failure: None,
        interrupted: None,
        elapsed: Duration::from_millis(10),
        attempt: 0,
        restarts: Vec::new(),
        replaced: Vec::new(),
        job_stop: None,
    };
    assert!(ok.success());
    assert_eq!(ok.exit_code(), 0);
    assert_eq!(ok.summary(), None);
    let failed = LaunchReport {
        first_failure: Some(Failure {
            relayed_from: None,
            rank: 1,
            exit: RankExit::Code(3),
            elapsed: Duration::from_millis(420),
            stopped: 3,
        }),
        ..ok.clone()
    };
    assert_eq!(failed.exit_code(), 3);
    assert_eq!(
        failed.summary().unwrap(),
        "ddprun: rank 1 failed with exit code 3 after 0.42 s; stopped the other 3 ranks"
    );
    let killed = LaunchReport {
        first_failure: Some(Failure {
            relayed_from: None,
            rank: 2,
            exit: RankExit::Signal(9),
            elapsed: Duration::from_millis(1500),
            stopped: 0,
        }),
        ..ok.clone()
    };
    assert_eq!(killed.exit_code(), 137);
    assert_eq!(
        killed.summary().unwrap(),
        "ddprun: rank 2 was killed by signal 9 (SIGKILL) after 1.50 s; no other rank was running"
    );
    let wraps = LaunchReport {
        first_failure: Some(Failure {
            relayed_from: None,
            rank: 0,
            exit: RankExit::Code(256),
            elapsed: Duration::ZERO,
            stopped: 0,
        }),
        ..ok.clone()
    };
    assert_eq!(wraps.exit_code(), 1);
    let interrupted = LaunchReport {
        interrupted: Some((libc::SIGINT, 2)),
        ..ok.clone()
    };
    assert_eq!(interrupted.exit_code(), 130);
    assert!(interrupted.summary().unwrap().contains("SIGINT"));
    // Stopped by the job (another node's failure): that node's line and code; a code that
    // would read as success is 1.
    let stopped = LaunchReport {
        job_stop: Some(JobStop {
            line: "ddprun: node 1 (ddprun pid 7 on b): rank 1 failed".into(),
            exit_code: 3,
        }),
        ..ok.clone()
    };
    assert!(!stopped.success());
    assert_eq!(stopped.exit_code(), 3);
    assert_eq!(
        stopped.summary().unwrap(),
        "ddprun: node 1 (ddprun pid 7 on b): rank 1 failed"
    );
    let stopped_zero = LaunchReport {
        job_stop: Some(JobStop {
            line: "x".into(),
            exit_code: 0,
        }),
        ..ok
    };
    assert_eq!(stopped_zero.exit_code(), 1);
}

#[test]
fn launch_runs_ranks_and_reports_the_first_failure() {
    let c = LaunchConfig {
        grace: Duration::from_millis(200),
        prefix_output: false,
        ..cfg(3)
    };
    let report = launch(&c, "sh", &["-c", "exit 0"]).unwrap();
    assert!(report.success(), "{report:?}");
    assert_eq!(report.exits, vec![RankExit::Code(0); 3]);
    let script = r#"if [ "$RANK" = 2 ]; then exit 5; fi; exec sleep 30"#;
    let report = launch(&c, "sh", &["-c", script]).unwrap();
    let f = report.first_failure.clone().unwrap();
    assert_eq!((f.rank, f.exit), (2, RankExit::Code(5)));
    assert_eq!(report.exit_code(), 5);
    assert_eq!(report.exits[0], RankExit::Signal(libc::SIGTERM));
}

/// Launches `script` on `n` ranks with a short grace period.
fn launch_sh(n: usize, script: &str) -> LaunchReport {
    let c = LaunchConfig {
        grace: Duration::from_millis(200),
        prefix_output: false,
        ..cfg(n)
    };
    launch(&c, "sh", &["-c", script]).unwrap()
}

#[test]
fn a_single_rank_that_fails_fails_the_launch() {
    let report = launch_sh(1, "exit 3");
    let f = report.first_failure.clone().expect("failure recorded");
    assert_eq!((f.rank, f.exit, f.stopped), (0, RankExit::Code(3), 0));
    assert_eq!(report.exit_code(), 3);
    assert!(!report.success());
    let line = report.summary().unwrap();
    assert!(line.contains("rank 0 failed with exit code 3"), "{line}");
    assert!(line.contains("no other rank was running"), "{line}");
    // Failing late (after the launcher's first polls) is the same.
    let report = launch_sh(1, "sleep 0.2; exit 1");
    assert_eq!(report.exit_code(), 1, "{report:?}");
}

#[test]
fn ranks_failing_together_fail_the_launch() {
    let report = launch_sh(3, "exit 4");
    assert_eq!(report.exit_code(), 4, "{report:?}");
    // A rank not yet reaped when the first failure is seen gets the SIGTERM.
    assert!(
        report
            .exits
            .iter()
            .all(|e| matches!(*e, RankExit::Code(4) | RankExit::Signal(libc::SIGTERM))),
        "{report:?}"
    );
    assert!(
        report
            .summary()
            .unwrap()
            .contains("failed with exit code 4")
    );
}

#[test]
fn the_last_rank_to_exit_failing_is_reported() {
    // Staggered: ranks 0 and 1 succeed first, rank 2 fails last.
    let report = launch_sh(
        3,
        r#"if [ "$RANK" = 2 ]; then sleep 0.3; exit 7; fi; exit 0"#,
    );
    let f = report.first_failure.clone().expect("failure recorded");
    assert_eq!((f.rank, f.exit), (2, RankExit::Code(7)));
    assert_eq!(report.exit_code(), 7);
    assert_eq!(&report.exits[..2], &[RankExit::Code(0); 2]);
}

#[test]
fn a_rank_killed_by_a_signal_fails_the_launch() {
    let report = launch_sh(1, "kill -9 $$");
    assert_eq!(
        report.first_failure.as_ref().unwrap().exit,
        RankExit::Signal(9)
    );
    assert_eq!(report.exit_code(), 137);
    let report = launch_sh(
        2,
        r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; exec sleep 30"#,
    );
    assert_eq!(report.exit_code(), 137, "{report:?}");
    assert_eq!(report.exits[0], RankExit::Signal(libc::SIGTERM));
}

#[test]
fn ranks_that_all_succeed_succeed() {
    let report = launch_sh(2, "sleep 0.1; exit 0");
    assert!(report.success(), "{report:?}");
    assert_eq!(report.exit_code(), 0);
    assert_eq!(report.summary(), None);
}

/// Launches `script` on `n` ranks with up to `restarts` restarts.
fn launch_restarting(n: usize, restarts: usize, script: &str) -> LaunchReport {
    let c = LaunchConfig {
        grace: Duration::from_millis(200),
        prefix_output: false,
        max_restarts: restarts,
        ..cfg(n)
    };
    launch(&c, "sh", &["-c", script]).unwrap()
}

#[test]
fn a_failed_group_is_restarted_and_every_attempt_sees_its_counter() {
    // Rank 1 fails on the first two attempts (once rank 0 has written its line: otherwise the
    // launcher may stop rank 0 before it does); the third succeeds.
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        r#"echo "$TORCHELASTIC_RESTART_COUNT $DDP_RESTART_COUNT $MASTER_PORT $DDP_JOB_TOKEN"                >> {d}/seen.$RANK
               if [ "$RANK" = 1 ] && [ "$DDP_RESTART_COUNT" -lt 2 ]; then
                 while [ "$(cat {d}/seen.0 2>/dev/null | wc -l)" -le "$DDP_RESTART_COUNT" ]; do sleep 0.01; done
                 exit 9
               fi; exit 0"#,
        d = dir.path().display()
    );
    let report = launch_restarting(2, 3, &script);
    assert!(report.success(), "{report:?}");
    assert_eq!(report.attempt, 2);
    assert_eq!(report.restarts.len(), 2);
    assert_eq!(report.restarts[0].exit_code, 9);
    assert!(
        report.restarts[1].summary.contains("(restart 1)"),
        "{report:?}"
    );
    let seen = std::fs::read_to_string(dir.path().join("seen.0")).unwrap();
    let lines: Vec<Vec<&str>> = seen.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(lines.len(), 3, "{seen}");
    for (k, l) in lines.iter().enumerate() {
        assert_eq!(
            (l[0], l[1]),
            (k.to_string().as_str(), k.to_string().as_str())
        );
    }
    // A fresh rendezvous every attempt: its own job token (and a new port here).
    let tokens: std::collections::BTreeSet<&str> = lines.iter().map(|l| l[3]).collect();
    assert_eq!(tokens.len(), 3, "{seen}");
    // Derived from the launcher's ("tok"), which no rank holds.
    assert!(
        lines
            .iter()
            .all(|l| l[3].len() == 64 && !l[3].contains("tok")),
        "{seen}"
    );
}

#[test]
fn restarts_run_out_and_the_last_attempt_decides_the_exit_code() {
    let report = launch_restarting(1, 2, r#"exit $((DDP_RESTART_COUNT + 3))"#);
    assert_eq!(report.attempt, 2);
    assert_eq!(report.restarts.len(), 2);
    assert_eq!(report.exit_code(), 5, "{report:?}");
    assert!(report.summary().unwrap().contains("(restart 2)"));
    // Success needs no restart.
    let report = launch_restarting(2, 2, "exit 0");
    assert!(report.success() && report.attempt == 0 && report.restarts.is_empty());
}

#[test]
fn launch_of_a_missing_program_is_a_spawn_error() {
    let err = launch(&cfg(2), "/nonexistent/ddp-program", &[] as &[&str]).unwrap_err();
    assert!(matches!(err, LaunchError::Spawn { rank: 0, .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/ddp-program"));
}

/// `--emulate-gpu-hosts`: every rank gets an NCCL host identity of its own and NCCL's socket
/// transport; without it, none of those variables.
#[test]
fn emulated_gpu_hosts_give_each_rank_its_own_nccl_host() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "printf '%s %s %s' \"$NCCL_HOSTID\" \"$NCCL_NET\" \"$DDP_EMULATED_GPU_HOST\" > {}/$RANK",
        dir.path().display()
    );
    for emulate in [true, false] {
        let c = LaunchConfig {
            prefix_output: false,
            emulate_gpu_hosts: emulate,
            ..cfg(3)
        };
        let report = launch(&c, "sh", &["-c", &script]).unwrap();
        assert!(report.success(), "{report:?}");
        let seen: Vec<String> = (0..3)
            .map(|r| std::fs::read_to_string(dir.path().join(r.to_string())).unwrap())
            .collect();
        if emulate {
            for (r, s) in seen.iter().enumerate() {
                assert_eq!(
                    *s,
                    format!("burn-ddp-emulated-gpu-host-{r} Socket gpu-host-{r}"),
                    "rank {r}"
                );
            }
        } else {
            assert!(seen.iter().all(|s| s.trim().is_empty()), "{seen:?}");
        }
    }
}
