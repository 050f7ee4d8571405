//! The nemesis: seeded, weighted random faults at random moments — kills,
//! pauses longer than the lease, cut, stalled and lossy networks, the
//! database's sessions ended, a Redis Cluster master killed, a full disk,
//! a clock offset — each healed
//! after a while; then everything healed for the quiet phase.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use crate::{
    deploy::{Deployment, StoreKind},
    history::{FaultWindow, Recorder},
};

/// A fault the nemesis can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9` an instance, restart it a moment later.
    Kill,
    /// `kill -9` the instance that just committed a charge, before its
    /// answer left (held back after the commit): the retry must replay,
    /// not execute again.
    KillAtCommit,
    /// `SIGSTOP` an instance for longer than the lease, then `SIGCONT`.
    Pause,
    /// The client↔instance network cut, stalled, or losing answers.
    CutClient,
    StallClient,
    LoseAnswers,
    /// The instances↔store network cut or stalled.
    CutStore,
    StallStore,
    /// The database ends every session (PostgreSQL, MySQL).
    TerminateSessions,
    /// An instance restarted with its clock 2 s ahead (`faketime`).
    ClockOffset,
    /// The SQLite file's disk full for a while.
    FullDisk,
    /// A Redis Cluster master killed: its replica is promoted (writes it
    /// had not replicated are lost); it comes back as a replica.
    KillMaster,
}

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::KillAtCommit => "kill-at-commit",
            Self::Pause => "pause",
            Self::CutClient => "cut-client",
            Self::StallClient => "stall-client",
            Self::LoseAnswers => "lose-answers",
            Self::CutStore => "cut-store",
            Self::StallStore => "stall-store",
            Self::TerminateSessions => "terminate-sessions",
            Self::ClockOffset => "clock-offset",
            Self::FullDisk => "full-disk",
            Self::KillMaster => "kill-master",
        }
    }

    /// The faults a deployment on `kind` can take, with their weights.
    pub fn menu(kind: StoreKind, full_disk: bool) -> Vec<(Fault, u32)> {
        let mut menu = vec![
            (Self::Kill, 3),
            (Self::KillAtCommit, 2),
            (Self::Pause, 2),
            (Self::CutClient, 2),
            (Self::StallClient, 2),
            (Self::LoseAnswers, 3),
        ];
        if kind.networked() {
            menu.extend([(Self::CutStore, 2), (Self::StallStore, 1)]);
        }
        if matches!(kind, StoreKind::Postgres | StoreKind::MySql) {
            menu.push((Self::TerminateSessions, 1));
        }
        if kind == StoreKind::RedisCluster {
            menu.push((Self::KillMaster, 2));
        }
        if faketime_installed() {
            menu.push((Self::ClockOffset, 1));
        }
        if full_disk {
            menu.push((Self::FullDisk, 1));
        }
        menu
    }
}

