//! Property tests for the fingerprint (SPEC §2.3).

use http::{Method, Request, request::Parts};
use proptest::prelude::*;
use tower_idempotency::{
    DefaultFingerprint, Fingerprint, FingerprintHasher, FingerprintStrategy, RawBodyFingerprint,
};

fn parts(method: &Method, path: &str, query: &str, json: bool) -> Parts {
    let uri = if query.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{query}")
    };
    let mut b = Request::builder().method(method.clone()).uri(uri);
    if json {
        b = b.header("content-type", "application/json");
    }
    b.body(()).unwrap().into_parts().0
}

fn fp(method: &Method, path: &str, query: &str, body: &[u8]) -> Fingerprint {
    DefaultFingerprint.fingerprint(&parts(method, path, query, false), body)
}

fn method() -> impl Strategy<Value = Method> {
    prop_oneof![
        Just(Method::POST),
        Just(Method::PATCH),
        Just(Method::PUT),
        Just(Method::DELETE)
    ]
}

prop_compose! {
    fn path()(segments in prop::collection::vec("[a-z0-9_]{1,8}", 1..4)) -> String {
        format!("/{}", segments.join("/"))
    }
}

prop_compose! {
    fn query()(pairs in prop::collection::vec(("[a-z]{1,4}", "[a-z0-9]{0,4}"), 0..4)) -> String {
        pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("&")
    }
}

proptest! {
    #[test]
    fn deterministic(m in method(), p in path(), q in query(), body in prop::collection::vec(any::<u8>(), 0..256)) {
        prop_assert_eq!(fp(&m, &p, &q, &body), fp(&m, &p, &q, &body));
    }

    #[test]
    fn sensitive_to_every_field(
        m in method(), m2 in method(), p in path(), p2 in path(), q in query(), q2 in query(),
        body in prop::collection::vec(any::<u8>(), 0..64), body2 in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let base = fp(&m, &p, &q, &body);
        if m != m2 { prop_assert_ne!(base, fp(&m2, &p, &q, &body)); }
        if p != p2 { prop_assert_ne!(base, fp(&m, &p2, &q, &body)); }
        let sorted = |q: &str| {
            let mut v: Vec<String> = q.split('&').filter(|s| !s.is_empty()).map(str::to_owned).collect();
            v.sort();
            v
        };
        if sorted(&q) != sorted(&q2) { prop_assert_ne!(base, fp(&m, &p, &q2, &body)); }
        if body != body2 { prop_assert_ne!(base, fp(&m, &p, &q, &body2)); }
    }

    #[test]
    fn query_parameter_order_does_not_matter(m in method(), p in path(), q in query()) {
        let mut params: Vec<&str> = q.split('&').collect();
        params.reverse();
        prop_assert_eq!(fp(&m, &p, &q, b""), fp(&m, &p, &params.join("&"), b""));
    }

    /// Moving bytes between adjacent fields never keeps the hash.
    #[test]
    fn length_prefixing_defeats_concatenation(joined in "[a-z]{2,24}", cut in any::<prop::sample::Index>(), cut2 in any::<prop::sample::Index>()) {
        let (i, j) = (cut.index(joined.len() + 1), cut2.index(joined.len() + 1));
        prop_assume!(i != j);
        let hash = |at: usize| {
            let mut h = FingerprintHasher::new("test");
            h.field(&joined.as_bytes()[..at]);
            h.field(&joined.as_bytes()[at..]);
            h.finish()
        };
        prop_assert_ne!(hash(i), hash(j));
    }

    /// A path that ends where the query begins cannot pass for another split.
    #[test]
    fn path_and_query_do_not_blur(p in path(), extra in "[a-z]{1,4}") {
        let a = fp(&Method::POST, &format!("{p}{extra}"), "", b"");
        let b = fp(&Method::POST, &p, &extra, b"");
        prop_assert_ne!(a, b);
        // The body cannot pose as a query parameter either.
        prop_assert_ne!(fp(&Method::POST, &p, &extra, b""), fp(&Method::POST, &p, "", extra.as_bytes()));
    }

    /// JSON objects match whatever their key order and whitespace.
    #[test]
    fn canonical_json_ignores_key_order_and_whitespace(entries in prop::collection::btree_map("[a-z]{1,6}", any::<i32>(), 0..8)) {
        let compact = serde_json::to_string(&entries).unwrap();
        let reversed = format!(
            "{{ {} }}",
            entries.iter().rev().map(|(k, v)| format!("\"{k}\" :\n {v}")).collect::<Vec<_>>().join(" ,\t")
        );
        let json = parts(&Method::POST, "/x", "", true);
        prop_assert_eq!(
            DefaultFingerprint.fingerprint(&json, compact.as_bytes()),
            DefaultFingerprint.fingerprint(&json, reversed.as_bytes())
        );
        // Hashed raw, the two spellings differ (when they do differ as bytes).
        if compact != reversed {
            prop_assert_ne!(
                RawBodyFingerprint.fingerprint(&json, compact.as_bytes()),
                RawBodyFingerprint.fingerprint(&json, reversed.as_bytes())
            );
        }
    }
}
