//! The examples as child processes, as the examples' tests run them: the
//! binaries `cargo test` builds beside the tests.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
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
