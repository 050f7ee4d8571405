//! Canonical JSON: one spelling per JSON value, so that a retry that
//! serialises the same parameters differently hashes the same, and two
//! documents that mean different things never do.
//!
//! Two documents are the same when they are equal after:
//! - insignificant whitespace is dropped;
//! - object members are sorted by key (bytewise, on the key's canonical
//!   spelling; members with a repeated key keep their order);
//! - strings are unescaped and escaped again one way (`"\u0061"` is `"a"`,
//!   `"\/"` is `"/"`);
//! - numbers are compared by their exact decimal value: `1`, `1.0`, `1e0` and
//!   `10e-1` are one number, `-0` is `0`, but `0.1` and `0.10000000000000001`
//!   differ, and so do integers of any size that differ in any digit. Numbers
//!   never pass through `f64`. Each is written in the shape of ECMAScript's
//!   `Number.prototype.toString` (as in RFC 8785, JCS), but with every digit of
//!   the literal kept.
//!
//! A hand-written scanner rather than serde_json: serde_json reads numbers as
//! `f64` unless its `arbitrary_precision` feature is on, and a library must not
//! turn that on (features unify, so it would change how every
//! `serde_json::Value` in the application holds numbers). Escaped strings are
//! still decoded by serde_json.

/// Nesting deeper than this is not treated as JSON (the body is then hashed
/// raw), so a hostile `[[[[…` cannot exhaust the stack. serde_json's limit.
const MAX_DEPTH: usize = 128;

/// The canonical form of a JSON document, or `None` when the body is not JSON
/// (it is then hashed raw, and the handler will reject it).
///
/// It is written while scanning, without building a tree: each object's
/// members go straight to the output, and are reordered only if they did not
/// arrive sorted.
pub(crate) fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    // JSON is UTF-8: checked once here, so strings without escapes are
    // copied as they stand.
    std::str::from_utf8(body).ok()?;
    let mut c = Canonicaliser {
        input: body,
        pos: 0,
        out: Vec::with_capacity(body.len()),
        members: Vec::new(),
        reorder: Vec::new(),
        digits: Vec::new(),
    };
    c.value(0)?;
    c.skip_whitespace();
    (c.pos == body.len()).then_some(c.out)
}

/// Where one object member was written: `out[start..end]` is `"key":value`,
/// and `out[start..key_end]` its canonical key, whose first 8 bytes, as a
/// big-endian number, are `prefix` (so most comparisons are one integer
/// comparison).
struct Member {
    prefix: u64,
    start: usize,
    key_end: usize,
    end: usize,
}

impl Member {
    fn key<'a>(&self, written: &'a [u8]) -> (u64, &'a [u8]) {
        (self.prefix, &written[self.start..self.key_end])
    }
}

fn key_prefix(key: &[u8]) -> u64 {
    let mut bytes = [0; 8];
    let n = key.len().min(8);
    bytes[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(bytes)
}

struct Canonicaliser<'a> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
    /// Member positions of every open object, innermost last.
    members: Vec<Member>,
    /// Room to reorder an object's members.
    reorder: Vec<u8>,
    /// The significant digits of the number being written.
    digits: Vec<u8>,
}

