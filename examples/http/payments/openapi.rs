//! The API's own OpenAPI description, served at `GET /openapi.json`: its
//! routes as they answer — the charges, the processor's webhooks, the
//! bearer token, the `problem+json` refusals (`400` invalid input, `401`,
//! `408` the request timeout) — with the idempotency layer's contract added
//! by `IdempotencyDocs`: the `Idempotency-Key` header (required here; the
//! webhook's key is its event id, in the body), `Idempotent-Replayed`, and
//! the layer's own answers with their `Retry-After`. It validates as OpenAPI
//! 3.1, and schemathesis finds nothing in it against the running example
//! (`examples/http/tests/processes/openapi.rs`).

use tower_idempotency::{
    openapi::{IdempotencyDocs, PROBLEM_SCHEMA},
    utoipa::{
        Modify,
        openapi::{
            ArrayBuilder, ComponentsBuilder, Content, HttpMethod, InfoBuilder, ObjectBuilder,
            OpenApi, OpenApiBuilder, PathItem, PathsBuilder, Ref, RefOr, Required, Response,
            ResponseBuilder, Schema, Type,
            header::HeaderBuilder,
            path::{Operation, OperationBuilder, Parameter, ParameterBuilder, ParameterIn},
            request_body::RequestBodyBuilder,
            schema::SchemaType,
        },
    },
};

/// The document `GET /openapi.json` serves.
pub fn spec() -> OpenApi {
    let mut charges = PathItem::new(HttpMethod::Post, create_charge());
    charges.get = Some(list_charges());
    let mut webhooks = PathItem::new(HttpMethod::Post, receive_event());
    webhooks.get = Some(list_events());
    let mut api = OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("payments (tower-idempotency example)")
                .version(env!("CARGO_PKG_VERSION"))
                .build(),
        )
        .paths(
            PathsBuilder::new()
                .path("/v1/charges", charges)
                .path("/v1/webhooks/processor", webhooks),
        )
        .components(Some(
            ComponentsBuilder::new()
                .schema("NewCharge", new_charge())
                .schema("Charge", charge())
                .schema("Event", event())
                .build(),
        ))
        .build();
    IdempotencyDocs::new()
        .only(["/v1/charges"])
        .require_key(true)
        .modify(&mut api);
    IdempotencyDocs::new()
        .only(["/v1/webhooks/processor"])
        .key_from_body("/id")
        .require_key(true)
        .modify(&mut api);
    api
}

fn create_charge() -> Operation {
    let created = ResponseBuilder::new()
        .description("The charge: executed now, or replayed from the first request with this key")
        .header(
            "Location",
            HeaderBuilder::new()
                .schema(Some(string().build()))
                .description(Some("The charge's path."))
                .build(),
        )
        .content("application/json", Content::new(Some(named("Charge"))))
        .build();
    OperationBuilder::new()
        .operation_id(Some("create_charge"))
        .summary(Some("Charge an account, once per idempotency key"))
        .parameter(account())
        .request_body(Some(
            RequestBodyBuilder::new()
                .content("application/json", Content::new(Some(named("NewCharge"))))
                .required(Some(Required::True))
                .build(),
        ))
        .response("201", created)
        .response(
            "400",
            problem(
                "The body is not a valid charge (or the idempotency key is missing or malformed).",
            ),
        )
        .response("401", problem("No bearer token."))
        .response("408", timed_out())
        .response(
            "500",
            problem(
                "The charge could not be recorded; nothing was charged. Retry with the same key.",
            ),
        )
        .build()
}

fn list_charges() -> Operation {
    let list = ArrayBuilder::new().items(named("Charge")).build();
    OperationBuilder::new()
        .operation_id(Some("list_charges"))
        .summary(Some("The account's charges: one per execution"))
        .parameter(account())
        .response(
            "200",
            ResponseBuilder::new()
                .description("The account's charges")
                .content("application/json", Content::new(Some(list))),
        )
        .response("401", problem("No bearer token."))
        .response("408", timed_out())
        .response(
            "503",
            problem("The charges cannot be read now; try again later."),
        )
        .build()
}

fn receive_event() -> Operation {
    let received = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("received", string())
        .required("received")
        .build();
    OperationBuilder::new()
        .operation_id(Some("receive_processor_event"))
        .summary(Some(
            "The card processor's webhook: each event recorded once",
        ))
        .request_body(Some(
            RequestBodyBuilder::new()
                .content("application/json", Content::new(Some(named("Event"))))
                .required(Some(Required::True))
                .build(),
        ))
        .response(
            "200",
            ResponseBuilder::new()
                .description("The event is recorded (now, or by an earlier delivery)")
                .content("application/json", Content::new(Some(received))),
        )
        .response("400", problem("The body is not an event with an `id`."))
        .response("408", timed_out())
        .response(
            "500",
            problem("The event could not be recorded; deliver it again."),
        )
        .build()
}

