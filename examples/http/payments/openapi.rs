//! The API's own OpenAPI description, served at `GET /openapi.json`: its
//! routes, described by hand, and the idempotency layer's contract on the
//! charge route added by `IdempotencyDocs` — the `Idempotency-Key` header
//! (required here), `Idempotent-Replayed`, and the `400`/`409`/`422`/`503`
//! problems with their `Retry-After`.

use tower_idempotency::{
    openapi::IdempotencyDocs,
    utoipa::{
        Modify,
        openapi::{
            Content, HttpMethod, InfoBuilder, ObjectBuilder, OpenApi, OpenApiBuilder, PathItem,
            PathsBuilder, ResponseBuilder, Type,
            path::{OperationBuilder, ParameterBuilder, ParameterIn},
            request_body::RequestBodyBuilder,
        },
    },
};

/// The document `GET /openapi.json` serves.
pub fn spec() -> OpenApi {
    let json = |description: &str| {
        ResponseBuilder::new().description(description).content(
            "application/json",
            Content::new(Some(ObjectBuilder::new().schema_type(Type::Object).build())),
        )
    };
    let charge = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("amount", ObjectBuilder::new().schema_type(Type::Integer))
        .property("currency", ObjectBuilder::new().schema_type(Type::String))
        .property(
            "description",
            ObjectBuilder::new().schema_type(Type::String),
        )
        .required("amount")
        .required("currency")
        .build();
    let bearer = ParameterBuilder::new()
        .name("Authorization")
        .parameter_in(ParameterIn::Header)
        .required(tower_idempotency::utoipa::openapi::Required::True)
        .description(Some(
            "`Bearer <token>`: the account, and the idempotency scope.",
        ))
        .build();
    let create = OperationBuilder::new()
        .operation_id(Some("create_charge"))
        .summary(Some("Charge an account, once per idempotency key"))
        .parameter(bearer.clone())
        .request_body(Some(
            RequestBodyBuilder::new()
                .content("application/json", Content::new(Some(charge)))
                .build(),
        ))
        .response("201", json("The charge"))
        .response(
            "401",
            ResponseBuilder::new().description("No or unknown bearer token"),
        )
        .build();
    let list = OperationBuilder::new()
        .operation_id(Some("list_charges"))
        .parameter(bearer)
        .response("200", json("The account's charges"))
        .build();
    let mut charges = PathItem::new(HttpMethod::Post, create);
    charges.get = Some(list);
    let mut api = OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("payments (tower-idempotency example)")
                .version(env!("CARGO_PKG_VERSION"))
                .build(),
        )
        .paths(PathsBuilder::new().path("/v1/charges", charges))
        .build();
    IdempotencyDocs::new()
        .only(["/v1/charges"])
        .require_key(true)
        .modify(&mut api);
    api
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
        for status in ["400", "409", "422", "503"] {
            assert!(post["responses"][status].is_object(), "{status}");
        }
        // Reads are not guarded.
        let get = &json["paths"]["/v1/charges"]["get"];
        assert!(get["responses"]["409"].is_null());
    }
}