impl<'a> Canonicaliser<'a> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// Consumes `byte` after optional whitespace.
    fn expect(&mut self, byte: u8) -> Option<()> {
        self.skip_whitespace();
        (self.peek()? == byte).then(|| self.pos += 1)
    }

    fn value(&mut self, depth: usize) -> Option<()> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' if depth < MAX_DEPTH => self.object(depth + 1),
            b'[' if depth < MAX_DEPTH => self.array(depth + 1),
            b'"' => self.string(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.pos + word.len();
        (self.input.get(self.pos..end)? == word).then_some(())?;
        self.pos = end;
        self.out.extend_from_slice(word);
        Some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        self.pos += 1;
        self.out.push(b'[');
        self.skip_whitespace();
        if self.peek()? == b']' {
            self.pos += 1;
        } else {
            loop {
                self.value(depth)?;
                self.skip_whitespace();
                match self.peek()? {
                    b',' => self.out.push(b','),
                    b']' => break,
                    _ => return None,
                }
                self.pos += 1;
            }
            self.pos += 1;
        }
        self.out.push(b']');
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        self.pos += 1;
        self.out.push(b'{');
        let content_start = self.out.len();
        let first = self.members.len();
        let mut sorted = true;
        self.skip_whitespace();
        if self.peek()? == b'}' {
            self.pos += 1;
        } else {
            loop {
                self.skip_whitespace();
                if self.peek()? != b'"' {
                    return None;
                }
                let start = self.out.len();
                self.string()?;
                let key_end = self.out.len();
                let prefix = key_prefix(&self.out[start..key_end]);
                if let Some(previous) = self.members[first..].last() {
                    sorted &= previous.key(&self.out) <= (prefix, &self.out[start..key_end]);
                }
                self.expect(b':')?;
                self.out.push(b':');
                self.value(depth)?;
                self.members.push(Member {
                    prefix,
                    start,
                    key_end,
                    end: self.out.len(),
                });
                self.skip_whitespace();
                match self.peek()? {
                    b',' => self.out.push(b','),
                    b'}' => break,
                    _ => return None,
                }
                self.pos += 1;
            }
            self.pos += 1;
        }
        if !sorted {
            self.sort_members(content_start, first);
        }
        self.members.truncate(first);
        self.out.push(b'}');
        Some(())
    }

    /// Rewrites the members written since `content_start` sorted by key
    /// (stable: repeated keys keep their order, so even such documents have
    /// one form).
    fn sort_members(&mut self, content_start: usize, first: usize) {
        self.reorder.clear();
        self.reorder.extend_from_slice(&self.out[content_start..]);
        let written = &self.reorder[..];
        let at = |from: usize, to: usize| &written[from - content_start..to - content_start];
        let members = &mut self.members[first..];
        members.sort_by(|a, b| {
            (a.prefix.cmp(&b.prefix))
                .then_with(|| at(a.start, a.key_end).cmp(at(b.start, b.key_end)))
        });
        self.out.truncate(content_start);
        for (i, m) in members.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.out.extend_from_slice(at(m.start, m.end));
        }
    }

    /// A string without escapes is already in canonical form (the body is
    /// valid UTF-8, and control characters are refused here); one with
    /// escapes is decoded by serde_json and written again the one way
    /// serde_json escapes.
    fn string(&mut self) -> Option<()> {
        let start = self.pos;
        let mut i = start + 1;
        let mut escaped = false;
        loop {
            match *self.input.get(i)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    i += 2;
                }
                0..=0x1f => return None,
                _ => i += 1,
            }
        }
        let quoted = &self.input[start..=i];
        self.pos = i + 1;
        if escaped {
            let text: String = serde_json::from_slice(quoted).ok()?;
            serde_json::to_writer(&mut self.out, &text).expect("writing to a Vec cannot fail");
        } else {
            self.out.extend_from_slice(quoted);
        }
        Some(())
    }

    /// `-? (0 | [1-9][0-9]*) (.[0-9]+)? ([eE][+-]?[0-9]+)?`, written by its
    /// exact value.
    fn number(&mut self) -> Option<()> {
        let negative = self.eat(b'-');
        let integer = self.run_of_digits();
        if integer.is_empty() || integer.len() > 1 && integer[0] == b'0' {
            return None;
        }
        let fraction = if self.eat(b'.') {
            Some(self.run_of_digits()).filter(|f| !f.is_empty())?
        } else {
            &[]
        };
        let mut exponent: i128 = 0;
        if self.eat(b'e') || self.eat(b'E') {
            let negative = self.eat(b'-');
            if !negative {
                self.eat(b'+');
            }
            let digits = self.run_of_digits();
            let significant = &digits[digits.iter().take_while(|&&d| d == b'0').count()..];
            // An exponent this long is beyond any real amount: such a number is
            // hashed raw (by its spelling) rather than computed with.
            if digits.is_empty() || significant.len() > 30 {
                return None;
            }
            exponent = significant
                .iter()
                .fold(0, |e, d| e * 10 + i128::from(d - b'0'));
            if negative {
                exponent = -exponent;
            }
        }
        // The value is 0.d₁d₂…dₖ × 10ⁿ, with d₁ and dₖ not zero.
        let zeros = |d: &&u8| **d == b'0';
        let leading = integer.iter().chain(fraction).take_while(zeros).count();
        let fraction =
            &fraction[..fraction.len() - fraction.iter().rev().take_while(zeros).count()];
        let n = integer.len() as i128 - leading as i128 + exponent;
        // The significant digits are one slice of the input unless they
        // straddle the point (12.5); only then are they joined in a buffer.
        if fraction.is_empty() {
            let integer = &integer[leading.min(integer.len())..];
            let integer =
                &integer[..integer.len() - integer.iter().rev().take_while(zeros).count()];
            self.write_significant(negative, integer, n);
        } else if leading >= integer.len() {
            self.write_significant(negative, &fraction[leading - integer.len()..], n);
        } else {
            let mut digits = std::mem::take(&mut self.digits);
            digits.clear();
            digits.extend_from_slice(&integer[leading..]);
            digits.extend_from_slice(fraction);
            self.write_significant(negative, &digits, n);
            self.digits = digits;
        }
        Some(())
    }

    fn write_significant(&mut self, negative: bool, digits: &[u8], n: i128) {
        if digits.is_empty() {
            // Every zero is one number, -0 included.
            self.out.push(b'0');
        } else {
            self.write_number(negative, digits, n);
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        self.pos += usize::from(found);
        found
    }

    fn run_of_digits(&mut self) -> &'a [u8] {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        &self.input[start..self.pos]
    }

    /// Writes `0.digits × 10ⁿ` the way ECMAScript writes a number, every digit
    /// kept: plain up to 21 integer digits and down to 6 leading fraction
    /// zeros, scientific beyond.
    fn write_number(&mut self, negative: bool, digits: &[u8], n: i128) {
        let out = &mut self.out;
        if negative {
            out.push(b'-');
        }
        let k = digits.len() as i128;
        if k <= n && n <= 21 {
            out.extend_from_slice(digits);
            out.resize(out.len() + (n - k) as usize, b'0');
        } else if 0 < n && n <= 21 {
            let (int, frac) = digits.split_at(n as usize);
            out.extend_from_slice(int);
            out.push(b'.');
            out.extend_from_slice(frac);
        } else if -6 < n && n <= 0 {
            out.extend_from_slice(b"0.");
            out.resize(out.len() + (-n) as usize, b'0');
            out.extend_from_slice(digits);
        } else {
            out.push(digits[0]);
            if k > 1 {
                out.push(b'.');
                out.extend_from_slice(&digits[1..]);
            }
            let e = n - 1;
            out.extend_from_slice(if e >= 0 { b"e+" } else { b"e-" });
            out.extend_from_slice(e.unsigned_abs().to_string().as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::canonical_json;

    fn c(s: &str) -> String {
        let canonical = canonical_json(s.as_bytes()).unwrap_or_else(|| panic!("not JSON: {s}"));
        String::from_utf8(canonical).unwrap()
    }

    #[test]
    fn canonical_form() {
        assert_eq!(
            c(r#" { "b" : [1, {"y":null,"x":true}], "a":"\u00e9" } "#),
            r#"{"a":"é","b":[1,{"x":true,"y":null}]}"#
        );
        // Nested objects are sorted at every level, arrays keep their order.
        assert_eq!(
            c(r#"{"z":{"b":1,"a":[{"d":0,"c":0}]},"y":[3,1,2]}"#),
            r#"{"y":[3,1,2],"z":{"a":[{"c":0,"d":0}],"b":1}}"#
        );
        // Escapes are normalised: "\u0061" is "a", "\/" is "/".
        assert_eq!(
            c(r#"{"\u0062":"\/x","a":"\u00e9\n"}"#),
            "{\"a\":\"é\\n\",\"b\":\"/x\"}"
        );
        // Repeated keys keep their order (stable), so the form is deterministic.
        assert_eq!(c(r#"{"b":1,"a":2,"a":1}"#), r#"{"a":2,"a":1,"b":1}"#);
        assert_eq!(c(" [ ] "), "[]");
        assert_eq!(c("{ }"), "{}");
        assert_eq!(c("\"\""), "\"\"");
    }

    #[test]
    fn numbers_keep_every_digit() {
        for (input, canonical) in [
            ("0", "0"),
            ("-0", "0"),
            ("-0.0e-7", "0"),
            ("1", "1"),
            ("1.0", "1"),
            ("1e2", "100"),
            ("10", "10"),
            ("-5", "-5"),
            ("0.5", "0.5"),
            ("12.50", "12.5"),
            ("0.000001", "0.000001"),
            ("0.0000001", "1e-7"),
            ("1e20", "100000000000000000000"),
            ("1e21", "1e+21"),
            ("100000000000000000001", "100000000000000000001"),
            ("1000000000000000000001", "1.000000000000000000001e+21"),
            ("0.1", "0.1"),
            ("0.10000000000000001", "0.10000000000000001"),
            ("18446744073709551616", "18446744073709551616"),
            ("-123.456e-10", "-1.23456e-8"),
            ("5E+3", "5000"),
            ("1e0000000000000000000000000000000000000001", "10"),
            ("1e400", "1e+400"),
        ] {
            assert_eq!(c(input), canonical, "{input}");
        }
    }

    #[test]
    fn not_json() {
        for bad in [
            "",
            " ",
            "{not json",
            "{} x",
            r#"{"a":}"#,
            "[1,]",
            r#"{"a":1,}"#,
            "[1 2]",
            "01",
            "1.",
            ".5",
            "+1",
            "1e",
            "1e+",
            "-",
            "--1",
            "0x10",
            "NaN",
            "tru",
            "nul",
            "\"\u{1}\"",
            "\"abc",
            r#""\x""#,
            "{1:2}",
            "\u{feff}{}",
            "1e1000000000000000000000000000000000",
        ] {
            assert!(canonical_json(bad.as_bytes()).is_none(), "{bad:?}");
        }
        // Not UTF-8.
        assert!(canonical_json(b"\"\xff\"").is_none());
    }

    #[test]
    fn nesting_is_bounded_not_a_stack_overflow() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(canonical_json(deep(128).as_bytes()).is_some());
        assert!(canonical_json(deep(129).as_bytes()).is_none());
        assert!(canonical_json("[".repeat(1 << 20).as_bytes()).is_none());
        assert!(canonical_json(r#"{"a":"#.repeat(100_000).as_bytes()).is_none());
    }

    /// A JSON value as the tests model it: numbers are exact decimals
    /// `digits × 10^exponent` (no leading or trailing zeros in `digits`).
    #[derive(Clone, Debug, PartialEq)]
    enum Value {
        Null,
        Bool(bool),
        Number {
            negative: bool,
            digits: String,
            exponent: i32,
        },
        String(String),
        Array(Vec<Value>),
        /// Unique keys.
        Object(Vec<(String, Value)>),
    }

    impl Value {
        /// The value itself, whatever its spelling: members in key order,
        /// and one zero.
        fn normal(&self) -> Value {
            match self {
                Value::Number { digits, .. } if digits == "0" => Value::Number {
                    negative: false,
                    digits: "0".into(),
                    exponent: 0,
                },
                Value::Array(items) => Value::Array(items.iter().map(Value::normal).collect()),
                Value::Object(members) => {
                    let mut members: Vec<_> = members
                        .iter()
                        .map(|(k, v)| (k.clone(), v.normal()))
                        .collect();
                    members.sort_by(|a, b| a.0.cmp(&b.0));
                    Value::Object(members)
                }
                other => other.clone(),
            }
        }

        /// One of the many ways to write this value as JSON text.
        fn spell(&self, rng: &mut Rng, out: &mut String) {
            out.push_str(rng.pick(&["", " ", "\n  ", "\t"]));
            match self {
                Value::Null => out.push_str("null"),
                Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
                Value::Number {
                    negative,
                    digits,
                    exponent,
                } => spell_number(*negative, digits, *exponent, rng, out),
                Value::String(s) => spell_string(s, rng, out),
                Value::Array(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        item.spell(rng, out);
                    }
                    out.push_str(rng.pick(&["]", " ]"]));
                }
                Value::Object(members) => {
                    let mut order: Vec<usize> = (0..members.len()).collect();
                    for i in (1..order.len()).rev() {
                        order.swap(i, rng.below(i + 1));
                    }
                    out.push('{');
                    for (n, &i) in order.iter().enumerate() {
                        if n > 0 {
                            out.push(',');
                        }
                        out.push_str(rng.pick(&["", " "]));
                        spell_string(&members[i].0, rng, out);
                        out.push_str(rng.pick(&[":", " : "]));
                        members[i].1.spell(rng, out);
                    }
                    out.push_str(rng.pick(&["}", "\n}"]));
                }
            }
        }

        fn text(&self, seed: u64) -> String {
            let mut out = String::new();
            self.spell(&mut Rng(seed | 1), &mut out);
            out
        }
    }

    fn spell_number(negative: bool, digits: &str, exponent: i32, rng: &mut Rng, out: &mut String) {
        if digits == "0" {
            out.push_str(rng.pick(&["0", "-0", "0.0", "0e5", "-0.000E-3", "0E+0"]));
            return;
        }
        if negative {
            out.push('-');
        }
        // digits × 10^exponent = mantissa × 10^(exponent - zeros)
        let zeros = rng.below(3);
        let mantissa = format!("{digits}{}", "0".repeat(zeros));
        let point = rng.below(mantissa.len() + 1);
        let (int, frac) = mantissa.split_at(point);
        let mut written = i64::from(exponent) - zeros as i64 + frac.len() as i64;
        if int.is_empty() {
            let lead = rng.below(3);
            out.push_str("0.");
            out.push_str(&"0".repeat(lead));
            written += lead as i64;
        } else {
            out.push_str(int);
            if !frac.is_empty() {
                out.push('.');
            }
        }
        out.push_str(frac);
        if written != 0 || rng.below(2) == 0 {
            out.push_str(rng.pick(&["e", "E"]));
            if written >= 0 {
                out.push_str(rng.pick(&["", "+"]));
            } else {
                out.push('-');
            }
            out.push_str(rng.pick(&["", "0", "00"]));
            out.push_str(&written.unsigned_abs().to_string());
        }
    }

    fn spell_string(s: &str, rng: &mut Rng, out: &mut String) {
        out.push('"');
        for ch in s.chars() {
            let escaped = rng.below(2) == 0;
            match ch {
                '"' => out.push_str(if escaped { "\\\"" } else { "\\u0022" }),
                '\\' => out.push_str(if escaped { "\\\\" } else { "\\u005C" }),
                '\n' => out.push_str(if escaped { "\\n" } else { "\\u000a" }),
                '/' if escaped => out.push_str("\\/"),
                c if escaped => {
                    let mut units = [0; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04X}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    /// xorshift64*: spellings from a seed proptest chooses (and shrinks).
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
        }

        fn pick<'s>(&mut self, options: &[&'s str]) -> &'s str {
            options[self.below(options.len())]
        }
    }

    fn number(digits: &'static str, exponents: std::ops::Range<i32>) -> BoxedStrategy<Value> {
        (any::<bool>(), digits, exponents)
            .prop_map(|(negative, digits, exponent)| Value::Number {
                negative,
                digits,
                exponent,
            })
            .boxed()
    }

    fn value(
        numbers: BoxedStrategy<Value>,
        strings: &'static str,
        keys: &'static str,
        width: usize,
    ) -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            numbers,
            strings.prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, width as u32, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..width).prop_map(Value::Array),
                prop::collection::btree_map(keys, inner, 0..width)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Any value: exact numbers of up to 30 digits and far beyond `f64`'s
    /// exponents, strings that need escapes.
    fn any_value() -> impl Strategy<Value = Value> {
        value(
            number("0|[1-9]([0-9]{0,28}[1-9])?", -400..400),
            "[a-z\"\\\\/\né😀\u{7f}]{0,6}",
            "[ab\"é😀/]{0,3}",
            4,
        )
    }

    /// Values from a small domain, so that two of them are often equal.
    fn small_value() -> impl Strategy<Value = Value> {
        value(number("0|[1-2]|1[1-2]", -1..2), "[ab]{0,1}", "[ab]", 2)
    }

    proptest! {
        #[test]
        fn every_spelling_of_a_value_has_one_form(v in any_value(), s1 in any::<u64>(), s2 in any::<u64>()) {
            let (a, b) = (v.text(s1), v.text(s2));
            let form = canonical_json(a.as_bytes());
            prop_assert!(form.is_some(), "not JSON: {}", a);
            prop_assert_eq!(&form, &canonical_json(b.as_bytes()), "{} vs {}", a, b);
            // The canonical form is itself JSON, and a fixed point.
            let form = form.unwrap();
            prop_assert_eq!(canonical_json(&form), Some(form));
        }

        #[test]
        fn one_form_iff_one_value(a in small_value(), b in small_value(), s1 in any::<u64>(), s2 in any::<u64>()) {
            let same_value = a.normal() == b.normal();
            let same_form = canonical_json(a.text(s1).as_bytes()) == canonical_json(b.text(s2).as_bytes());
            prop_assert_eq!(same_value, same_form, "{:?} vs {:?}", a, b);
        }

        /// RFC 8785 (JCS) reads numbers as `f64`; where that is exact (up to
        /// 15 significant digits) and keys are ASCII (JCS sorts by UTF-16
        /// units, we by UTF-8 bytes), both write the very same bytes.
        #[test]
        fn agrees_byte_for_byte_with_jcs_where_jcs_is_exact(
            v in value(number("0|[1-9]([0-9]{0,13}[1-9])?", -40..40), "[a-z\"\\\\/\né😀\u{7f}]{0,6}", "[a-z]{1,3}", 4),
            seed in any::<u64>(),
        ) {
            let text = v.text(seed);
            let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
            let jcs = serde_jcs::to_string(&parsed).unwrap();
            let ours = String::from_utf8(canonical_json(text.as_bytes()).unwrap()).unwrap();
            prop_assert_eq!(ours, jcs, "{}", text);
        }
    }
}
