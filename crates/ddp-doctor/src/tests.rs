use std::collections::BTreeMap;
use std::time::Duration;

use crate::phase::Phase;
use crate::snapshot::{CollectiveRecord, Observed, RankSnapshot, StepRecord};
use crate::verdict::{self, Thresholds, Whereabouts};

const NOW: f64 = 1_000_000.0;

fn limits() -> Thresholds {
    Thresholds {
        hang_after: Duration::from_secs(10),
        silent_after: Duration::from_secs(3),
        straggler_factor: 2.0,
    }
}

fn coll(seq: u64, label: &str, step: u64, issued: f64, finished: Option<f64>) -> CollectiveRecord {
    CollectiveRecord {
        group: "host".into(),
        seq,
        op: "all_reduce".into(),
        dtype: "f32".into(),
        count: 10,
        label: Some(label.into()),
        step,
        phase: Phase::Sync,
        issued_ms: issued,
        finished_ms: finished,
        failed: false,
    }
}

fn rank(rank: usize, phase: Phase, collectives: Vec<CollectiveRecord>) -> RankSnapshot {
    RankSnapshot {
        rank,
        pid: 100 + rank as u32,
        written_ms: NOW - 100.0,
        step: 7,
        phase,
        phase_since_ms: NOW - 20_000.0,
        finished: collectives.len() as u64,
        collectives,
        steps: Vec::new(),
        observed: None,
    }
}

/// Ranks 0 and 2 wait in #8 (issued 20 s ago, #7 finished 20 s ago); rank 1 never called it.
fn waiting_and_working() -> Vec<RankSnapshot> {
    let done = coll(7, "loss", 7, NOW - 21_000.0, Some(NOW - 20_000.0));
    let waiting = coll(8, "gradient bucket 0", 7, NOW - 20_000.0, None);
    let mut r1 = rank(1, Phase::Data, vec![done.clone()]);
    r1.observed = Some(Observed {
        process: "sleeping".into(),
        seen_ms: NOW,
        stack: vec![
            "clock_nanosleep".into(),
            "std::thread::sleep (std/src/thread/mod.rs:1)".into(),
            "hang_worker::load_batch (src/bin/hang_worker.rs:88)".into(),
            "hang_worker::main (src/bin/hang_worker.rs:200)".into(),
        ],
        stack_error: None,
    });
    vec![
        rank(0, Phase::Sync, vec![done.clone(), waiting.clone()]),
        r1,
        rank(2, Phase::Sync, vec![done, waiting]),
    ]
}

#[test]
fn a_hang_names_the_waiting_ranks_the_collective_and_where_the_other_is() {
    let hang = verdict::hang(&waiting_and_working(), 3, NOW, &limits()).expect("a hang");
    assert_eq!(hang.waiting, vec![0, 2]);
    assert_eq!(hang.culprits(), vec![1]);
    let line = hang.to_string();
    assert!(
        line.starts_with(
            "hang at step 7: ranks 0,2 wait in all_reduce #8 (gradient bucket 0 of step 7) for 20 s; \
             rank 1 never called it: in phase data of step 7 for 20 s, at hang_worker::load_batch \
             (src/bin/hang_worker.rs:88) ← hang_worker::main"
        ),
        "{line}"
    );
}

#[test]
fn no_hang_while_a_collective_finished_recently_or_the_wait_is_short() {
    let mut ranks = waiting_and_working();
    assert!(verdict::hang(&ranks, 3, NOW - 11_000.0, &limits()).is_none());
    ranks[1].collectives[0].finished_ms = Some(NOW - 1_000.0);
    assert!(verdict::hang(&ranks, 3, NOW, &limits()).is_none());
}

#[test]
fn a_silent_rank_is_named_with_its_process_state() {
    let mut ranks = waiting_and_working();
    ranks[1].written_ms = NOW - 15_000.0;
    ranks[1].observed.as_mut().unwrap().process = "stopped".into();
    let hang = verdict::hang(&ranks, 3, NOW, &limits()).expect("a hang");
    assert!(matches!(hang.others[0], (1, Whereabouts::Silent { .. })));
    let line = hang.to_string();
    assert!(line.contains("rank 1 silent: its last report is 15 s old (in phase data of step 7); its process is stopped"), "{line}");
}

