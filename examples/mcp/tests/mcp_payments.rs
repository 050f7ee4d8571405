//! The `mcp_payments` example as a process, called over HTTP as MCP
//! clients call it — re-sent with new ids, at once, hung up on, killed —
//! and through rmcp's own client; charges counted in its database, never
//! trusted from a reply alone.

#[path = "../../../tests/support/http.rs"]
#[allow(dead_code)]
mod http_support;
#[path = "../../support/process.rs"]
#[allow(dead_code)]
mod process;

use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use serde_json::{Value, json};
use tower_idempotency::mcp::codes;
use tower_idempotency_harness::{redis_server::free_port, sqlite::TestFile};

use http_support::{HttpClient, Reply};
use process::Example;

/// A database of the test's own: charges and records.
enum Database {
    Sqlite(TestFile),
    #[cfg(feature = "postgres")]
    Postgres(tower_idempotency_harness::postgres::TestDatabase),
    #[cfg(feature = "mysql")]
    MySql(tower_idempotency_harness::mysql::TestDatabase),
}

impl Database {
    fn url(&self) -> String {
        match self {
            Self::Sqlite(file) => file.url(),
            #[cfg(feature = "postgres")]
            Self::Postgres(db) => db.url().to_owned(),
            #[cfg(feature = "mysql")]
            Self::MySql(db) => db.url().to_owned(),
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        match self {
            Self::Sqlite(file) => file.count(sql).await,
            #[cfg(feature = "postgres")]
            Self::Postgres(db) => db.count(sql).await,
            #[cfg(feature = "mysql")]
            Self::MySql(db) => db.count(sql).await,
        }
    }
}

/// The example on a database of its own.
struct Server {
    example: Example,
    file: Database,
    client: HttpClient,
}

impl Server {
    fn start(env: &[(&str, &str)]) -> Self {
        Self::on(Database::Sqlite(TestFile::create()), free_port(), env)
    }

    /// On `file`, at `port`, with `env`; the tool's log lines printed, so a
    /// test can tell when a call is under way.
    fn on(file: Database, port: u16, env: &[(&str, &str)]) -> Self {
        let url = file.url();
        let mut all = vec![
            ("DATABASE_URL", url.as_str()),
            ("RUST_LOG", "mcp_payments=info"),
        ];
        all.extend_from_slice(env);
        let example = Example::start_named("mcp_payments", port, &all);
        Self {
            example,
            file,
            client: HttpClient::default(),
        }
    }

    /// Stops the process and starts another on the same file and port.
    fn restart(self, env: &[(&str, &str)]) -> Self {
        let port = self.port();
        let Self { example, file, .. } = self;
        drop(example);
        Self::on(file, port, env)
    }

    fn port(&self) -> u16 {
        self.example
            .addr
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    async fn charges(&self) -> i64 {
        self.file.count("SELECT count(*) FROM mcp_charges").await
    }

    async fn send(&self, request: Request<Body>) -> Reply {
        self.client.send(request).await
    }

    /// How many calls the tool has begun (its "charging" log lines).
    fn begun(&self) -> usize {
        self.example
            .output()
            .matches("create_charge: charging")
            .count()
    }

    /// Waits until the tool has begun `n` calls.
    async fn until_begun(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.begun() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the tool never began; it printed: {}",
                self.example.output()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A JSON-RPC request to the example, as a 2026-07-28 client sends it.
struct Call<'a> {
    account: Option<&'a str>,
    id: Value,
    tool: &'a str,
    arguments: Value,
    key: Option<&'a str>,
    /// What else `_meta` carries: it changes on every retry.
    meta: Value,
}

impl<'a> Call<'a> {
    fn charge(key: &'a str, amount: i64) -> Self {
        Self {
            account: Some("acct_alice"),
            id: json!(1),
            tool: "create_charge",
            arguments: json!({"amount": amount, "currency": "eur", "description": "order"}),
            key: Some(key),
            meta: json!({}),
        }
    }

    fn id(mut self, id: Value) -> Self {
        self.id = id;
        self
    }

    fn account(mut self, account: &'a str) -> Self {
        self.account = Some(account);
        self
    }

    fn body(&self) -> Value {
        let mut meta = json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
        });
        for (name, value) in self.meta.as_object().unwrap() {
            meta[name] = value.clone();
        }
        if let Some(key) = self.key {
            meta["idempotency-key"] = json!(key);
        }
        json!({
            "jsonrpc": "2.0",
            "id": self.id,
            "method": "tools/call",
            "params": {"name": self.tool, "arguments": self.arguments, "_meta": meta},
        })
    }

