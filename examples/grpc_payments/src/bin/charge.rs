//! A client for the gRPC payments example: one charge, or the account's
//! charges.
//!
//! ```not_rust
//! cargo run -p grpc-payments --bin charge -- --token tok_alice --key order-42 --amount 1999 [--currency eur] [--addr http://127.0.0.1:50051]
//! cargo run -p grpc-payments --bin charge -- --token tok_alice --list
//! ```

use grpc_payments::{ChargeRequest, ListChargesRequest, PaymentsClient};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (mut addr, mut token, mut key) = ("http://127.0.0.1:50051".to_owned(), None, None);
    let (mut amount, mut currency, mut list) = (0, "eur".to_owned(), false);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{arg} needs a value")))
        };
        match arg.as_str() {
            "--addr" => addr = value(),
            "--token" => token = Some(value()),
            "--key" => key = Some(value()),
            "--amount" => {
                amount = value()
                    .parse()
                    .unwrap_or_else(|_| usage("--amount: a number of cents"))
            }
            "--currency" => currency = value(),
            "--list" => list = true,
            other => usage(&format!("unknown argument {other}")),
        }
    }
    let mut client = PaymentsClient::connect(addr)
        .await
        .unwrap_or_else(|e| usage(&format!("cannot connect: {e}")));
    let token = token.unwrap_or_else(|| usage("--token tok_<name> is required"));
    let authorization = format!("Bearer {token}")
        .parse()
        .unwrap_or_else(|_| usage("--token: not a header value"));
    if list {
        let mut request = tonic::Request::new(ListChargesRequest {});
        request
            .metadata_mut()
            .insert("authorization", authorization);
        let mut charges = client
            .list_charges(request)
            .await
            .unwrap_or_else(|s| fail(s))
            .into_inner();
        while let Some(charge) = charges.message().await.unwrap_or_else(|s| fail(s)) {
            println!("{} {} {}", charge.id, charge.amount, charge.currency);
        }
        return;
    }
    let mut request = tonic::Request::new(ChargeRequest {
        amount,
        currency,
        description: String::new(),
    });
    request
        .metadata_mut()
        .insert("authorization", authorization);
    if let Some(key) = key {
        let key = key
            .parse()
            .unwrap_or_else(|_| usage("--key: not a metadata value"));
        request.metadata_mut().insert("idempotency-key", key);
    }
    let response = client.charge(request).await.unwrap_or_else(|s| fail(s));
    let replayed = response.metadata().get("idempotent-replayed").is_some();
    let charge = response.into_inner();
    println!(
        "{} {} {}{}",
        charge.id,
        charge.amount,
        charge.currency,
        if replayed { " (replayed)" } else { "" }
    );
}

fn fail(status: tonic::Status) -> ! {
    eprintln!("{:?}: {}", status.code(), status.message());
    if let Some(pushback) = status.metadata().get("grpc-retry-pushback-ms") {
        eprintln!("retry after {} ms", pushback.to_str().unwrap_or("?"));
    }
    std::process::exit(1)
}

fn usage(why: &str) -> ! {
    eprintln!(
        "charge: {why}\nusage: charge --token tok_<name> (--key KEY --amount CENTS [--currency eur] | --list) [--addr URL]"
    );
    std::process::exit(2)
}
