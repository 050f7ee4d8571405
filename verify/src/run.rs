//! One soak run of the HTTP deployment: start it, let the clients and the
//! nemesis loose for a while, heal, ask every key once more, read the
//! ledger back, check, draw.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use crate::{
    checker::{self, Report},
    deploy::{Deployment, StoreKind},
    history::{Event, Recorder},
    nemesis, plot,
    workload::{Clients, Workload},
};

/// What a run is asked to do.
#[derive(Clone, Debug)]
pub struct Plan {
    pub store: StoreKind,
    pub seed: u64,
    pub duration: Duration,
    pub instances: usize,
    pub workload: Workload,
    /// Where the history, the report and the plot go.
    pub out: PathBuf,
    /// The `payments` example binary.
    pub binary: PathBuf,
}

/// What a run came to.
pub struct Outcome {
    pub report: Report,
    pub events: Vec<Event>,
}

/// Runs `plan`, writing `history.jsonl`, `report.txt` and `timeline.svg`
/// into `plan.out`.
pub async fn http(plan: &Plan) -> Outcome {
    std::fs::create_dir_all(&plan.out).expect("create the output folder");
    let recorder = Recorder::create(&plan.out.join("history.jsonl")).expect("create the history");
    let mut deployment = Deployment::start(plan.store, plan.instances, plan.binary.clone()).await;
    let clients = Clients::new(
        recorder.clone(),
        plan.workload.clone(),
        deployment.addrs(),
        plan.seed,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let workers = tokio::spawn({
        let (clients, stop) = (clients.clone(), stop.clone());
        async move { clients.run(stop).await }
    });
    let timer = tokio::spawn({
        let (stop, duration) = (stop.clone(), plan.duration);
        async move {
            tokio::time::sleep(duration).await;
            stop.store(true, Ordering::Relaxed);
        }
    });
    let faults = nemesis::run(&mut deployment, &recorder, plan.seed, stop.clone()).await;
    timer.await.expect("the timer");
    workers.await.expect("the workers");
    // The quiet phase: everything healed, one lease and a moment for the
    // claims of the dead to lapse.
    tokio::time::sleep(deployment.lease + Duration::from_secs(1)).await;
    clients.final_pass().await;
    let events = recorder.events();
    let effects = deployment.effects().await;
    let report = checker::check(&events, &effects, &faults);
    write(
        &plan.out,
        plan.store.name(),
        plan.seed,
        &report,
        &events,
        &faults,
    );
    Outcome { report, events }
}

/// The report, the failing keys' history slices, and the plot.
pub fn write(
    out: &Path,
    name: &str,
    seed: u64,
    report: &Report,
    events: &[Event],
    faults: &[crate::history::FaultWindow],
) {
    let mut text = format!("{name}, seed {seed}\n{report}");
    if !report.passed() {
        text.push_str("\nviolations:\n");
        for violation in &report.violations {
            text.push_str(&format!("  {violation}\n"));
        }
        text.push_str("\nhistory of the failing keys:\n");
        for (key, slice) in checker::slices(events, report) {
            text.push_str(&format!("  {key}\n"));
            for event in slice {
                text.push_str(&format!(
                    "    {}\n",
                    serde_json::to_string(event).unwrap_or_default()
                ));
            }
        }
    }
    let _ = std::fs::write(out.join("report.txt"), &text);
    let faults_json = serde_json::to_string_pretty(faults).unwrap_or_default();
    let _ = std::fs::write(out.join("faults.json"), faults_json);
    if let Err(error) = plot::timeline(
        &out.join("timeline.svg"),
        &format!("{name}, seed {seed}"),
        events,
        faults,
    ) {
        eprintln!("verify: the plot could not be drawn: {error}");
    }
}
