//! Property tests for the fingerprint: what makes two requests the same,
//! and that any other difference makes them differ.

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
    DefaultFingerprint::new().fingerprint(&parts(method, path, query, false), body)
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
    fn sensitive_to_every_field(
        m in method(), m2 in method(), p in path(), p2 in path(), q in query(), q2 in query(),
        body in prop::collection::vec(any::<u8>(), 0..64), body2 in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let base = fp(&m, &p, &q, &body);
        if m != m2 { prop_assert_ne!(base, fp(&m2, &p, &q, &body)); }
        if p != p2 { prop_assert_ne!(base, fp(&m, &p2, &q, &body)); }
        // Parameters sorted by name only: values of one name keep their order.
        let sorted = |q: &str| {
            let mut v: Vec<String> = q.split('&').filter(|s| !s.is_empty()).map(str::to_owned).collect();
            v.sort_by(|a, b| a.split('=').next().cmp(&b.split('=').next()));
            v
        };
        if sorted(&q) != sorted(&q2) { prop_assert_ne!(base, fp(&m, &p, &q2, &body)); }
        if body != body2 { prop_assert_ne!(base, fp(&m, &p, &q, &body2)); }
    }

    /// The order of differently named parameters does not matter.
    #[test]
    fn query_parameter_order_does_not_matter(m in method(), p in path(), names in prop::collection::btree_set("[a-z]{1,4}", 0..5), v in "[a-z0-9]{0,4}") {
        let params: Vec<String> = names.iter().map(|n| format!("{n}={v}")).collect();
        let reversed: Vec<String> = params.iter().rev().cloned().collect();
        prop_assert_eq!(fp(&m, &p, &params.join("&"), b""), fp(&m, &p, &reversed.join("&"), b""));
    }

    /// Values of a repeated name keep their order: `x=1&x=2` is not `x=2&x=1`
    /// (last-wins and list semantics both tell them apart).
    #[test]
    fn repeated_parameters_keep_their_order(name in "[a-z]{1,4}", a in "[a-z0-9]{0,4}", b in "[a-z0-9]{0,4}", other in "[A-Z]{1,3}") {
        prop_assume!(a != b);
        let q = |first: &str, second: &str| format!("{name}={first}&{other}=1&{name}={second}");
        prop_assert_ne!(fp(&Method::POST, "/x", &q(&a, &b), b""), fp(&Method::POST, "/x", &q(&b, &a), b""));
        // Interleaving other names around them is free.
        let moved = format!("{other}=1&{name}={a}&{name}={b}");
        prop_assert_eq!(fp(&Method::POST, "/x", &q(&a, &b), b""), fp(&Method::POST, "/x", &moved, b""));
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
            DefaultFingerprint::new().fingerprint(&json, compact.as_bytes()),
            DefaultFingerprint::new().fingerprint(&json, reversed.as_bytes())
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

fn json_fp(body: &str) -> Fingerprint {
    DefaultFingerprint::new().fingerprint(
        &parts(&Method::POST, "/v1/charges", "", true),
        body.as_bytes(),
    )
}

#[test]
fn repeated_query_parameters_are_not_sorted_by_value() {
    assert_ne!(
        fp(&Method::POST, "/x", "x=1&x=2", b""),
        fp(&Method::POST, "/x", "x=2&x=1", b"")
    );
    assert_eq!(
        fp(&Method::POST, "/x", "b=1&a=2", b""),
        fp(&Method::POST, "/x", "a=2&b=1", b"")
    );
}

/// Different numbers are different requests, however close they are as
/// `f64`s: a handler may read them exactly (wei amounts exceed `u64`).
#[test]
fn numbers_are_compared_exactly() {
    for (a, b) in [
        ("1e20", "100000000000000000001"),
        ("0.1", "0.10000000000000001"),
        ("18446744073709551616", "18446744073709551617"),
        ("9007199254740993", "9007199254740992"),
        ("1e400", "1e401"),
        ("-1e-400", "1e-400"),
        (
            "123456789012345678901234567890",
            "123456789012345678901234567891",
        ),
    ] {
        let doc = |n: &str| format!(r#"{{"amount":{n},"currency":"eth"}}"#);
        assert_ne!(
            json_fp(&doc(a)),
            json_fp(&doc(b)),
            "{a} and {b} are different amounts"
        );
    }
}

/// One number, many spellings: the same request.
#[test]
fn spellings_of_one_number_are_the_same_request() {
    for group in [
        &["1", "1.0", "1e0", "10e-1", "0.1e1", "1.000E+0", "100e-2"][..],
        &["0", "-0", "0.0", "0e10", "-0.000E-3"],
        &["1e20", "100000000000000000000", "100000000000000000000.000"],
        &["-12.5", "-1.25e1", "-125E-1", "-0.125e2"],
        &["18446744073709551616", "1.8446744073709551616e19"],
    ] {
        let doc = |n: &str| format!(r#"{{"amount":{n}}}"#);
        for spelling in group {
            assert_eq!(
                json_fp(&doc(group[0])),
                json_fp(&doc(spelling)),
                "{} and {spelling}",
                group[0]
            );
        }
    }
}

#[test]
fn invalid_numbers_are_not_json() {
    // Hashed raw: a different spelling of invalid JSON is a different request.
    for bad in [
        "01", "1.", ".5", "+1", "1e", "-", "0x10", "1e+", "NaN", "Infinity",
    ] {
        let doc = format!(r#"{{"amount":{bad}}}"#);
        let raw = RawBodyFingerprint.fingerprint(
            &parts(&Method::POST, "/v1/charges", "", true),
            doc.as_bytes(),
        );
        assert_eq!(json_fp(&doc), raw, "{bad} is not a JSON number");
    }
}

// Declared rules: JSON Pointers to ignore or keep, headers to include.

/// A JSON body `{"amount":…,"currency":…,"metadata":{"client_time":…,"note":…}}`.
fn charge_body(amount: i64, currency: &str, client_time: &str, note: &str) -> String {
    serde_json::json!({
        "amount": amount,
        "currency": currency,
        "metadata": { "client_time": client_time, "note": note },
    })
    .to_string()
}

fn with_headers(headers: &[(&str, &str)]) -> Parts {
    let mut b = Request::post("/v1/charges").header("content-type", "application/json");
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(()).unwrap().into_parts().0
}

proptest! {
    /// Two requests that differ only in an ignored field are the same
    /// request; any other difference still tells them apart.
    #[test]
    fn an_ignored_field_may_differ(
        amount in any::<i64>(), other in any::<i64>(), t1 in "[0-9:]{0,8}", t2 in "[0-9:]{0,8}", note in "[a-z]{0,4}",
    ) {
        let rules = DefaultFingerprint::new().ignore("/metadata/client_time");
        let parts = with_headers(&[]);
        let fp = |amount, t: &str| rules.fingerprint(&parts, charge_body(amount, "eur", t, &note).as_bytes());
        prop_assert_eq!(fp(amount, &t1), fp(amount, &t2));
        if amount != other {
            prop_assert_ne!(fp(amount, &t1), fp(other, &t1));
        }
    }

    /// With fields kept, anything else may differ; a difference in a kept
    /// field never may.
    #[test]
    fn a_kept_field_may_not_differ(
        amount in any::<i64>(), other in any::<i64>(), c1 in "[a-z]{3}", c2 in "[a-z]{3}", t1 in "[0-9]{0,4}", t2 in "[0-9]{0,4}",
    ) {
        let rules = DefaultFingerprint::new().keep("/amount").keep("/currency");
        let parts = with_headers(&[]);
        let fp = |amount, c: &str, t: &str| rules.fingerprint(&parts, charge_body(amount, c, t, t).as_bytes());
        prop_assert_eq!(fp(amount, &c1, &t1), fp(amount, &c1, &t2));
        if amount != other {
            prop_assert_ne!(fp(amount, &c1, &t1), fp(other, &c1, &t1));
        }
        if c1 != c2 {
            prop_assert_ne!(fp(amount, &c1, &t1), fp(amount, &c2, &t1));
        }
    }

    /// An included header is compared exactly; absent is not empty.
    #[test]
    fn an_included_header_may_not_differ(v1 in "[a-z0-9-]{0,8}", v2 in "[a-z0-9-]{0,8}") {
        let rules = DefaultFingerprint::new().header("api-version");
        let body = charge_body(1, "eur", "t", "n");
        let fp = |headers: &[(&str, &str)]| rules.fingerprint(&with_headers(headers), body.as_bytes());
        prop_assert_ne!(fp(&[("api-version", &v1)]), fp(&[]));
        if v1 != v2 {
            prop_assert_ne!(fp(&[("api-version", &v1)]), fp(&[("api-version", &v2)]));
        }
        // A header the rules do not name is ignored.
        prop_assert_eq!(fp(&[("api-version", &v1)]), fp(&[("api-version", &v1), ("x-trace", &v2)]));
    }
}

#[test]
fn without_rules_the_fingerprint_is_the_earlier_versions() {
    // The digest of this request before rules existed: stored records must
    // keep matching after an upgrade.
    let body = br#"{"amount":1999,"currency":"eur"}"#;
    let fp = DefaultFingerprint::new().fingerprint(&with_headers(&[("api-version", "1")]), body);
    let mut h = FingerprintHasher::new("tower-idempotency/v1");
    h.field(b"POST");
    h.field(b"/v1/charges");
    h.field(&0u64.to_be_bytes());
    h.field(b"json");
    h.field(br#"{"amount":1999,"currency":"eur"}"#);
    assert_eq!(fp, h.finish());
}

#[test]
#[should_panic(expected = "DefaultFingerprint::ignore")]
fn an_invalid_pointer_is_refused_when_configured() {
    let _ = DefaultFingerprint::new().ignore("metadata/client_time");
}

#[test]
#[should_panic(expected = "DefaultFingerprint::header")]
fn an_invalid_header_name_is_refused_when_configured() {
    let _ = DefaultFingerprint::new().header("api version");
}
