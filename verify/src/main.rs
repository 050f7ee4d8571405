//! `verify`: the soak, from the command line.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use tower_idempotency_verify::{chain, deploy::StoreKind, run, workload::Workload};

const USAGE: &str =
    "usage: verify [--store sqlite|postgres|mysql|redis|valkey|redis-cluster|redis-no-downstream-key|dynamodb|sqs-chain|kafka-chain] \
[--seed N] [--secs N] [--instances N] [--workers N] [--out DIR]

Runs the payments example (or, with sqs-chain and kafka-chain, the SQS or
Kafka order consumers)
under random faults, records every attempt in DIR/history.jsonl, checks
it, and writes DIR/report.txt and DIR/timeline.svg. Exits 1 when the
checker found a violation, 2 on a usage error. The example binaries are
the ones built beside this one (cargo build [--release] --examples --all-features).";

fn usage(why: &str) -> ! {
    eprintln!("verify: {why}\n{USAGE}");
    std::process::exit(2)
}

#[tokio::main]
async fn main() -> ExitCode {
    let (mut store, mut seed, mut secs, mut instances) = ("sqlite".to_owned(), None, 30u64, 3usize);
    let (mut workers, mut out) = (10usize, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        let number = |v: String| {
            v.parse::<u64>()
                .unwrap_or_else(|_| usage("a whole number, please"))
        };
        match flag.as_str() {
            "--store" => store = value(),
            "--seed" => seed = Some(number(value())),
            "--secs" => secs = number(value()),
            "--instances" => instances = number(value()) as usize,
            "--workers" => workers = number(value()) as usize,
            "--out" => out = Some(PathBuf::from(value())),
            "--help" | "-h" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => usage(&format!("unknown argument {other}")),
        }
    }
    let seed = seed.unwrap_or_else(|| fastrand::u64(..1_000_000));
    let out = out.unwrap_or_else(|| PathBuf::from(format!("target/verify/{store}-{seed}")));
    let duration = Duration::from_secs(secs);
    println!(
        "verify: {store}, seed {seed}, {secs} s; output in {}",
        out.display()
    );
    let chain_plan = |name: &str| chain::Plan {
        seed,
        duration,
        consumers: instances,
        out: out.clone(),
        binary: example(name),
    };
    let report = if store == "sqs-chain" {
        use chain::Line;
        chain::run::<chain::Sqs>(&chain_plan(chain::Sqs::EXAMPLE))
            .await
            .0
    } else if store == "kafka-chain" {
        use chain::Line;
        chain::run::<chain::Kafka>(&chain_plan(chain::Kafka::EXAMPLE))
            .await
            .0
    } else {
        let kind =
            StoreKind::parse(&store).unwrap_or_else(|| usage(&format!("unknown store {store}")));
        let plan = run::Plan {
            store: kind,
            seed,
            duration,
            instances,
            workload: Workload {
                workers,
                ..Workload::default()
            },
            out: out.clone(),
            binary: example("payments"),
        };
        run::http(&plan).await.report
    };
    print!("{report}");
    if report.passed() {
        println!("verify: passed ({})", out.join("report.txt").display());
        ExitCode::SUCCESS
    } else {
        for violation in report.violations.iter().take(20) {
            println!("  {violation}");
        }
        println!(
            "verify: FAILED, seed {seed}: the failing keys' histories are in {}",
            out.join("report.txt").display()
        );
        ExitCode::from(1)
    }
}

/// An example binary built beside this one.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("this binary's path");
    let bin = exe.parent().unwrap().join("examples").join(name);
    if !bin.exists() {
        usage(&format!(
            "{} is missing: build the examples first (cargo build --release --examples --all-features, or without --release for a debug build of this tool)",
            bin.display()
        ));
    }
    bin
}
