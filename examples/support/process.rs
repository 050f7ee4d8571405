//! The examples as child processes, as the examples' tests run them: the
//! binaries `cargo test` builds beside the tests.

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
        "{} is missing: run the tests with `cargo test` (at the root, or in the example's package), which builds the examples",
        bin.display()
    );
    bin
}

/// Runs the example `name` with `env` until it exits, or kills it after
/// 10 s: its exit status and everything it printed.
pub fn run_example_to_exit(name: &str, env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    run_example_to_exit_within(name, env, std::time::Duration::from_secs(10))
}

/// Runs the example `name` with `env` until it exits, or kills it after
/// `within`: its exit status and everything it printed.
pub fn run_example_to_exit_within(
    name: &str,
    env: &[(&str, &str)],
    within: std::time::Duration,
) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(example_binary(name))
        .env("BIND_ADDR", "127.0.0.1:0")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run the {name} example: {e}"));
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status, text)
}

/// An example serving on a port, as a child process: killed when dropped.
pub struct Example {
    pub child: Child,
    pub addr: String,
    /// Everything the process printed (stdout and stderr) after its first line.
    output: Arc<Mutex<String>>,
}

impl Example {
    /// Starts the example `name` with `env` on `127.0.0.1:port` and waits
    /// for its "listening on" line.
    pub fn start_named(name: &str, port: u16, env: &[(&str, &str)]) -> Self {
        let addr = format!("127.0.0.1:{port}");
        let mut child = Command::new(example_binary(name))
            .env("BIND_ADDR", &addr)
            .env("RUST_LOG", "off")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start the {name} example: {e}"));
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let output = Arc::new(Mutex::new(String::new()));
        let mut line = String::new();
        loop {
            line.clear();
            let n = stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the {name} example exited before listening");
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

    /// Sends `signal` (`STOP`, `CONT`, …) to the process, as `kill -SIGNAL`.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal}");
    }

    /// What the process printed so far, besides its "listening on" line.
    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
