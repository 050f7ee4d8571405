//! What DynamoDB's errors mean to the store: one place that tells a
//! mistake (a missing table, credentials refused, a missing permission) from
//! an outage (unreachable, throttled, a server error), each naming its fix.

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};

use crate::store::StoreError;

/// What an error says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Class {
    /// The table does not exist (or not in this region or account).
    MissingTable,
    /// The credentials were refused, or are missing.
    Credentials,
    /// The caller may not do this to the table.
    Permission,
    /// Throttled: over the table's capacity or the account's limits.
    Throttled,
    /// The condition of a conditional write failed.
    ConditionFailed,
    /// DynamoDB refused the request as malformed or too large.
    Invalid,
    /// Unreachable, timed out, or a server error: may pass.
    Outage,
}

pub(super) fn class<E: ProvideErrorMetadata, R>(error: &SdkError<E, R>) -> Class {
    let code = match error {
        SdkError::ServiceError(service) => service.err().code(),
        SdkError::ConstructionFailure(_) => return Class::Invalid,
        _ => return Class::Outage,
    };
    match code.unwrap_or_default() {
        "ResourceNotFoundException" => Class::MissingTable,
        "UnrecognizedClientException"
        | "InvalidSignatureException"
        | "MissingAuthenticationToken"
        | "MissingAuthenticationTokenException"
        | "ExpiredTokenException"
        | "IncompleteSignatureException" => Class::Credentials,
        "AccessDeniedException" => Class::Permission,
        "ProvisionedThroughputExceededException"
        | "ThrottlingException"
        | "RequestLimitExceeded"
        | "LimitExceededException" => Class::Throttled,
        "ConditionalCheckFailedException" => Class::ConditionFailed,
        "ValidationException" | "SerializationException" => Class::Invalid,
        _ => Class::Outage,
    }
}

/// Whether DynamoDB's refusal `message` says the request is too large (an
/// item over 400 KB: "Item size has exceeded the maximum allowed size"),
/// which the same request always is.
pub(super) fn too_large(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    message.contains("size") && (message.contains("exceed") || message.contains("maximum"))
}

/// `error` as the store reports it, `table` named.
pub(super) fn store_error<E, R>(table: &str, error: SdkError<E, R>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let why = describe(&error);
    match class(&error) {
        Class::MissingTable => StoreError::Misconfigured(format!(
            "the DynamoDB table {table} does not exist (in this account and region): create it at \
             start-up with `.create_table_if_missing()`, or with your infrastructure (partition \
             key `pk`, a string; TTL on attribute `ttl`)"
        )),
        Class::Credentials => StoreError::Misconfigured(format!(
            "DynamoDB refused the credentials ({why}): check the AWS environment \
             (AWS_ACCESS_KEY_ID, AWS_PROFILE, the role) the client was built from"
        )),
        Class::Permission => StoreError::Misconfigured(format!(
            "these credentials may not use the DynamoDB table {table} ({why}): grant \
             dynamodb:GetItem, PutItem, UpdateItem, DeleteItem, DescribeTable (and \
             TransactWriteItems for the transactional store) on it"
        )),
        Class::Invalid => StoreError::Misconfigured(format!("DynamoDB refused the request: {why}")),
        Class::Throttled => StoreError::Unavailable(
            format!(
                "DynamoDB throttled the request on table {table} ({why}): raise the table's \
                 capacity or use on-demand billing"
            )
            .into(),
        ),
        Class::ConditionFailed | Class::Outage => StoreError::Unavailable(Box::new(error)),
    }
}

/// The error's code and message, or what the SDK says of it.
pub(super) fn describe<E: ProvideErrorMetadata, R>(error: &SdkError<E, R>) -> String {
    match error {
        SdkError::ServiceError(service) => {
            let err = service.err();
            match (err.code(), err.message()) {
                (Some(code), Some(message)) => format!("{code}: {message}"),
                (Some(code), None) => code.to_owned(),
                _ => "a service error".to_owned(),
            }
        }
        SdkError::DispatchFailure(_) => "the endpoint could not be reached".to_owned(),
        SdkError::TimeoutError(_) => "the request timed out".to_owned(),
        SdkError::ResponseError(_) => "the response could not be read".to_owned(),
        SdkError::ConstructionFailure(_) => "the request could not be built".to_owned(),
        _ => "an unknown failure".to_owned(),
    }
}