#[test]
fn a_minority_in_a_collective_the_others_never_call_is_the_culprit() {
    let done = coll(7, "loss", 7, NOW - 21_000.0, Some(NOW - 20_000.0));
    let extra = coll(8, "loss", 7, NOW - 20_000.0, None);
    let ranks = vec![
        rank(0, Phase::Checkpoint, vec![done.clone()]),
        rank(1, Phase::Sync, vec![done.clone(), extra]),
        rank(2, Phase::Checkpoint, vec![done]),
    ];
    let hang = verdict::hang(&ranks, 3, NOW, &limits()).expect("a hang");
    assert_eq!(hang.culprits(), vec![1]);
    assert!(
        hang.to_string()
            .ends_with("(rank 1 called a collective the others did not)")
    );
}

#[test]
fn a_missing_rank_and_one_in_another_collective_are_said_so() {
    let mut ranks = waiting_and_working();
    ranks.remove(1);
    let hang = verdict::hang(&ranks, 4, NOW, &limits()).expect("a hang");
    let line = hang.to_string();
    assert!(
        line.contains("rank 1 never called it: no report from it"),
        "{line}"
    );
    assert!(line.contains("rank 3 never called it: no report"), "{line}");
    let mut ranks = waiting_and_working();
    ranks[1].collectives = vec![coll(7, "loss", 8, NOW - 19_000.0, None)];
    let line = verdict::hang(&ranks, 3, NOW, &limits())
        .unwrap()
        .to_string();
    assert!(
        line.contains("rank 1 waits in all_reduce #7 (loss of step 8) instead"),
        "{line}"
    );
}

fn steps(busy_forward: f64, sync: f64) -> Vec<StepRecord> {
    (0..8)
        .map(|i| StepRecord {
            step: i,
            total_ms: busy_forward + 5.0 + sync,
            collective_ms: sync,
            busy_by_phase_ms: BTreeMap::from([(Phase::Forward, busy_forward), (Phase::Data, 5.0)]),
        })
        .collect()
}

#[test]
fn a_straggler_is_the_rank_whose_own_work_is_a_multiple_of_the_others() {
    let mut ranks: Vec<RankSnapshot> = (0..4)
        .map(|r| rank(r, Phase::Forward, Vec::new()))
        .collect();
    for r in &mut ranks {
        r.steps = steps(20.0, 45.0);
    }
    ranks[2].steps = steps(65.0, 1.0);
    let found = verdict::stragglers(&ranks, &limits());
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].rank, 2);
    let line = found[0].to_string();
    assert!(line.contains("rank 2's own work takes 2.8× the others' (70 ms per step against their median of 25 ms, last 8 steps), most of it in phase forward (+45 ms)"), "{line}");
    ranks[2].steps = steps(30.0, 1.0);
    assert!(verdict::stragglers(&ranks, &limits()).is_empty());
}

#[test]
fn the_recorder_keeps_collectives_labels_phases_and_steps() {
    crate::set_phase(Phase::Forward);
    std::thread::sleep(Duration::from_millis(20));
    crate::label_next(crate::Label::indexed("gradient bucket", 3));
    let t = crate::recorder::issue("host", "all_reduce", "f32", 12, 1).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    let s = crate::recorder::snapshot(5);
    assert_eq!(
        s.waiting_in().map(|c| c.describe()).as_deref(),
        Some("all_reduce #1 (gradient bucket 3 of step 0)")
    );
    crate::recorder::finish(t, false);
    crate::step_done();
    let s = crate::recorder::snapshot(5);
    assert_eq!(
        (s.rank, s.step, s.phase, s.finished),
        (5, 1, Phase::Data, 1)
    );
    assert!(s.waiting_in().is_none());
    let step = &s.steps[0];
    assert!(
        step.collective_ms >= 10.0 && step.busy_by_phase_ms[&Phase::Forward] >= 20.0,
        "{step:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let written = crate::dump::write(
        dir.path(),
        "dump-1",
        std::slice::from_ref(&s),
        &["none".into()],
    )
    .unwrap();
    assert_eq!(crate::dump::read(dir.path()).unwrap(), vec![s.clone()]);
    assert_eq!(crate::dump::read(&written).unwrap(), vec![s]);
    assert!(matches!(
        crate::dump::read(&dir.path().join("dump-1").join("..").join("nothing")),
        Err(crate::dump::DumpError::Io { .. })
    ));
}