    fn request(&self, server: &Server) -> Request<Body> {
        raw(
            server,
            self.account,
            "tools/call",
            Some(self.tool),
            self.body().to_string(),
        )
    }
}

/// A POST to `/mcp` with the transport's headers.
fn raw(
    server: &Server,
    account: Option<&str>,
    method: &str,
    name: Option<&str>,
    body: String,
) -> Request<Body> {
    let mut request = Request::post(format!("http://{}/mcp", server.example.addr))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", method);
    if let Some(name) = name {
        request = request.header("mcp-name", name);
    }
    if let Some(account) = account {
        request = request.header("authorization", format!("Bearer {account}"));
    }
    request.body(Body::from(body)).unwrap()
}

/// The JSON-RPC message of a reply: its JSON body, or the response in its
/// SSE stream.
fn message(reply: &Reply) -> Value {
    let text = std::str::from_utf8(&reply.body).unwrap();
    if reply.header("content-type") == Some("text/event-stream") {
        return text
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .filter_map(|data| serde_json::from_str::<Value>(data.trim()).ok())
            .find(|m| m.get("result").is_some() || m.get("error").is_some())
            .unwrap_or_else(|| panic!("no response in the stream: {text}"));
    }
    serde_json::from_str(text).unwrap_or_else(|_| panic!("not JSON: {text}"))
}

fn error_code(reply: &Reply) -> Option<i64> {
    message(reply)["error"]["code"].as_i64()
}

/// The body with its id taken out: what must be byte-identical between an
/// execution and its replays.
fn without_id(reply: &Reply, id: &Value) -> String {
    let text = std::str::from_utf8(&reply.body).unwrap();
    let spelled = format!("\"id\":{id}");
    assert!(text.contains(&spelled), "{text} answers {id}");
    text.replacen(&spelled, "", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_re_sent_with_new_ids_and_other_meta_charges_once() {
    let server = Server::start(&[]);
    let first = server
        .send(Call::charge("order-1", 1999).request(&server))
        .await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.is_replay());
    let charge = message(&first)["result"]["structuredContent"].clone();
    assert!(
        charge["id"].as_str().unwrap().starts_with("ch_"),
        "{charge}"
    );
    for (i, id) in [json!(2), json!("retry-3"), json!(4)]
        .into_iter()
        .enumerate()
    {
        let mut retry = Call::charge("order-1", 1999).id(id.clone());
        // The progress token and trace context change on every retry.
        retry.meta = json!({"progressToken": i, "traceparent": format!("00-{i:032x}-{i:016x}-01")});
        let replay = server.send(retry.request(&server)).await;
        assert!(replay.is_replay(), "{:?}", replay.body);
        assert_eq!(message(&replay)["id"], id, "each with its own id");
        assert_eq!(without_id(&replay, &id), without_id(&first, &json!(1)));
    }
    assert_eq!(server.charges().await, 1);
    assert_eq!(server.begun(), 1, "the tool ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_duplicates_charge_once() {
    concurrent_duplicates_charge_once(Server::start(&[("PROCESSOR_LATENCY_MS", "300")])).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_duplicates_charge_once_on_postgres() {
    let db = Database::Postgres(tower_idempotency_harness::postgres::TestDatabase::create());
    let server = Server::on(db, free_port(), &[("PROCESSOR_LATENCY_MS", "300")]);
    concurrent_duplicates_charge_once(server).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_duplicates_charge_once_on_mysql() {
    let db = Database::MySql(tower_idempotency_harness::mysql::TestDatabase::create());
    let server = Server::on(db, free_port(), &[("PROCESSOR_LATENCY_MS", "300")]);
    concurrent_duplicates_charge_once(server).await;
}

/// The database out of reach mid-service (the relay to it cut): a call is
/// refused with `-32012` and a retry hint, nothing charged; once it is
/// back, the same call under the same key runs, once.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_out_of_reach_refuses_the_call_with_a_retry_hint_and_charges_nothing() {
    use tower_idempotency_harness::{postgres::TestDatabase, relay::Relay};

    let db = TestDatabase::create();
    let relay = Relay::start(&db.host_port()).await;
    let url = db.url_via(relay.port());
    let example = Example::start_named(
        "mcp_payments",
        free_port(),
        &[
            ("DATABASE_URL", url.as_str()),
            ("RUST_LOG", "mcp_payments=info"),
        ],
    );
    let server = Server {
        example,
        file: Database::Postgres(db),
        client: HttpClient::default(),
    };
    let warm = server
        .send(Call::charge("order-warm", 100).request(&server))
        .await;
    assert!(message(&warm)["result"]["structuredContent"]["id"].is_string());
    relay.cut();
    let refused = server
        .send(Call::charge("order-13", 1999).request(&server))
        .await;
    let error = &message(&refused)["error"];
    assert_eq!(
        error["code"],
        json!(codes::STORE_UNAVAILABLE),
        "{:?}",
        refused.body
    );
    assert!(error["data"]["retryAfterMs"].as_u64().unwrap() > 0);
    assert!(refused.header("retry-after").is_some());
    relay.restore();
    assert_eq!(server.charges().await, 1, "only the warm-up charged");
    let retry = until_answered(&server, Call::charge("order-13", 1999)).await;
    assert!(!retry.is_replay());
    assert!(message(&retry)["result"]["structuredContent"]["id"].is_string());
    assert_eq!(server.charges().await, 2);
    assert_eq!(server.begun(), 2, "the refused call never ran");
}

/// 20 duplicates at once: one charge; every other answer the charge or the
/// in-flight refusal. Then a retry with a new id replays it.
async fn concurrent_duplicates_charge_once(server: Server) {
    let replies = futures_util::future::join_all((0..20).map(|i| {
        server.send(
            Call::charge("order-burst", 500)
                .id(json!(i))
                .request(&server),
        )
    }))
    .await;
    let mut charged = Vec::new();
    for (i, reply) in replies.iter().enumerate() {
        let message = message(reply);
        assert_eq!(message["id"], json!(i));
        match message["error"]["code"].as_i64() {
            None => charged.push(message["result"]["structuredContent"]["id"].clone()),
            Some(code) => {
                assert_eq!(code, i64::from(codes::IN_FLIGHT), "{message}");
                assert!(message["error"]["data"]["retryAfterMs"].as_u64().unwrap() > 0);
            }
        }
    }
    assert!(!charged.is_empty());
    assert!(
        charged.iter().all(|id| *id == charged[0]),
        "one charge: {charged:?}"
    );
    let retry = until_answered(&server, Call::charge("order-burst", 500)).await;
    assert!(retry.is_replay());
    assert_eq!(
        message(&retry)["result"]["structuredContent"]["id"],
        charged[0]
    );
    assert_eq!(server.charges().await, 1);
    assert_eq!(server.begun(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_amount_is_refused_and_nothing_runs() {
    let server = Server::start(&[]);
    server
        .send(Call::charge("order-2", 1999).request(&server))
        .await;
    let reused = server
        .send(Call::charge("order-2", 5000).id(json!(7)).request(&server))
        .await;
    assert_eq!(error_code(&reused), Some(i64::from(codes::KEY_REUSED)));
    assert_eq!(message(&reused)["id"], 7);
    assert_eq!(server.charges().await, 1);
    assert_eq!(server.begun(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_a_key_is_refused_naming_where_it_goes() {
    let server = Server::start(&[]);
    let mut call = Call::charge("unused", 1999);
    call.key = None;
    let refused = server.send(call.request(&server)).await;
    assert_eq!(error_code(&refused), Some(-32602));
    let text = message(&refused)["error"]["message"].to_string();
    assert!(text.contains("idempotency-key"), "{text}");
    assert_eq!(server.charges().await, 0);
    assert_eq!(server.begun(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_methods_and_unguarded_tools_pass_through_untouched() {
    let server = Server::start(&[]);
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}}}});
    let list = server
        .send(raw(
            &server,
            Some("acct_alice"),
            "tools/list",
            None,
            body.to_string(),
        ))
        .await;
    assert_eq!(list.status, StatusCode::OK);
    let tools = message(&list)["result"]["tools"].clone();
    let names: Vec<&str> = tools
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"create_charge") && names.contains(&"list_charges"),
        "{tools}"
    );
    assert!(!list.is_replay());
    let create = tools
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "create_charge")
        .unwrap();
    assert!(
        create["outputSchema"]["properties"]["id"].is_object(),
        "the charge's schema: {create}"
    );

    server
        .send(Call::charge("order-3", 100).request(&server))
        .await;
    // list_charges is unguarded: a key on it changes nothing, every call reads.
    let mut read = Call::charge("read-1", 0);
    read.tool = "list_charges";
    read.arguments = json!({});
    let before = server.send(read.request(&server)).await;
    server
        .send(Call::charge("order-4", 200).request(&server))
        .await;
    let after = server.send(read.id(json!(2)).request(&server)).await;
    assert!(!after.is_replay());
    let count = |reply: &Reply| {
        message(reply)["result"]["structuredContent"]["charges"]
            .as_array()
            .unwrap()
            .len()
    };
    assert_eq!((count(&before), count(&after)), (1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_under_two_accounts_is_two_charges() {
    let server = Server::start(&[]);
    let alice = server
        .send(Call::charge("order-5", 1999).request(&server))
        .await;
    let bob = server
        .send(
            Call::charge("order-5", 1999)
                .account("acct_bob")
                .request(&server),
        )
        .await;
    assert!(!alice.is_replay() && !bob.is_replay());
    assert_ne!(
        message(&alice)["result"]["structuredContent"]["id"],
        message(&bob)["result"]["structuredContent"]["id"]
    );
    assert_eq!(server.charges().await, 2);
    let mut anonymous = Call::charge("order-5", 1999);
    anonymous.account = None;
    let refused = server.send(anonymous.request(&server)).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    assert_eq!(server.charges().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_arguments_release_the_key() {
    let server = Server::start(&[]);
    let mut invalid = Call::charge("order-6", 1999);
    invalid.arguments = json!({"amount": 1999, "currency": "EURO"});
    let refused = server.send(invalid.request(&server)).await;
    assert_eq!(error_code(&refused), Some(-32602), "{:?}", refused.body);
    let again = server.send(invalid.id(json!(2)).request(&server)).await;
    assert_eq!(error_code(&again), Some(-32602));
    assert!(!again.is_replay(), "an error answer is never stored");
    // Corrected, under the same key: it runs.
    let corrected = server
        .send(Call::charge("order-6", 1999).id(json!(3)).request(&server))
        .await;
    assert!(!corrected.is_replay());
    assert!(message(&corrected)["result"]["structuredContent"]["id"].is_string());
    assert_eq!(server.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_card_is_replayed_never_run_again() {
    let server = Server::start(&[]);
    let declined = server
        .send(Call::charge("order-7", 2_000_000).request(&server))
        .await;
    assert_eq!(message(&declined)["result"]["isError"], true);
    let replay = server
        .send(
            Call::charge("order-7", 2_000_000)
                .id(json!(2))
                .request(&server),
        )
        .await;
    assert!(replay.is_replay());
    assert_eq!(message(&replay)["result"], message(&declined)["result"]);
    assert_eq!(server.begun(), 1, "the processor was asked once");
    assert_eq!(server.charges().await, 0);
}

/// Re-sends `call` with fresh ids until it is answered other than "in
/// flight": the answer.
async fn until_answered(server: &Server, call: Call<'_>) -> Reply {
    let mut call = call;
    for attempt in 100.. {
        call = call.id(json!(attempt));
        let reply = server.send(call.request(server)).await;
        if error_code(&reply) != Some(i64::from(codes::IN_FLIGHT)) {
            return reply;
        }
        assert!(attempt < 1_100, "still in flight after 1000 retries");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_call_then_retries_is_charged_once() {
    let server = Server::start(&[("PROCESSOR_LATENCY_MS", "500")]);
    let hung_up = tokio::spawn({
        let client = server.client.clone();
        let request = Call::charge("order-8", 1999).request(&server);
        async move { client.send(request).await }
    });
    server.until_begun(1).await;
    // The stream closes: the client's cancellation, by protocol.
    hung_up.abort();
    let retry = until_answered(&server, Call::charge("order-8", 1999)).await;
    assert!(
        retry.is_replay(),
        "the call ran to its end: {:?}",
        retry.body
    );
    assert_eq!(server.charges().await, 1);
    assert_eq!(server.begun(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_mid_call_charges_once_after_restart() {
    let server = Server::start(&[("PROCESSOR_LATENCY_MS", "5000")]);
    let doomed = tokio::spawn({
        let client = server.client.clone();
        let request = Call::charge("order-9", 1999).request(&server);
        async move { client.send(request).await }
    });
    server.until_begun(1).await;
    let mut server = server;
    server.example.child.kill().unwrap();
    server.example.child.wait().unwrap();
    doomed.abort();
    assert_eq!(server.charges().await, 0, "the charge died uncommitted");
    let server = server.restart(&[]);
    let retry = until_answered(&server, Call::charge("order-9", 1999)).await;
    assert!(!retry.is_replay(), "nothing was stored: it runs");
    assert!(message(&retry)["result"]["structuredContent"]["id"].is_string());
    assert_eq!(server.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_replays() {
    let server = Server::start(&[]);
    let first = server
        .send(Call::charge("order-10", 1999).request(&server))
        .await;
    let server = server.restart(&[]);
    let replay = server
        .send(Call::charge("order-10", 1999).id(json!(2)).request(&server))
        .await;
    assert!(replay.is_replay());
    assert_eq!(
        without_id(&replay, &json!(2)),
        without_id(&first, &json!(1))
    );
    assert_eq!(server.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_or_disagrees_with_its_headers_is_refused_and_nothing_stored() {
    let server = Server::start(&[]);
    let garbage = server
        .send(raw(
            &server,
            Some("acct_alice"),
            "tools/call",
            Some("create_charge"),
            "{not json".into(),
        ))
        .await;
    assert_eq!(garbage.status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&garbage), Some(i64::from(codes::PARSE_ERROR)));

    // Mcp-Name says list_charges (unguarded) but the body charges: the
    // door reads every tools/call's body, and refuses the disguise.
    let body = Call::charge("order-11", 1999).body().to_string();
    let disguised = server
        .send(raw(
            &server,
            Some("acct_alice"),
            "tools/call",
            Some("list_charges"),
            body.clone(),
        ))
        .await;
    assert_eq!(disguised.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_code(&disguised),
        Some(i64::from(codes::HEADER_MISMATCH))
    );
    // Mcp-Method says tools/list, the body charges: the server refuses it.
    let mislabelled = server
        .send(raw(&server, Some("acct_alice"), "tools/list", None, body))
        .await;
    assert_ne!(mislabelled.status, StatusCode::OK);
    assert_eq!(server.charges().await, 0);
    assert_eq!(server.begun(), 0);
    // Nothing was stored under the key: the real call runs.
    let real = server
        .send(Call::charge("order-11", 1999).request(&server))
        .await;
    assert!(!real.is_replay());
    assert_eq!(server.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_answering_server_is_replayed_the_same_way() {
    let server = Server::start(&[("MCP_RESPONSE", "json")]);
    let first = server
        .send(Call::charge("order-12", 1999).request(&server))
        .await;
    let replay = server
        .send(
            Call::charge("order-12", 1999)
                .id(json!("b"))
                .request(&server),
        )
        .await;
    assert!(replay.is_replay());
    assert_eq!(
        without_id(&replay, &json!("b")),
        without_id(&first, &json!(1))
    );
    assert_eq!(server.charges().await, 1);
}

/// rmcp's own client over Streamable HTTP: it lists the tools, then calls
/// `create_charge` twice with one key in `_meta`. One charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rmcp_s_client_calling_twice_with_one_key_charges_once() {
    use rmcp::{
        ClientLifecycleMode, ClientServiceExt,
        model::{CallToolRequestParams, ClientConfig, ProtocolVersion},
        transport::{
            StreamableHttpClientTransport,
            streamable_http_client::StreamableHttpClientTransportConfig,
        },
    };

    let server = Server::start(&[]);
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(format!(
            "http://{}/mcp",
            server.example.addr
        ))
        .auth_header("acct_agent"),
    );
    let client = ClientConfig::default()
        .serve_with_lifecycle(
            transport,
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            },
        )
        .await
        .expect("the client starts");
    let tools = client.list_tools(None).await.expect("tools/list");
    assert!(tools.tools.iter().any(|t| t.name == "create_charge"));
    let call = || -> CallToolRequestParams {
        serde_json::from_value(json!({
            "name": "create_charge",
            "arguments": {"amount": 4200, "currency": "usd"},
            "_meta": {"idempotency-key": "agent-order-1"},
        }))
        .unwrap()
    };
    // Bounded: a reply to another id would leave the client waiting.
    let within = |call| tokio::time::timeout(Duration::from_secs(30), call);
    let first = within(client.call_tool(call()))
        .await
        .expect("answered")
        .expect("the first call");
    let second = within(client.call_tool(call()))
        .await
        .expect("answered")
        .expect("the second call");
    assert_eq!(first.structured_content, second.structured_content);
    assert!(first.structured_content.unwrap()["id"].is_string());
    client.cancel().await.expect("the client stops");
    assert_eq!(server.charges().await, 1);
    assert_eq!(server.begun(), 1);
}

/// The MCP Python SDK (2.3, protocol 2026-07-28) as a second real client:
/// it lists the tools and calls `create_charge` twice with one key in
/// `_meta`. One charge. The SDK is installed by `scripts/services`, in
/// `target/tools/python` (or `MCP_PYTHON` names a Python that has it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_calling_twice_with_one_key_charges_once() {
    let python = std::env::var("MCP_PYTHON").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../target/tools/python/bin/python"
        )
        .to_owned()
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python_client.py");
    let server = Server::start(&[]);
    let url = format!("http://{}/mcp", server.example.addr);
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(&python)
            .args([script, &url, "acct_python", "py-order-1"])
            .output(),
    )
    .await
    .expect("the Python client finished")
    .unwrap_or_else(|e| {
        panic!("{python}: {e}; run scripts/services, which installs the MCP Python SDK (mcp 2.3)")
    });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python client failed: {stderr}"
    );
    let got: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(got["tools"], json!(["create_charge", "list_charges"]));
    let calls = got["calls"].as_array().unwrap();
    assert_eq!(calls[0]["isError"], false);
    assert!(calls[0]["structuredContent"]["id"].is_string());
    assert_eq!(calls[0], calls[1], "the retry got the same charge");
    assert_eq!(server.charges().await, 1);
    assert_eq!(server.begun(), 1);
}
