//! The document the example serves at `/openapi.json` is valid OpenAPI,
//! and describes what the example answers: schemathesis, run against the
//! example process with every check, finds nothing. Both tools come from
//! PyPI (`pip install schemathesis openapi-spec-validator`; `.ci/run`
//! installs them); a missing one fails the test saying so.

use std::process::Command;

use crate::support::{payments::Payments, redis_server::free_port, sqlite::TestFile};

/// `tool` on `PATH`, or a panic that says how to install it.
fn tool(tool: &str) -> Command {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|out| out.status.success());
    assert!(
        found,
        "{tool} is not on PATH: install it with `pip install schemathesis openapi-spec-validator`"
    );
    Command::new(tool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_document_validates_and_schemathesis_finds_nothing() {
    let file = TestFile::create();
    let payments = Payments::start(free_port(), &[("DATABASE_URL", file.url().as_str())]);
    let url = format!("http://{}/openapi.json", payments.addr);
    let document = std::env::temp_dir().join(format!("payments-openapi-{}.json", free_port()));
    let served = get(&url).await;
    std::fs::write(&document, &served).unwrap();

    let validated = tool("openapi-spec-validator")
        .arg(&document)
        .output()
        .unwrap();
    assert!(
        validated.status.success(),
        "the served document is not valid OpenAPI:\n{}{}",
        String::from_utf8_lossy(&validated.stdout),
        String::from_utf8_lossy(&validated.stderr)
    );
    let _ = std::fs::remove_file(&document);

    // Bounded: a fixed number of cases per operation, a fixed seed.
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/schemathesis.toml");
    let run = tool("schemathesis")
        .args(["--config-file", config, "--no-color", "run", &url])
        .args([
            "--checks",
            "all",
            "--max-examples",
            "100",
            "--seed",
            "20261203",
        ])
        .args(["-H", "Authorization: Bearer acct_schemathesis"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && said.contains("No issues found"),
        "schemathesis found something:\n{said}{}\n{}",
        String::from_utf8_lossy(&run.stderr),
        payments.output()
    );
}

/// The body of `GET url`.
async fn get(url: &str) -> Vec<u8> {
    let client = crate::support::http::HttpClient::default();
    let request = http::Request::get(url)
        .body(axum::body::Body::empty())
        .unwrap();
    let reply = client.send(request).await;
    assert_eq!(reply.status, http::StatusCode::OK);
    reply.body.to_vec()
}
