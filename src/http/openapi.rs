//! The layer's contract in an OpenAPI description, for
//! [`utoipa`](https://docs.rs/utoipa): the `Idempotency-Key` request header
//! (or, for a route whose key is in the body, where), the
//! `Idempotent-Replayed` (and, when told, `Idempotency-Replayable-For`)
//! response headers, and every answer the layer gives of its own, as
//! `problem+json`: `400` for a missing or malformed key, `409` for a
//! duplicate in flight and `503` for an unreachable store (both with
//! `Retry-After`), `413` for a body over the limit, `422` for a key reused
//! with other parameters, `500` for a server-side fault that ran nothing
//! or committed nothing, and the rare `406` and `502`.
//!
//! [`IdempotencyDocs`] is a [`Modify`]: add it to the `OpenApi` derive's
//! `modifiers`, or apply it to a built document, and it describes the
//! operations the layer guards (`POST` and `PATCH` by default, on every
//! path or on the ones named). What the application already says about a
//! status is kept. The document it leaves is valid OpenAPI (every
//! parameter and header has a schema, every reference resolves), so
//! validators and schema-driven testers (`openapi-spec-validator`,
//! schemathesis) take it as it is.
//!
//! # Examples
//!
//! ```
//! use tower_idempotency::openapi::IdempotencyDocs;
//! use utoipa::{
//!     Modify,
//!     openapi::{
//!         HttpMethod, OpenApiBuilder, PathItem, PathsBuilder, ResponseBuilder,
//!         path::OperationBuilder,
//!     },
//! };
//!
//! let charge = OperationBuilder::new()
//!     .response("201", ResponseBuilder::new().description("The charge"))
//!     .build();
//! let mut api = OpenApiBuilder::new()
//!     .paths(PathsBuilder::new().path("/v1/charges", PathItem::new(HttpMethod::Post, charge)))
//!     .build();
//! IdempotencyDocs::new().require_key(true).modify(&mut api);
//!
//! let json = serde_json::to_value(&api).unwrap();
//! let post = &json["paths"]["/v1/charges"]["post"];
//! assert_eq!(post["parameters"][0]["name"], "Idempotency-Key");
//! assert_eq!(post["parameters"][0]["required"], true);
//! assert!(post["responses"]["201"]["headers"]["Idempotent-Replayed"].is_object());
//! assert!(post["responses"]["409"]["headers"]["Retry-After"].is_object());
//! ```

use utoipa::{
    Modify,
    openapi::{
        Components, Content, HttpMethod, ObjectBuilder, OpenApi, PathItem, Ref, RefOr, Required,
        Response, Type,
        header::HeaderBuilder,
        path::{Operation, ParameterBuilder, ParameterIn},
    },
};

use crate::key::IdempotencyKey;

/// The component name of the RFC 9457 problem schema this adds.
pub const PROBLEM_SCHEMA: &str = "IdempotencyProblem";

/// Describes the layer's contract on the operations it guards.
///
/// # Examples
///
/// See the [module docs](self).
#[derive(Clone)]
pub struct IdempotencyDocs {
    methods: Vec<HttpMethod>,
    paths: Option<Vec<String>>,
    require_key: bool,
    retention_header: bool,
    /// The JSON Pointer of the key in the body, for a layer with
    /// `key_from_body`; `None`: the header.
    body_key: Option<String>,
}

impl std::fmt::Debug for IdempotencyDocs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyDocs")
            .field("paths", &self.paths)
            .field("require_key", &self.require_key)
            .field("retention_header", &self.retention_header)
            .field("body_key", &self.body_key)
            .finish_non_exhaustive()
    }
}

impl Default for IdempotencyDocs {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyDocs {
    /// `POST` and `PATCH` on every path, the key optional — the layer's
    /// defaults.
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub fn new() -> Self {
        Self {
            methods: vec![HttpMethod::Post, HttpMethod::Patch],
            paths: None,
            require_key: false,
            retention_header: false,
            body_key: None,
        }
    }