/// Whether `faketime` (Debian's package) is on `PATH`.
pub fn faketime_installed() -> bool {
    std::process::Command::new("faketime")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Injects faults into `deployment` until `stop`, each recorded as a
/// window; heals everything at the end.
pub async fn run(
    deployment: &mut Deployment,
    recorder: &Recorder,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Vec<FaultWindow> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let menu = Fault::menu(deployment.kind, deployment.disk.is_some());
    let total: u32 = menu.iter().map(|(_, w)| w).sum();
    let mut windows = Vec::new();
    // A moment of calm first, so every key's first attempts are not all
    // under a fault.
    tokio::time::sleep(Duration::from_millis(500)).await;
    while !stop.load(Ordering::Relaxed) {
        let mut pick = rng.u32(..total);
        let fault = menu
            .iter()
            .find(|(_, w)| {
                if pick < *w {
                    true
                } else {
                    pick -= w;
                    false
                }
            })
            .map(|(f, _)| *f)
            .unwrap();
        let instance = rng.usize(..deployment.instances.len());
        let hold = Duration::from_millis(rng.u64(500..2500));
        let start = recorder.now();
        let target = inject(deployment, fault, instance, hold, &mut rng).await;
        windows.push(FaultWindow {
            kind: fault.name().into(),
            target,
            start,
            end: recorder.now(),
        });
        tokio::time::sleep(Duration::from_millis(rng.u64(200..1200))).await;
    }
    deployment.heal();
    windows
}

/// One fault, held for `hold` (or as long as it takes), then healed.
async fn inject(
    deployment: &mut Deployment,
    fault: Fault,
    i: usize,
    hold: Duration,
    rng: &mut fastrand::Rng,
) -> String {
    let instance = format!("instance {i}");
    match fault {
        Fault::Kill => {
            deployment.kill(i);
            tokio::time::sleep(hold / 2).await;
            deployment.spawn(i, None);
            instance
        }
        Fault::KillAtCommit => {
            // The instances hold each answer after its commit; the first
            // that says it committed one is killed while it holds it.
            let before = deployment.committed();
            deployment.hold_answers(true);
            let deadline = tokio::time::Instant::now() + hold * 2;
            let committed = loop {
                let now = deployment.committed();
                if let Some(j) = (0..now.len()).find(|&j| now[j] > before[j]) {
                    break Some(j);
                }
                if tokio::time::Instant::now() >= deadline {
                    break None;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            };
            let j = committed.unwrap_or(i);
            deployment.kill(j);
            deployment.hold_answers(false);
            tokio::time::sleep(hold / 2).await;
            deployment.spawn(j, None);
            match committed {
                Some(_) => format!("instance {j}"),
                None => format!("instance {j} (no commit within {:?})", hold * 2),
            }
        }
        Fault::Pause => {
            deployment.pause(i, true);
            tokio::time::sleep(deployment.lease + hold).await;
            deployment.pause(i, false);
            instance
        }
        Fault::CutClient => {
            deployment.instances[i].relay.cut();
            tokio::time::sleep(hold).await;
            deployment.instances[i].relay.restore();
            instance
        }
        Fault::StallClient => {
            deployment.instances[i].relay.stall();
            tokio::time::sleep(hold).await;
            deployment.instances[i].relay.restore();
            instance
        }
        Fault::LoseAnswers => {
            deployment.instances[i].relay.lose_answers(rng.usize(1..4));
            tokio::time::sleep(hold).await;
            deployment.instances[i].relay.lose_answers(0);
            instance
        }
        Fault::CutStore | Fault::StallStore => {
            if let Some(relay) = &deployment.store_relay {
                if fault == Fault::CutStore {
                    relay.cut();
                } else {
                    relay.stall();
                }
                tokio::time::sleep(hold).await;
                relay.restore();
            }
            "store".into()
        }
        Fault::TerminateSessions => {
            deployment.terminate_sessions().await;
            "store".into()
        }
        Fault::ClockOffset => {
            deployment.kill(i);
            deployment.spawn(i, Some("+2s"));
            tokio::time::sleep(hold).await;
            instance
        }
        Fault::KillMaster => {
            let killed = deployment.kill_master(rng);
            // Past the node timeout (1 s): the replica is promoted.
            tokio::time::sleep(Duration::from_secs(2) + hold).await;
            deployment.heal_cluster();
            killed.map_or("cluster".into(), |port| format!("master :{port}"))
        }
        Fault::FullDisk => {
            if let Some(disk) = &deployment.disk {
                let filler = fill(disk);
                tokio::time::sleep(hold).await;
                let _ = std::fs::remove_file(filler);
            }
            "disk".into()
        }
    }
}

/// Fills the file system at `dir` with a file of zeros until writing fails;
/// remove it to give the space back.
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    if let Ok(mut file) = std::fs::File::create(&path) {
        let block = vec![0u8; 4096];
        while file.write_all(&block).is_ok() {}
        while file.write_all(&[0]).is_ok() {}
        let _ = file.sync_all();
    }
    path
}
