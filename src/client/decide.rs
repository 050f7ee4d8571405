//! Whether an attempt's answer ends the call or is retried, and how long to
//! wait first: the one place the client's retry rules live.

use std::time::Duration;

use http::{HeaderMap, StatusCode, header::RETRY_AFTER};

use crate::http::grpc::{self, GRPC_RETRY_PUSHBACK_MS, Wire};

/// Why an attempt is tried again (the `reason` label of the retry metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// No answer: the connection failed, before or after the request was
    /// sent — exactly when the client cannot know whether the server acted.
    Connection,
    /// No answer within the attempt's timeout.
    Timeout,
    /// `409` with `Retry-After`: the first request with this key still runs.
    InFlight,
    /// `429`.
    RateLimited,
    /// `502`, `503`, `504`: the server, or a proxy before it, could not
    /// answer now.
    Unavailable,
    /// A gRPC code that says nothing was done: `UNAVAILABLE`,
    /// `RESOURCE_EXHAUSTED`, `ABORTED`, `DEADLINE_EXCEEDED`.
    Grpc,
}

impl Reason {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Reason::Connection => "connection",
            Reason::Timeout => "timeout",
            Reason::InFlight => "in_flight",
            Reason::RateLimited => "rate_limited",
            Reason::Unavailable => "unavailable",
            Reason::Grpc => "grpc",
        }
    }
}

/// What to do with an answer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The call's answer: a 2xx, a client error, anything not listed.
    Final,
    /// Try again, waiting at least `floor` (the server's `Retry-After` or
    /// `grpc-retry-pushback-ms`) besides the back-off.
    Retry {
        reason: Reason,
        floor: Option<Duration>,
    },
}

/// Judges an answer by its status and headers (and, for gRPC, the trailers
/// that carry `grpc-status` after a body).
pub(crate) fn verdict(
    status: StatusCode,
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
) -> Verdict {
    if Wire::of(headers) == Wire::Grpc {
        return grpc_verdict(headers, trailers);
    }
    let retry_after = retry_after(headers);
    let reason = match status.as_u16() {
        // A 409 without `Retry-After` is the application's own conflict.
        409 if retry_after.is_some() => Reason::InFlight,
        429 => Reason::RateLimited,
        502..=504 => Reason::Unavailable,
        _ => return Verdict::Final,
    };
    Verdict::Retry {
        reason,
        floor: retry_after,
    }
}

