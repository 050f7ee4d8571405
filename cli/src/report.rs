//! What a command found, printed for a person (`name: value` lines) or as
//! one JSON object (`--json`).

use std::time::UNIX_EPOCH;

use serde_json::{Map, Value, json};
use tower_idempotency::{
    CompletedRecord,
    outbox::{OutboxBacklog, OutboxMessage, OutboxStats},
    store::{Forgotten, KeyState, StorageKey, TableStats},
};

/// The fields of an answer, in the order they are printed.
pub(crate) struct Report(Vec<(&'static str, Value)>);

impl Report {
    /// What the store holds for `key` (named `redis_key` in Redis).
    pub(crate) fn state(redis_key: Option<String>, key: &StorageKey, state: &KeyState) -> Self {
        let mut fields = vec![
            ("key", json!(key.as_str())),
            // What logs written with sensitive keys show for it.
            ("logged_as", json!(key.logged_as())),
        ];
        if let Some(name) = redis_key {
            fields.push(("redis_key", json!(name)));
        }
        match state {
            KeyState::Absent => fields.push(("state", json!("absent"))),
            KeyState::InFlight { retry_after } => {
                fields.push(("state", json!("in_flight")));
                fields.push(("retry_after_ms", json!(retry_after.as_millis() as u64)));
            }
            KeyState::Completed { record, expires_in } => {
                fields.push(("state", json!("completed")));
                let (kind, status, size) = match &**record {
                    CompletedRecord::Response(response) => (
                        "response",
                        Some(response.status().as_u16()),
                        Some(response.body().len()),
                    ),
                    CompletedRecord::Unreplayable { status, .. } => {
                        ("unreplayable", Some(status.as_u16()), None)
                    }
                    CompletedRecord::Message { result, .. } => {
                        ("message", None, result.as_ref().map(|r| r.len()))
                    }
                };
                fields.push(("record", json!(kind)));
                if let Some(status) = status {
                    fields.push(("status", json!(status)));
                }
                if let Some(size) = size {
                    fields.push(("body_bytes", json!(size)));
                }
                let created = record
                    .created_at()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                fields.push(("created_at_unix", json!(created)));
                fields.push(("expires_in_secs", json!(expires_in.as_secs())));
            }
        }
        Self(fields)
    }

    /// A key forgotten.
    pub(crate) fn forgotten(key: &StorageKey, forgotten: Forgotten) -> Self {
        let what = match forgotten {
            Forgotten::ForcedInFlight => "in_flight_claim",
            _ => "completed_record",
        };
        Self(vec![
            ("key", json!(key.as_str())),
            ("logged_as", json!(key.logged_as())),
            ("forgot", json!(what)),
        ])
    }

    /// Expired records deleted.
    pub(crate) fn swept(deleted: u64) -> Self {
        Self(vec![("deleted", json!(deleted))])
    }

    /// A table's records; on SQL, what the count of claims cannot see.
    pub(crate) fn table(stats: TableStats, sql: bool) -> Self {
        let mut fields = vec![
            ("completed", json!(stats.completed)),
            ("in_flight", json!(stats.in_flight)),
            ("expired", json!(stats.expired)),
        ];
        if sql {
            fields.push((
                "in_flight_counts",
                json!(
                    "a lease store's claims only: a transactional store's claim is an uncommitted \
                     row of its request's open transaction, which no count sees (inspect probes \
                     one key)"
                ),
            ));
        }
        Self(fields)
    }

    /// A Redis server's keys under the prefix, its memory and policy.
    pub(crate) fn redis(keys: u64, used_memory: Option<u64>, policy: Option<String>) -> Self {
        let mut fields = vec![("keys", json!(keys))];
        if let Some(bytes) = used_memory {
            fields.push(("used_memory_bytes", json!(bytes)));
        }
        if let Some(policy) = policy {
            fields.push(("maxmemory_policy", json!(policy)));
        }
        Self(fields)
    }

    /// An outbox's messages by state, and its oldest pending one's wait.
    pub(crate) fn outbox(stats: OutboxStats, backlog: OutboxBacklog) -> Self {
        let mut fields = vec![
            ("pending", json!(stats.pending)),
            ("sent", json!(stats.sent)),
            ("refused", json!(stats.refused)),
        ];
        if let Some(waited) = backlog.oldest_pending {
            fields.push(("oldest_pending_secs", json!(waited.as_secs())));
        }
        fields.push(("sent_over_7_days_ago", json!(backlog.awaiting_sweep)));
        Self(fields)
    }

    /// Refused messages, one line each (a JSON array with `--json`).
    pub(crate) fn refused(messages: &[OutboxMessage]) -> Self {
        let listed: Vec<Value> = messages
            .iter()
            .map(|message| {
                json!({
                    "id": message.id,
                    "destination": message.destination,
                    "ordering_key": message.ordering_key,
                    "attempts": message.attempts,
                    "payload_bytes": message.payload.len(),
                })
            })
            .collect();
        Self(vec![("refused", Value::Array(listed))])
    }

    /// Refused messages made pending again.
    pub(crate) fn requeued(ids: &[&str]) -> Self {
        Self(vec![("requeued", json!(ids))])
    }

    pub(crate) fn print(&self, json: bool) {
        if json {
            let object: Map<String, Value> = self
                .0
                .iter()
                .map(|(name, value)| ((*name).to_owned(), value.clone()))
                .collect();
            println!("{}", Value::Object(object));
            return;
        }
        for (name, value) in &self.0 {
            match value {
                Value::String(text) => println!("{name}: {text}"),
                Value::Array(items) => {
                    println!("{name}: {}", items.len());
                    for item in items {
                        println!("  {item}");
                    }
                }
                other => println!("{name}: {other}"),
            }
        }
    }
}
