//! What the caller learns of a call: its key, how many attempts it took,
//! whether the answer was a replay — on the response, or on the error.

/// The call behind a response, in the final response's extensions (and in
/// a [`ClientError`]): the idempotency key every attempt carried — log it,
/// store it with the order — the number of HTTP requests sent, and whether
/// the server answered with a replay (`Idempotent-Replayed: true`).
///
/// # Examples
///
/// ```
/// # fn demo(response: http::Response<tower_idempotency::client::BufferedBody>) {
/// use tower_idempotency::client::IdempotentCall;
///
/// let call = response.extensions().get::<IdempotentCall>().unwrap();
/// let key = call.key.as_deref().unwrap_or("-");
/// println!("key {key} after {} attempt(s), replayed: {}", call.attempts, call.replayed);
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotentCall {
    /// The `Idempotency-Key` sent on every attempt: the caller's own, or
    /// the one generated for the call. `None` for a method the client does
    /// not guard (sent once, as is).
    pub key: Option<String>,
    /// HTTP requests sent.
    pub attempts: u32,
    /// Whether the final answer was the server's replay of an earlier one.
    pub replayed: bool,
}

impl IdempotentCall {
    /// The key as a message says it: `key "order-42"`, or `no key`.
    fn key_said(&self) -> String {
        match &self.key {
            Some(key) => format!("key {key:?}"),
            None => "no key".to_owned(),
        }
    }
}

/// Why a call ended without an answer to return.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The request body is over the limit the client buffers so that it can
    /// send it again (`IdempotentClientLayer::max_body`); nothing was sent.
    #[error(
        "the request body is over the {limit}-byte limit the client buffers to resend it; raise IdempotentClientLayer::max_body"
    )]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// Reading the request body failed; nothing was sent.
    #[error("reading the request body failed: {0}")]
    Body(#[source] super::BoxError),
    /// An answer's body is over the limit the client reads
    /// (`IdempotentClientLayer::max_response_body`).
    #[error("the response body is over the {limit}-byte limit ({}, attempt {})", call.key_said(), call.attempts)]
    ResponseTooLarge {
        /// The limit.
        limit: usize,
        /// The call so far.
        call: IdempotentCall,
    },
    /// No attempt got an answer (connection failures, timeouts) before the
    /// attempts or the deadline ran out. The server may have acted: retry
    /// later **with the same key** (`call.key`), never a new one.
    #[error("no answer after {} attempt(s) ({}): {source}", call.attempts, call.key_said())]
    NoAnswer {
        /// The call: its key and attempts.
        call: IdempotentCall,
        /// The last attempt's failure.
        #[source]
        source: super::BoxError,
    },
}

impl ClientError {
    /// The call, when an attempt was made.
    ///
    /// # Examples
    ///
    /// ```
    /// use tower_idempotency::client::ClientError;
    ///
    /// let error = ClientError::BodyTooLarge { limit: 1024 };
    /// assert!(error.call().is_none());
    /// ```
    pub fn call(&self) -> Option<&IdempotentCall> {
        match self {
            ClientError::ResponseTooLarge { call, .. } | ClientError::NoAnswer { call, .. } => {
                Some(call)
            }
            ClientError::BodyTooLarge { .. } | ClientError::Body(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_names_its_key_as_it_was_sent() {
        let call = |key: Option<&str>| IdempotentCall {
            key: key.map(str::to_owned),
            attempts: 3,
            replayed: false,
        };
        let no_answer = |key| ClientError::NoAnswer {
            call: call(key),
            source: "connection refused".into(),
        };
        assert_eq!(
            no_answer(Some("order-42")).to_string(),
            r#"no answer after 3 attempt(s) (key "order-42"): connection refused"#
        );
        assert_eq!(
            no_answer(None).to_string(),
            "no answer after 3 attempt(s) (no key): connection refused"
        );
    }
}