/// The codes the server's own policy releases the key for
/// ([`GrpcCode::invites_retry`](crate::GrpcCode::invites_retry): nothing
/// was done) are retried, after the server's pushback when it gives one; a
/// negative or unreadable pushback means "do not retry" (gRFC A6).
fn grpc_verdict(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Verdict {
    let Some((code, fields)) = grpc::status(headers, trailers) else {
        return Verdict::Final;
    };
    if !code.invites_retry() {
        return Verdict::Final;
    }
    let floor = match fields.get(GRPC_RETRY_PUSHBACK_MS) {
        None => None,
        Some(value) => match value.to_str().ok().and_then(|v| v.parse::<u64>().ok()) {
            Some(ms) => Some(Duration::from_millis(ms)),
            None => return Verdict::Final,
        },
    };
    Verdict::Retry {
        reason: Reason::Grpc,
        floor,
    }
}

/// `Retry-After`, in either of its forms (RFC 9110): a number of seconds,
/// or an HTTP date — the time from now until then (none once it has
/// passed).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

/// The back-off before attempt `attempt + 1`: `first`, doubling, at most
/// `cap`, each within ±25 % (so that clients that failed together do not
/// retry together).
pub(crate) fn backoff(attempt: u32, first: Duration, cap: Duration) -> Duration {
    let doublings = attempt.saturating_sub(1).min(30);
    let base = first.saturating_mul(1 << doublings).min(cap);
    base.mul_f64(0.75 + fastrand::f64() * 0.5)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    fn retried(status: u16, pairs: &[(&'static str, &'static str)]) -> Verdict {
        verdict(StatusCode::from_u16(status).unwrap(), &headers(pairs), None)
    }

    #[test]
    fn what_is_retried_and_what_is_not() {
        for final_status in [200, 201, 400, 401, 404, 409, 422, 500, 501] {
            assert_eq!(retried(final_status, &[]), Verdict::Final, "{final_status}");
        }
        assert_eq!(
            retried(409, &[("retry-after", "1")]),
            Verdict::Retry {
                reason: Reason::InFlight,
                floor: Some(Duration::from_secs(1))
            }
        );
        assert_eq!(
            retried(429, &[]),
            Verdict::Retry {
                reason: Reason::RateLimited,
                floor: None
            }
        );
        assert_eq!(
            retried(503, &[("retry-after", "7")]),
            Verdict::Retry {
                reason: Reason::Unavailable,
                floor: Some(Duration::from_secs(7))
            }
        );
        assert_eq!(retried(422, &[("retry-after", "1")]), Verdict::Final);
    }

    #[test]
    fn retry_after_is_read_in_seconds_and_as_an_http_date() {
        let at = |offset: i64| {
            let now = std::time::SystemTime::now();
            let when = if offset >= 0 {
                now + Duration::from_secs(offset as u64)
            } else {
                now - Duration::from_secs(offset.unsigned_abs())
            };
            let mut headers = HeaderMap::new();
            let date = httpdate::fmt_http_date(when);
            headers.insert(RETRY_AFTER, HeaderValue::from_str(&date).unwrap());
            retry_after(&headers)
        };
        let ahead = at(30).expect("a date ahead");
        assert!(
            (Duration::from_secs(28)..=Duration::from_secs(30)).contains(&ahead),
            "{ahead:?}"
        );
        assert_eq!(at(-30), Some(Duration::ZERO), "a date past: at once");
        let seconds = headers(&[("retry-after", " 7 ")]);
        assert_eq!(retry_after(&seconds), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(&headers(&[("retry-after", "soon")])), None);
    }

    #[test]
    fn grpc_codes_that_invite_a_retry_are_retried_after_their_pushback() {
        let grpc = |status: &'static str, pushback: Option<&'static str>| {
            let mut pairs = vec![
                ("content-type", "application/grpc"),
                ("grpc-status", status),
            ];
            pairs.extend(pushback.map(|p| ("grpc-retry-pushback-ms", p)));
            retried(200, &pairs)
        };
        assert_eq!(
            grpc("14", Some("250")),
            Verdict::Retry {
                reason: Reason::Grpc,
                floor: Some(Duration::from_millis(250))
            }
        );
        assert_eq!(
            grpc("10", None),
            Verdict::Retry {
                reason: Reason::Grpc,
                floor: None
            }
        );
        assert_eq!(
            grpc("14", Some("-1")),
            Verdict::Final,
            "a negative pushback says do not retry"
        );
        // As the server's policy reads them: HTTP's 429 is gRPC's 8.
        for retried_code in ["4", "8"] {
            assert!(
                matches!(grpc(retried_code, None), Verdict::Retry { .. }),
                "{retried_code}"
            );
        }
        for final_code in ["0", "3", "9", "13"] {
            assert_eq!(grpc(final_code, None), Verdict::Final, "{final_code}");
        }
        // gRPC-Web carries its status in the body: read as HTTP.
        assert_eq!(
            retried(
                200,
                &[
                    ("content-type", "application/grpc-web"),
                    ("grpc-status", "14")
                ]
            ),
            Verdict::Final
        );
        // The status in the trailers, after a body.
        let trailers = headers(&[("grpc-status", "14")]);
        assert_eq!(
            verdict(
                StatusCode::OK,
                &headers(&[("content-type", "application/grpc+proto")]),
                Some(&trailers)
            ),
            Verdict::Retry {
                reason: Reason::Grpc,
                floor: None
            }
        );
    }

    #[test]
    fn the_backoff_doubles_from_about_half_a_second_to_its_cap() {
        let (first, cap) = (Duration::from_millis(500), Duration::from_secs(8));
        for attempt in 1..=10 {
            let base = first.saturating_mul(1 << (attempt - 1)).min(cap);
            let wait = backoff(attempt, first, cap);
            assert!(
                wait >= base.mul_f64(0.75) && wait <= base.mul_f64(1.25),
                "{attempt}: {wait:?}"
            );
        }
    }
}