fn list_events() -> Operation {
    let list = ArrayBuilder::new().items(named("Event")).build();
    OperationBuilder::new()
        .operation_id(Some("list_processor_events"))
        .summary(Some("The processor's events, one per event id"))
        .response(
            "200",
            ResponseBuilder::new()
                .description("The recorded events")
                .content("application/json", Content::new(Some(list))),
        )
        .response("408", timed_out())
        .response("500", problem("The events could not be read."))
        .build()
}

/// What `POST /v1/charges` takes: the handler refuses anything else with
/// `400`.
fn new_charge() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .property(
            "amount",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(
                    tower_idempotency::utoipa::openapi::SchemaFormat::KnownFormat(
                        tower_idempotency::utoipa::openapi::KnownFormat::Int64,
                    ),
                ))
                .minimum(Some(1))
                .maximum(Some(i64::MAX))
                .description(Some("In the currency's minor unit (cents).")),
        )
        .property(
            "currency",
            string()
                .pattern(Some("^[A-Za-z]{3}$"))
                .description(Some("An ISO 4217 code; stored lowercase.")),
        )
        .property("description", nullable_string())
        .required("amount")
        .required("currency")
        .build()
        .into()
}

fn charge() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("id", string())
        .property("account", string())
        .property("amount", ObjectBuilder::new().schema_type(Type::Integer))
        .property("currency", string())
        .property("description", nullable_string())
        .required("id")
        .required("account")
        .required("amount")
        .required("currency")
        .build()
        .into()
}

fn event() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .property(
            "id",
            string()
                .min_length(Some(1))
                .max_length(Some(tower_idempotency::IdempotencyKey::MAX_LEN))
                .pattern(Some("^[!-~]+$"))
                .description(Some("The event's id: its idempotency key.")),
        )
        .property("type", nullable_string())
        .required("id")
        .build()
        .into()
}

/// The bearer token, which names the account (any token is an account in
/// this example: it stands for your authentication) and is the
/// idempotency scope.
fn account() -> Parameter {
    ParameterBuilder::new()
        .name("Authorization")
        .parameter_in(ParameterIn::Header)
        .required(Required::True)
        .description(Some(
            "`Bearer <token>`: the token names the account, which is also the idempotency scope.",
        ))
        .schema(Some(string().pattern(Some("^Bearer +[!-~][\t -~]*$"))))
        .build()
}

fn string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

fn nullable_string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(SchemaType::from_iter([Type::String, Type::Null]))
}

fn named(schema: &str) -> RefOr<Schema> {
    RefOr::Ref(Ref::from_schema_name(schema))
}

/// A `problem+json` answer of the example's own.
fn problem(description: &str) -> Response {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/problem+json",
            Content::new(Some(named(PROBLEM_SCHEMA))),
        )
        .build()
}

/// The request timeout outside every route (`REQUEST_TIMEOUT_MS`): the
/// handler goes on, detached, and a retry with the key gets its answer.
fn timed_out() -> Response {
    problem(
        "The request outlived the server's timeout. A guarded request still completes, detached \
         from the connection: retry it with the same key to get its answer.",
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_charge_route_states_the_idempotency_contract() {
        let json = serde_json::to_value(super::spec()).unwrap();
        let post = &json["paths"]["/v1/charges"]["post"];
        let key = post["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "Idempotency-Key")
            .expect("the key header");
        assert_eq!(key["required"], true);
        assert!(post["responses"]["201"]["headers"]["Idempotent-Replayed"].is_object());
        for status in ["400", "401", "408", "409", "413", "422", "500", "503"] {
            assert!(post["responses"][status].is_object(), "{status}");
        }
        // Reads are not guarded.
        let get = &json["paths"]["/v1/charges"]["get"];
        assert!(get["responses"]["409"].is_null());
        assert_eq!(
            get["responses"]["200"]["content"]["application/json"]["schema"]["type"],
            "array"
        );
        // The webhook's key is its event id, in the body: no key header.
        let webhook = &json["paths"]["/v1/webhooks/processor"]["post"];
        assert!(webhook["parameters"].is_null(), "{webhook}");
        assert!(webhook["responses"]["422"].is_object());
    }
}
