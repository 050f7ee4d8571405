//! The `payments` example as a child process, built by `cargo test` beside
//! the tests: started, SIGKILLed and restarted like a real deployment.

use std::{
    io::{BufRead, BufReader, Read},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
};

/// An example binary built by `cargo test` beside the tests, or a panic
/// that says how to build it.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo test --all-features`, which builds the examples",
        bin.display()
    );
    bin
}

fn payments_binary() -> PathBuf {
    example_binary("payments")
}

pub struct Payments {
    pub child: Child,
    pub addr: String,
    /// Everything the process printed (stdout and stderr) after its first line.
    output: Arc<Mutex<String>>,
}

impl Payments {
    /// Starts the example with `env` on `127.0.0.1:port` and waits for its
    /// "listening on" line.
    pub fn start(port: u16, env: &[(&str, &str)]) -> Self {
        let addr = format!("127.0.0.1:{port}");
        let mut child = Command::new(payments_binary())
            .env("BIND_ADDR", &addr)
            .env("RUST_LOG", "off")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the payments example");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let output = Arc::new(Mutex::new(String::new()));
        let mut line = String::new();
        loop {
            line.clear();
            let n = stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the example exited before listening");
            if line.starts_with("listening on") {
                break;
            }
            output.lock().unwrap().push_str(&line);
        }
        let stderr = child.stderr.take().unwrap();
        for mut stream in [Box::new(stdout) as Box<dyn Read + Send>, Box::new(stderr)] {
            let output = output.clone();
            std::thread::spawn(move || {
                let mut buf = [0; 4096];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    output
                        .lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        Self {
            child,
            addr,
            output,
        }
    }

    /// What the process printed so far, besides its "listening on" line.
    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }
}

impl Drop for Payments {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the example with `env` until it exits (it must refuse to start),
/// or kills it after 10 s: its exit status and everything it printed.
pub fn run_to_exit(env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(payments_binary())
        .env("BIND_ADDR", "127.0.0.1:0")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the payments example");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status, text)
}

/// The example's crash-test charge: account `acct_crash`, key `crash-1`.
pub fn charge_request(addr: &str) -> http::Request<axum::body::Body> {
    http::Request::post(format!("http://{addr}/v1/charges"))
        .header("authorization", "Bearer acct_crash")
        .header("idempotency-key", "crash-1")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(r#"{"amount":500,"currency":"usd"}"#))
        .unwrap()
}
