//! Captures what the crate logs during a test, to assert on it.
//!
//! The subscriber is the calling thread's default: run the test on a
//! current-thread runtime so every task logs through it.

use std::{
    io::Write,
    sync::{Arc, Mutex, Once},
};

use tracing::{Subscriber, subscriber::DefaultGuard};

#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Captures every event at `filter` (an `EnvFilter` directive such as
    /// `tower_idempotency=trace`) until the guard is dropped.
    pub fn capture(filter: &str) -> (Self, DefaultGuard) {
        let logs = Self::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, scoped(subscriber))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Makes `subscriber` the calling thread's default until the guard is
/// dropped, seeing every callsite it enables whichever thread hits it first.
///
/// While a single thread-scoped subscriber exists, tracing asks only the
/// *registering* thread's default whether a new callsite is of interest: a
/// callsite first hit by another test's thread (no subscriber there) is
/// cached as never enabled, and this thread's spans and events vanish. A
/// global default that stays registered for the whole run keeps tracing
/// asking every live subscriber. It records nothing itself.
pub fn scoped(subscriber: impl Subscriber + Send + Sync + 'static) -> DefaultGuard {
    static GLOBAL: Once = Once::new();
    GLOBAL.call_once(|| {
        tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default())
            .expect("no other global subscriber in the tests");
    });
    tracing::subscriber::set_default(subscriber)
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
