//! The history: one JSON line per attempt, as a client saw it — invoked,
//! answered (`ok` a 2xx, `fail` an answer that says no, `info` no answer:
//! indeterminate) — and the effects read back from the ledger at the end.

use std::{
    io::{BufRead, BufWriter, Write},
    path::Path,
    sync::{Arc, Mutex},
    time::Instant,
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a client did to, or heard of, one operation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Seconds since the run began, to the millisecond.
    pub t: f64,
    /// The operation: one business operation, one key.
    pub op: u64,
    pub account: String,
    pub key: String,
    /// The operation's parameters (a mismatch sends others).
    pub amount: i64,
    /// `invoke`, `ok`, `fail` or `info`.
    pub kind: String,
    /// Who sent it: `client` (the crate's client layer, retrying under one
    /// key), `raw` (a duplicate sent once, alongside), `mismatch` (the key
    /// with other parameters), `final` (the pass after the faults healed).
    pub via: String,
    /// The HTTP status, when there was an answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// A digest of the answer's body, to compare replays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The charge the answer names, and its account.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charge: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charge_account: Option<String>,
    #[serde(default)]
    pub replayed: bool,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub latency_ms: u64,
    /// Which instance it went to (for the plot).
    #[serde(default)]
    pub instance: usize,
}

impl Event {
    pub fn is_completion(&self) -> bool {
        self.kind != "invoke"
    }
}

/// An effect the ledger holds: one row per execution.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Effect {
    pub id: String,
    pub account: String,
    pub amount: i64,
    /// The operation's key, which every charge carries in its description.
    pub key: String,
}

/// A fault the nemesis injected, for the report and the plot.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FaultWindow {
    pub kind: String,
    pub target: String,
    pub start: f64,
    pub end: f64,
}

/// Writes events as they happen, one JSON line each.
#[derive(Clone)]
pub struct Recorder {
    started: Instant,
    out: Arc<Mutex<BufWriter<std::fs::File>>>,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Recorder {
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            started: Instant::now(),
            out: Arc::new(Mutex::new(BufWriter::new(std::fs::File::create(path)?))),
            events: Arc::default(),
        })
    }

    /// Seconds since the run began.
    pub fn now(&self) -> f64 {
        (self.started.elapsed().as_millis() as f64) / 1000.0
    }

    pub fn record(&self, mut event: Event) {
        event.t = self.now();
        let line = serde_json::to_string(&event).expect("an event is JSON");
        let mut out = self.out.lock().unwrap();
        let _ = writeln!(out, "{line}");
        self.events.lock().unwrap().push(event);
    }

    pub fn events(&self) -> Vec<Event> {
        let _ = self.out.lock().unwrap().flush();
        self.events.lock().unwrap().clone()
    }
}

/// Reads a history written by a [`Recorder`].
pub fn read(path: &Path) -> std::io::Result<Vec<Event>> {
    let file = std::io::BufReader::new(std::fs::File::open(path)?);
    file.lines()
        .map(|line| {
            let line = line?;
            serde_json::from_str(&line).map_err(|e| std::io::Error::other(e.to_string()))
        })
        .collect()
}

/// A short digest of a body.
pub fn digest(body: &[u8]) -> String {
    let digest = Sha256::digest(body);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}