    /// The guarded methods, as given to
    /// [`IdempotencyLayer::methods`](crate::IdempotencyLayer::methods).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::openapi::IdempotencyDocs;
    /// use utoipa::openapi::HttpMethod;
    ///
    /// let docs = IdempotencyDocs::new().methods([HttpMethod::Post, HttpMethod::Put]);
    /// # let _ = docs;
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = HttpMethod>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Only these paths, as the document names them (`/v1/charges/{id}`).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::openapi::IdempotencyDocs;
    ///
    /// let docs = IdempotencyDocs::new().only(["/v1/charges", "/v1/refunds"]);
    /// # let _ = docs;
    /// ```
    pub fn only<S: Into<String>>(mut self, paths: impl IntoIterator<Item = S>) -> Self {
        self.paths = Some(paths.into_iter().map(Into::into).collect());
        self
    }

    /// Whether the key is required, as with
    /// [`IdempotencyLayer::require_key`](crate::IdempotencyLayer::require_key).
    ///
    /// # Examples
    ///
    /// See the [module docs](self).
    pub fn require_key(mut self, required: bool) -> Self {
        self.require_key = required;
        self
    }

    /// Whether answers carry `Idempotency-Replayable-For`, as with
    /// [`IdempotencyLayer::retention_header`](crate::IdempotencyLayer::retention_header).
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::openapi::IdempotencyDocs;
    ///
    /// let docs = IdempotencyDocs::new().retention_header(true);
    /// # let _ = docs;
    /// ```
    pub fn retention_header(mut self, told: bool) -> Self {
        self.retention_header = told;
        self
    }

    /// The key is read from the request body, at the JSON Pointer
    /// `pointer`, as with
    /// [`IdempotencyLayer::key_from_body`](crate::IdempotencyLayer::key_from_body)
    /// (a webhook's event id): the operation then has no key header, and
    /// says where the key is.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::openapi::IdempotencyDocs;
    /// use utoipa::openapi::path::Operation;
    ///
    /// let mut webhook = Operation::new();
    /// IdempotencyDocs::new().key_from_body("/id").describe(&mut webhook);
    /// assert!(webhook.parameters.is_none_or(|p| p.is_empty()));
    /// assert!(webhook.description.unwrap().contains("`/id`"));
    /// ```
    pub fn key_from_body(mut self, pointer: impl Into<String>) -> Self {
        self.body_key = Some(pointer.into());
        self
    }

    /// Describes one operation: its key, the headers of its successful
    /// answers, and the layer's refusals it does not describe already.
    /// [`modify`](Modify::modify) calls it on each guarded operation; call
    /// it yourself on an operation built apart, and add the problem schema
    /// the refusals refer to ([`PROBLEM_SCHEMA`]) with `modify`, or the
    /// document's references dangle.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::openapi::IdempotencyDocs;
    /// use utoipa::openapi::path::Operation;
    ///
    /// let mut operation = Operation::new();
    /// IdempotencyDocs::new().describe(&mut operation);
    /// assert!(operation.responses.responses.contains_key("422"));
    /// ```
    pub fn describe(&self, operation: &mut Operation) {
        match &self.body_key {
            None => {
                let parameters = operation.parameters.get_or_insert_with(Vec::new);
                let named = |p: &RefOr<_>| matches!(p, RefOr::T(p) if is_key_parameter(p));
                if !parameters.iter().any(named) {
                    parameters.push(RefOr::T(self.key_parameter()));
                }
            }
            Some(pointer) => {
                let said = format!(
                    "Idempotent: the request body's `{pointer}` (a string of 1 to 255 visible \
                     ASCII characters) is its idempotency key. The first request with a key \
                     executes; a retry with the same body gets the stored answer, marked \
                     `Idempotent-Replayed: true`; the same key with another body is refused \
                     with 422."
                );
                let description = operation.description.get_or_insert_with(String::new);
                if !description.contains(&said) {
                    if !description.is_empty() {
                        description.push_str("\n\n");
                    }
                    description.push_str(&said);
                }
            }
        }
        let responses = &mut operation.responses.responses;
        for (status, response) in responses.iter_mut() {
            if let (true, RefOr::T(response)) = (status.starts_with('2'), response) {
                self.success_headers(response);
            }
        }
        for (status, description, retry_after) in REFUSALS {
            responses
                .entry((*status).to_owned())
                .or_insert_with(|| RefOr::T(refusal(description, *retry_after)));
        }
    }

