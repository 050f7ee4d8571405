//! The orders consumer examples (`orders_consumer`, `sqs_orders`,
//! `nats_orders`) as child processes: their stdout lines, one per
//! delivery, read as they come.

use super::process::example_binary;
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

pub struct OrdersConsumer {
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// Its stderr (its log, `RUST_LOG` as the test sets it; off unless),
    /// also passed on to the test's.
    log: Arc<Mutex<Vec<String>>>,
}

impl OrdersConsumer {
    /// Starts the RabbitMQ consumer and waits until it consumes.
    pub async fn start(env: &[(&str, &str)]) -> Self {
        Self::start_example("orders_consumer", env, "consuming ").await
    }

    /// Starts `example` and waits for its line starting with `ready`.
    pub async fn start_example(example: &str, env: &[(&str, &str)], ready: &str) -> Self {
        Self::start_under(&[], example, env, ready).await
    }

    /// Starts `example` under `wrapper` (`faketime -f +40s`, say) and waits
    /// for its line starting with `ready`.
    pub async fn start_under(
        wrapper: &[&str],
        example: &str,
        env: &[(&str, &str)],
        ready: &str,
    ) -> Self {
        let binary = example_binary(example);
        let mut command = match wrapper.split_first() {
            None => Command::new(&binary),
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(&binary);
                command
            }
        };
        let mut child = command
            .env("RUST_LOG", "off")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the orders_consumer example");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let lines = Arc::new(Mutex::new(Vec::new()));
        std::thread::spawn({
            let lines = lines.clone();
            move || {
                for line in stdout.lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
            }
        });
        let log = Arc::new(Mutex::new(Vec::new()));
        std::thread::spawn({
            let log = log.clone();
            move || {
                for line in stderr.lines().map_while(Result::ok) {
                    eprintln!("{line}");
                    log.lock().unwrap().push(line);
                }
            }
        });
        let consumer = Self { child, lines, log };
        consumer.wait_for(|l| l.starts_with(ready)).await;
        consumer
    }

    /// SIGTERM, as a supervisor stops it.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Waits up to `within` for the process to exit.
    pub async fn exited(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if std::time::Instant::now() >= deadline {
                // What it said and logged, to tell where it is stuck.
                let log = self.log.lock().unwrap();
                let tail = &log[log.len().saturating_sub(40)..];
                panic!(
                    "still running after {within:?}; its lines: {:?}; its log's last lines:\n{}",
                    self.lines(),
                    tail.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Its stderr lines so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Waits (up to 20 s) for a line that satisfies `f`.
    pub async fn wait_for(&self, f: impl Fn(&str) -> bool) -> String {
        self.wait_for_within(f, Duration::from_secs(20)).await
    }

    /// Waits up to `within` for a line that satisfies `f`.
    pub async fn wait_for_within(&self, f: impl Fn(&str) -> bool, within: Duration) -> String {
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if let Some(line) = self.lines().into_iter().find(|l| f(l)) {
                return line;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no such line within {within:?}; got {:?}", self.lines());
    }

    /// SIGKILL, as in a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OrdersConsumer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The examples' charges table, one row per execution.
pub const CHARGES: &str = "SELECT count(*) FROM order_charges";

/// Orders charged more than once.
pub const TWICE: &str = "SELECT count(*) FROM (SELECT order_id FROM order_charges GROUP BY order_id \
     HAVING count(*) <> 1) AS twice";

/// On PostgreSQL: the work's row inserted, its transaction open.
pub const IN_TRANSACTION: &str = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
     AND state = 'idle in transaction' AND query LIKE 'INSERT INTO order_charges%'";

/// An order message, as the examples read them.
pub fn order(id: &str, amount: i64) -> String {
    format!(r#"{{"order_id":"{id}","amount":{amount},"currency":"eur"}}"#)
}

/// The lines of all `consumers` that satisfy `f`.
pub fn count(consumers: &[&OrdersConsumer], f: impl Fn(&str) -> bool) -> usize {
    consumers
        .iter()
        .flat_map(|c| c.lines())
        .filter(|l| f(l))
        .count()
}
