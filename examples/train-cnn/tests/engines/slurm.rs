//! A real Slurm: munged, slurmctld and two slurmd (nodes `n1` and `n2`, both on this host,
//! each its own port) started from a configuration generated under a temporary directory, every
//! daemon and every job of theirs stopped at the end; then train-cnn with `srun` (a task per
//! rank, no ddprun) and with `sbatch` (ddprun as the step on each node), against the same job
//! under ddprun, bitwise.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{
    DEADLINE, RANK_ENV, TRAIN_CNN, assert_same_job, engines_installed, free_port, reference, run,
    tool,
};

/// What a Slurm of two nodes on this host needs.
const SLURM: &[(&str, &str)] = &[
    ("munged", "munge"),
    ("mungekey", "munge"),
    ("slurmctld", "slurm-wlm"),
    ("slurmd", "slurm-wlm"),
    ("srun", "slurm-wlm"),
    ("sbatch", "slurm-wlm"),
];

/// A Slurm cluster of two nodes on this host, stopped (jobs, daemons) when dropped.
struct Cluster {
    dir: tempfile::TempDir,
    conf: PathBuf,
    daemons: Vec<(&'static str, Child)>,
}

impl Cluster {
    /// Starts munged, slurmctld and the slurmd of `n1` and `n2` (2 CPUs each), and waits until
    /// both nodes are idle.
    fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let d = d.as_path();
        for sub in ["munge", "state", "spool/n1", "spool/n2", "log", "run"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let key = d.join("munge/munge.key");
        let made = Command::new(tool("mungekey", "munge"))
            .args(["-c", "-k"])
            .arg(&key)
            .status()
            .unwrap();
        assert!(made.success(), "mungekey failed");
        let socket = d.join("munge/munge.sock");
        let (ctld, n1, n2) = (free_port(), free_port(), free_port());
        let conf = d.join("slurm.conf");
        let p = |s: &str| d.join(s).display().to_string();
        std::fs::write(
            &conf,
            format!(
                "ClusterName=ddptest\n\
                 SlurmctldHost=localhost(127.0.0.1)\n\
                 SlurmctldPort={ctld}\n\
                 SlurmdPort={n1}\n\
                 SlurmUser=root\n\
                 SlurmdUser=root\n\
                 AuthType=auth/munge\n\
                 CredType=cred/munge\n\
                 AuthInfo=socket={socket}\n\
                 StateSaveLocation={state}\n\
                 SlurmdSpoolDir={spool}/%n\n\
                 SlurmctldPidFile={run}/slurmctld.pid\n\
                 SlurmdPidFile={run}/slurmd-%n.pid\n\
                 SlurmctldLogFile={log}/slurmctld.log\n\
                 SlurmdLogFile={log}/slurmd-%n.log\n\
                 ProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\n\
                 JobAcctGatherType=jobacct_gather/none\n\
                 AccountingStorageType=accounting_storage/none\n\
                 JobCompType=jobcomp/none\n\
                 SwitchType=switch/none\n\
                 MpiDefault=none\n\
                 SelectType=select/cons_tres\n\
                 SelectTypeParameters=CR_Core\n\
                 SchedulerType=sched/builtin\n\
                 ReturnToService=2\n\
                 KillWait=5\n\
                 InactiveLimit=0\n\
                 SlurmdParameters=config_overrides\n\
                 NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1} CPUs=2 RealMemory=1000 State=UNKNOWN\n\
                 NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2} CPUs=2 RealMemory=1000 State=UNKNOWN\n\
                 PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP\n",
                socket = socket.display(),
                state = p("state"),
                spool = p("spool"),
                run = p("run"),
                log = p("log"),
            ),
        )
        .unwrap();
        let mut cluster = Cluster {
            conf,
            daemons: Vec::new(),
            dir,
        };
        let log = |name: &str| std::fs::File::create(cluster_log(d, name)).unwrap();
        let spawn = |cmd: &mut Command, name: &str| -> Child {
            let out = log(name);
            cmd.stdin(Stdio::null())
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {name}: {e}"))
        };
        let munged = spawn(
            Command::new(tool("munged", "munge"))
                .arg("-F")
                .arg(format!("--socket={}", socket.display()))
                .arg(format!("--key-file={}", key.display()))
                .arg(format!("--pid-file={}", p("munge/munged.pid")))
                .arg(format!("--log-file={}", p("munge/munged.log")))
                .arg(format!("--seed-file={}", p("munge/munged.seed"))),
            "munged",
        );
        cluster.daemons.push(("munged", munged));
        cluster.wait_for("munged's socket", |_| socket.exists());
        let conf = cluster.conf.clone();
        let ctld = spawn(
            Command::new(tool("slurmctld", "slurm-wlm"))
                .args(["-D", "-i", "-f"])
                .arg(&conf),
            "slurmctld",
        );
        cluster.daemons.push(("slurmctld", ctld));
        for node in ["n1", "n2"] {
            let slurmd = spawn(
                Command::new(tool("slurmd", "slurm-wlm"))
                    .args(["-D", "-N", node, "-f"])
                    .arg(&conf),
                node,
            );
            cluster.daemons.push(("slurmd", slurmd));
        }
        cluster.wait_for("both nodes idle (sinfo)", |cluster| {
            let out = cluster
                .command("sinfo")
                .args(["-h", "-N", "-o", "%N %t"])
                .output();
            out.is_ok_and(|o| {
                let text = String::from_utf8_lossy(&o.stdout);
                text.contains("n1 idle") && text.contains("n2 idle")
            })
        });
        cluster
    }