    fn key_parameter(&self) -> utoipa::openapi::path::Parameter {
        let required = if self.require_key {
            Required::True
        } else {
            Required::False
        };
        // Visible ASCII, not starting with `"` (that is the quoted form,
        // `"order-42"`, which names the same key).
        let schema = ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(IdempotencyKey::MAX_LEN))
            .pattern(Some("^[!#-~][!-~]*$"))
            .examples(["7c4a8d09-ca95-4c28-a8e5-1c8b9a2f9f6e"])
            .build();
        ParameterBuilder::new()
            .name("Idempotency-Key")
            .parameter_in(ParameterIn::Header)
            .required(required)
            .description(Some(
                "One key per operation, sent again with every retry of it (1 to 255 visible \
                 ASCII characters; a UUID v4 is a good choice). The first request with a key \
                 executes; a retry with the same parameters gets the stored answer, marked \
                 `Idempotent-Replayed: true`; the same key with other parameters is refused \
                 with 422.",
            ))
            .schema(Some(schema))
            .build()
    }

    fn success_headers(&self, response: &mut Response) {
        let replayed = HeaderBuilder::new()
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(["true"]))
                    .build(),
            ))
            .description(Some(
                "Present on an answer replayed from an earlier execution with the same key.",
            ))
            .build();
        response
            .headers
            .entry("Idempotent-Replayed".to_owned())
            .or_insert(RefOr::T(replayed));
        if self.retention_header {
            let left = HeaderBuilder::new()
                .schema(Some(
                    ObjectBuilder::new()
                        .schema_type(Type::Integer)
                        .minimum(Some(0))
                        .build(),
                ))
                .description(Some(
                    "Seconds this answer will still be replayed to a retry with its key; \
                     absent on an answer that will not be replayed.",
                ))
                .build();
            response
                .headers
                .entry("Idempotency-Replayable-For".to_owned())
                .or_insert(RefOr::T(left));
        }
    }

    fn guards(&self, path: &str) -> bool {
        self.paths
            .as_ref()
            .is_none_or(|paths| paths.iter().any(|p| p == path))
    }
}

impl Modify for IdempotencyDocs {
    fn modify(&self, openapi: &mut OpenApi) {
        openapi
            .components
            .get_or_insert_with(Components::new)
            .schemas
            .entry(PROBLEM_SCHEMA.to_owned())
            .or_insert_with(problem_schema);
        for (path, item) in openapi.paths.paths.iter_mut() {
            if !self.guards(path) {
                continue;
            }
            for method in &self.methods {
                if let Some(operation) = operation_mut(item, method) {
                    self.describe(operation);
                }
            }
        }
    }
}

fn is_key_parameter(p: &utoipa::openapi::path::Parameter) -> bool {
    p.parameter_in == ParameterIn::Header && p.name.eq_ignore_ascii_case("idempotency-key")
}

fn operation_mut<'a>(item: &'a mut PathItem, method: &HttpMethod) -> Option<&'a mut Operation> {
    match method {
        HttpMethod::Get => item.get.as_mut(),
        HttpMethod::Put => item.put.as_mut(),
        HttpMethod::Post => item.post.as_mut(),
        HttpMethod::Delete => item.delete.as_mut(),
        HttpMethod::Options => item.options.as_mut(),
        HttpMethod::Head => item.head.as_mut(),
        HttpMethod::Patch => item.patch.as_mut(),
        HttpMethod::Trace => item.trace.as_mut(),
    }
}

/// The layer's own answers: status, what it means, whether it says when
/// to come back.
const REFUSALS: &[(&str, &str, bool)] = &[
    (
        "400",
        "The idempotency key is missing (where required) or malformed, or the body could not \
         be read. Nothing ran.",
        false,
    ),
    (
        "406",
        "The stored answer is in a content coding this request does not accept. Nothing ran \
         again.",
        false,
    ),
    (
        "409",
        "A request with this key is still running. Retry with the same key after \
         `Retry-After`: it then gets the first request's answer.",
        true,
    ),
    (
        "413",
        "The request body is larger than the idempotency layer buffers (nothing ran), or \
         what the request writes is more than the store records in one transaction (nothing \
         committed). The same request is refused again.",
        false,
    ),
    (
        "422",
        "This key was used with other parameters. Nothing ran; use a new key for a new \
         operation.",
        false,
    ),
    (
        "500",
        "A server-side fault: the handler panicked, or the database refused the transaction \
         that carried its effects. Nothing committed; the key was released, so a retry with it \
         executes.",
        false,
    ),
    (
        "502",
        "The handler's answer failed while it was being read. The key was released.",
        false,
    ),
    (
        "503",
        "The idempotency store could not be reached. Nothing ran; retry with the same key \
         after `Retry-After`.",
        true,
    ),
];

fn refusal(description: &str, retry_after: bool) -> Response {
    let mut response = Response::new(description);
    response.content.insert(
        "application/problem+json".to_owned(),
        RefOr::T(Content::new(Some(Ref::from_schema_name(PROBLEM_SCHEMA)))),
    );
    if retry_after {
        let seconds = HeaderBuilder::new()
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(0))
                    .build(),
            ))
            .description(Some("Seconds to wait before retrying with the same key."))
            .build();
        response
            .headers
            .insert("Retry-After".to_owned(), RefOr::T(seconds));
    }
    response
}

/// RFC 9457's members, as the layer writes them.
fn problem_schema() -> RefOr<utoipa::openapi::Schema> {
    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description))
            .build()
    };
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("An RFC 9457 problem details object."))
        .property(
            "type",
            string("A URI naming the problem: `urn:tower-idempotency:problem:in-flight`, …"),
        )
        .property("title", string("A short summary of the problem type."))
        .property(
            "status",
            ObjectBuilder::new().schema_type(Type::Integer).build(),
        )
        .property("detail", string("What happened, and what to do."))
        .required("type")
        .required("title")
        .required("status")
        .into()
}

#[cfg(test)]
mod tests {
    use utoipa::openapi::{OpenApiBuilder, PathsBuilder, ResponseBuilder, path::OperationBuilder};

    use super::*;

    fn api() -> OpenApi {
        let post = OperationBuilder::new()
            .response("201", ResponseBuilder::new().description("Created"))
            .response(
                "422",
                ResponseBuilder::new().description("The app's own 422"),
            )
            .build();
        let get = OperationBuilder::new()
            .response("200", ResponseBuilder::new().description("Found"))
            .build();
        OpenApiBuilder::new()
            .paths(
                PathsBuilder::new()
                    .path("/charges", PathItem::new(HttpMethod::Post, post.clone()))
                    .path("/charges/{id}", PathItem::new(HttpMethod::Get, get))
                    .path("/refunds", PathItem::new(HttpMethod::Post, post)),
            )
            .build()
    }

    #[test]
    fn guarded_operations_get_the_contract_and_others_are_untouched() {
        let mut api = api();
        IdempotencyDocs::new()
            .only(["/charges", "/charges/{id}"])
            .retention_header(true)
            .modify(&mut api);
        // Twice is once.
        IdempotencyDocs::new().only(["/charges"]).modify(&mut api);
        let json = serde_json::to_value(&api).unwrap();
        let post = &json["paths"]["/charges"]["post"];
        assert_eq!(post["parameters"].as_array().unwrap().len(), 1);
        assert_eq!(post["parameters"][0]["in"], "header");
        assert_eq!(post["parameters"][0]["required"], false);
        assert_eq!(post["parameters"][0]["schema"]["maxLength"], 255);
        let created = &post["responses"]["201"]["headers"];
        assert!(created["Idempotent-Replayed"].is_object());
        assert!(created["Idempotency-Replayable-For"].is_object());
        for status in ["400", "409", "503"] {
            let refusal = &post["responses"][status];
            assert_eq!(
                refusal["content"]["application/problem+json"]["schema"]["$ref"],
                "#/components/schemas/IdempotencyProblem",
                "{status}"
            );
        }
        assert!(post["responses"]["409"]["headers"]["Retry-After"].is_object());
        assert_eq!(
            post["responses"]["422"]["description"], "The app's own 422",
            "what the application says is kept"
        );
        assert!(json["components"]["schemas"]["IdempotencyProblem"].is_object());
        // GET is not guarded; /refunds is not named.
        assert!(json["paths"]["/charges/{id}"]["get"]["parameters"].is_null());
        assert!(json["paths"]["/refunds"]["post"]["parameters"].is_null());
    }
}