    /// Polls `ready` every 50 ms for up to 60 s; on a timeout, fails with the daemons' logs.
    fn wait_for(&mut self, what: &str, ready: impl Fn(&Cluster) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready(self) {
            let exited = self
                .daemons
                .iter_mut()
                .find_map(|(name, child)| Some((*name, child.try_wait().ok()??)));
            if let Some((name, status)) = exited {
                panic!("{name} exited ({status}) before {what}:\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within 60 s:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A Slurm client command (`srun`, `sbatch`, …) talking to this cluster.
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(tool(program, "slurm-wlm"));
        cmd.env("SLURM_CONF", &self.conf)
            .current_dir(self.dir.path());
        cmd
    }

    /// Every daemon's log, for a failure's message.
    fn logs(&self) -> String {
        let mut all = String::new();
        for name in ["munged", "slurmctld", "n1", "n2"] {
            let text =
                std::fs::read_to_string(cluster_log(self.dir.path(), name)).unwrap_or_default();
            all += &format!("--- {name}:\n{text}\n");
        }
        for log in ["slurmctld.log", "slurmd-n1.log", "slurmd-n2.log"] {
            let path = self.dir.path().join("log").join(log);
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            all += &format!(
                "--- {log} (last lines):\n{}\n",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        all
    }
}

fn cluster_log(dir: &Path, name: &str) -> PathBuf {
    dir.join("log").join(format!("{name}.out"))
}

/// The processes (not this one) whose environment names `conf` as `SLURM_CONF`: this
/// cluster's daemons, its steps' `slurmstepd` (which outlive a stopped slurmd) and their tasks.
fn processes_of(conf: &Path) -> Vec<i32> {
    let needle = format!("SLURM_CONF={}", conf.display());
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == needle.as_bytes()))
        })
        .collect()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Every job of this cluster, then the daemons (slurmd before slurmctld, munged last).
        let _ = self
            .command("scancel")
            .args(["--quiet", "--full", "--signal=KILL", "--user=root"])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let queue = self.command("squeue").arg("-h").output();
            if queue.is_ok_and(|o| o.stdout.is_empty()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for (_, child) in self.daemons.iter_mut().rev() {
            // SAFETY: kill has no preconditions; the pid is our child's, not yet reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // What is left of the jobs (a step's slurmstepd outlives its slurmd).
        for pid in processes_of(&self.conf) {
            // SAFETY: kill has no preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// A strong job token for the ranks of a job on several (Slurm) nodes.
fn token() -> String {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .unwrap();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `srun -N 2 -n 4 --ntasks-per-node=2 train-cnn …` on two Slurm nodes (one task per rank, the
/// ranks' places from `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NODEID`, the node list in Slurm's
/// compressed form) trains bitwise the 4-rank job ddprun runs; without a token the ranks on
/// several nodes refuse in one line naming `DDP_JOB_TOKEN`, and srun exits non-zero; `sbatch`
/// with ddprun as the step on each node (`--nnodes 2 --node-rank $SLURM_NODEID`) trains the
/// same bits; a task SIGKILLed in the middle of a step fails every task and srun.
#[test]
fn slurm_runs_train_cnn_bitwise_as_ddprun() {
    if !engines_installed("slurm_runs_train_cnn_bitwise_as_ddprun", SLURM) {
        return;
    }
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().unwrap();
    let by_ddprun = dir.path().join("ddprun");
    reference(4, &by_ddprun);

    // srun alone: a task per rank.
    let by_srun = dir.path().join("srun");
    let token = token();
    // 4 tasks on the two nodes, `wrapper` (a shell, or nothing) starting train-cnn `args`.
    let srun = |wrapper: &[&str], args: Vec<String>, token: Option<&str>| {
        let mut cmd = cluster.command("srun");
        cmd.args(["-N", "2", "-n", "4", "--ntasks-per-node=2"])
            .arg("--kill-on-bad-exit=1")
            .args(wrapper)
            .arg(TRAIN_CNN)
            .args(args)
            .envs(RANK_ENV.iter().copied())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", free_port().to_string())
            .env_remove("DDP_JOB_TOKEN");
        if let Some(t) = token {
            cmd.env("DDP_JOB_TOKEN", t);
        }
        cmd
    };
    let ended = run(
        &mut srun(&[], super::train_args(&by_srun), Some(&token)),
        DEADLINE,
    );
    assert!(ended.ok, "{}\n{}", ended.all, cluster.logs());
    assert!(ended.all.contains("train-cnn: 4 ranks"), "{}", ended.all);
    assert_same_job(&by_ddprun, &by_srun, "srun vs ddprun");

    let no_token = super::train_args(&dir.path().join("no-token"));
    let refused = run(&mut srun(&[], no_token, None), DEADLINE);
    assert!(!refused.ok, "{}", refused.all);
    assert!(
        refused
            .all
            .contains("DDP_JOB_TOKEN is not set and the ranks are on several hosts"),
        "{}",
        refused.all
    );
    assert!(!refused.all.contains("panicked"), "{}", refused.all);

    // sbatch: ddprun as the step on each node, 2 ranks each.
    let ddprun = Path::new(TRAIN_CNN).with_file_name("ddprun");
    assert!(ddprun.is_file(), "{} not built", ddprun.display());
    let by_sbatch = dir.path().join("sbatch");
    let script = dir.path().join("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             #SBATCH --nodes=2 --ntasks-per-node=1\n\
             # The job's secret, made where the job runs: srun hands it to every node's step.\n\
             export DDP_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')\n\
             srun --ntasks-per-node=1 sh -c '{ddprun} --nnodes 2 --node-rank $SLURM_NODEID \
             --nproc-per-node 2 --master-addr 127.0.0.1 --master-port {port} -- {train} {args}'\n",
            ddprun = ddprun.display(),
            port = free_port(),
            train = TRAIN_CNN,
            args = super::train_args(&by_sbatch).join(" "),
        ),
    )
    .unwrap();
    let ended = run(
        cluster
            .command("sbatch")
            .args(["--wait", "--output"])
            .arg(dir.path().join("job.out"))
            .arg(&script)
            .envs(RANK_ENV.iter().copied())
            .env_remove("DDP_JOB_TOKEN"),
        DEADLINE,
    );
    let out = std::fs::read_to_string(dir.path().join("job.out")).unwrap_or_default();
    assert!(ended.ok, "{}\n{out}\n{}", ended.all, cluster.logs());
    assert_same_job(&by_ddprun, &by_sbatch, "sbatch + ddprun vs ddprun");

    // A task SIGKILLed mid-training: srun ends the step, every task and srun exit non-zero.
    let kill = r#"if [ "$SLURM_PROCID" = 3 ]; then ( sleep 0.5; kill -9 $$ ) & fi; exec "$@""#;
    // Long enough that the kill falls inside the training.
    let args = super::train_args_for(&dir.path().join("killed"), 50);
    let mut cmd = srun(&["sh", "-c", kill, "sh"], args, Some(&token));
    let ended = run(&mut cmd, DEADLINE);
    assert!(!ended.ok && ended.code.is_some(), "{}", ended.all);
    assert!(
        ended.after < Duration::from_secs(90),
        "{:?}\n{}",
        ended.after,
        ended.all
    );
}

/// `sbatch`'s job id from `--parsable`'s output.
fn job_id(ended: &super::Ended) -> String {
    ended
        .all
        .lines()
        .find_map(|l| {
            let id = l.trim().split(';').next()?;
            (!id.is_empty() && id.chars().all(|c| c.is_ascii_digit())).then(|| id.to_string())
        })
        .unwrap_or_else(|| panic!("no job id in sbatch's output: {}", ended.all))
}

/// The job's state (`squeue -h -j J -o %T`: PENDING, RUNNING, …), empty once it left the queue.
fn job_state(cluster: &Cluster, job: &str) -> String {
    let out = cluster
        .command("squeue")
        .args(["-h", "-j", job, "-o", "%T"])
        .output()
        .expect("squeue");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Polls `done` every 100 ms for up to `secs`; fails with `what` and the cluster's logs.
fn wait_until(cluster: &Cluster, what: &str, secs: u64, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "no {what} within {secs} s:\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A batch job of 4 train-cnn ranks on two nodes (a task per rank), resuming from its
/// checkpoint when one is there (a requeued job runs its script again).
fn resuming_job(dir: &Path, out: &Path, epochs: usize) -> PathBuf {
    let script = dir.join(format!("{}.sh", out.file_name().unwrap().to_string_lossy()));
    let args = super::train_args_for(out, epochs).join(" ");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             #SBATCH --nodes=2 --ntasks-per-node=2\n\
             export DDP_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')\n\
             export MASTER_ADDR=127.0.0.1 MASTER_PORT={port}\n\
             resume=\n\
             [ -f {out}/checkpoint.bin ] && resume=--resume\n\
             echo \"attempt ${{SLURM_RESTART_COUNT:-0}} $resume\"\n\
             srun --kill-on-bad-exit=1 {train} {args} --checkpoint-every-steps 10 $resume\n",
            port = free_port(),
            out = out.display(),
            train = TRAIN_CNN,
        ),
    )
    .unwrap();
    script
}

/// `scancel` of a running batch job: the tasks get SIGTERM (then SIGKILL after `KillWait`),
/// the job leaves the queue, no task is left, and the checkpoint written so far is whole.
/// `scontrol requeue` of a running batch job: its script runs again (`SLURM_RESTART_COUNT=1`),
/// resumes from the checkpoint, and the job ends bitwise as the one never requeued.
#[test]
fn slurm_scancel_leaves_a_whole_checkpoint_and_a_requeued_job_resumes_bitwise() {
    if !engines_installed("slurm_scancel_leaves_a_whole_checkpoint_…", SLURM) {
        return;
    }
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().unwrap();
    let sbatch = |script: &Path, log: &str| {
        let ended = run(
            cluster
                .command("sbatch")
                .args(["--parsable", "--open-mode=append", "--output"])
                .arg(dir.path().join(log))
                .arg(script)
                .envs(RANK_ENV.iter().copied())
                .env_remove("DDP_JOB_TOKEN"),
            DEADLINE,
        );
        assert!(ended.ok, "{}", ended.all);
        job_id(&ended)
    };

    // scancel.
    let cancelled = dir.path().join("cancelled");
    let job = sbatch(&resuming_job(dir.path(), &cancelled, 200), "cancelled.log");
    let checkpoint = cancelled.join(train_cnn::checkpoint::FILE_NAME);
    wait_until(&cluster, "first checkpoint", 120, || checkpoint.exists());
    let ok = cluster.command("scancel").arg(&job).status().unwrap();
    assert!(ok.success());
    wait_until(&cluster, "cancelled job leaving the queue", 60, || {
        job_state(&cluster, &job).is_empty() || job_state(&cluster, &job) == "CANCELLED"
    });
    wait_until(&cluster, "no task left", 30, || {
        processes_of(&cluster.conf).iter().all(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| !c.contains("train-cnn"))
        })
    });
    train_cnn::checkpoint::Checkpoint::read(&checkpoint).expect("the checkpoint is whole");

    // scontrol requeue.
    let epochs = 12;
    let straight = dir.path().join("straight");
    super::reference_of(4, super::train_args_for(&straight, epochs));
    let requeued = dir.path().join("requeued");
    let job = sbatch(&resuming_job(dir.path(), &requeued, epochs), "requeued.log");
    let checkpoint = requeued.join(train_cnn::checkpoint::FILE_NAME);
    wait_until(&cluster, "first checkpoint", 120, || checkpoint.exists());
    let ok = cluster
        .command("scontrol")
        .args(["requeue", &job])
        .status()
        .unwrap();
    assert!(ok.success());
    // A requeued job waits about two minutes before it may start again: start it now.
    wait_until(&cluster, "requeued job pending", 60, || {
        job_state(&cluster, &job) == "PENDING"
    });
    let ok = cluster
        .command("scontrol")
        .args(["update", &format!("JobId={job}"), "StartTime=now"])
        .status()
        .unwrap();
    assert!(ok.success());
    wait_until(&cluster, "requeued job done", 170, || {
        let state = job_state(&cluster, &job);
        state.is_empty() || state == "COMPLETED"
    });
    let log = std::fs::read_to_string(dir.path().join("requeued.log")).unwrap_or_default();
    assert!(log.contains("attempt 1 --resume"), "{log}");
    assert!(
        log.contains("resumed after") || log.contains("train-cnn"),
        "{log}"
    );
    super::assert_same_job(
        &straight,
        &requeued,
        &format!("requeued vs never requeued\n{log}"),
    );
}
