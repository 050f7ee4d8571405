//! JSON Pointers (RFC 6901) applied to a canonical JSON document: the parts
//! of the body a fingerprint ignores, or the only parts it keeps.
//!
//! The document is the canonicaliser's output — no whitespace, members
//! sorted, numbers in their exact canonical spelling — read into a tree of
//! slices of it and written back, so no number passes through `f64`.

use std::borrow::Cow;

/// A parsed JSON Pointer: its reference tokens, unescaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JsonPointer(Vec<String>);

impl JsonPointer {
    /// Parses `pointer`: empty (the whole document), or `/`-separated
    /// tokens where `~1` is `/` and `~0` is `~`.
    pub(crate) fn parse(pointer: &str) -> Result<Self, String> {
        if pointer.is_empty() {
            return Ok(Self(Vec::new()));
        }
        let Some(rest) = pointer.strip_prefix('/') else {
            return Err(format!(
                "the JSON Pointer {pointer:?} must be empty or start with '/'"
            ));
        };
        rest.split('/')
            .map(|token| {
                let mut out = String::with_capacity(token.len());
                let mut chars = token.chars();
                while let Some(c) = chars.next() {
                    if c != '~' {
                        out.push(c);
                        continue;
                    }
                    match chars.next() {
                        Some('0') => out.push('~'),
                        Some('1') => out.push('/'),
                        _ => {
                            return Err(format!(
                                "the JSON Pointer {pointer:?} has a '~' not followed by 0 or 1"
                            ));
                        }
                    }
                }
                Ok(out)
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }
}

/// A node of a canonical document, borrowing its text.
enum Node<'a> {
    /// Members in the document's (sorted) order: the key as written (a JSON
    /// string, quotes included) and its value.
    Object(Vec<(&'a [u8], Node<'a>)>),
    Array(Vec<Node<'a>>),
    /// A string, number, `true`, `false` or `null`, as written.
    Scalar(&'a [u8]),
}

/// `canonical` with only the parts `keep` points to (all of it when `keep`
/// is empty), then without the parts `ignore` points to. `None` if the text
/// is not the canonicaliser's output.
pub(crate) fn select(
    canonical: &[u8],
    keep: &[JsonPointer],
    ignore: &[JsonPointer],
) -> Option<Vec<u8>> {
    let mut reader = Reader {
        text: canonical,
        pos: 0,
    };
    let mut node = reader.node()?;
    if reader.pos != canonical.len() {
        return None;
    }
    if !keep.is_empty() {
        let keep: Vec<&[String]> = keep.iter().map(|p| p.0.as_slice()).collect();
        node = kept(node, &keep)?.unwrap_or(Node::Object(Vec::new()));
    }
    for pointer in ignore {
        node = without(node, &pointer.0);
    }
    let mut out = Vec::with_capacity(canonical.len());
    write(&node, &mut out);
    Some(out)
}

/// The parts of `node` that `pointers` (relative to it) reach; `None` when
/// none does. An empty pointer keeps the whole node.
fn kept<'a>(node: Node<'a>, pointers: &[&[String]]) -> Option<Option<Node<'a>>> {
    if pointers.iter().any(|p| p.is_empty()) {
        return Some(Some(node));
    }
    let below = |token: &str| -> Vec<&[String]> {
        pointers
            .iter()
            .filter(|p| p[0] == token)
            .map(|p| &p[1..])
            .collect()
    };
    Some(match node {
        Node::Object(members) => {
            let mut out = Vec::new();
            for (key, value) in members {
                let name = key_name(key)?;
                let deeper = below(&name);
                if deeper.is_empty() {
                    continue;
                }
                if let Some(value) = kept(value, &deeper)? {
                    out.push((key, value));
                }
            }
            (!out.is_empty()).then_some(Node::Object(out))
        }
        Node::Array(items) => {
            let mut out = Vec::new();
            for (index, item) in items.into_iter().enumerate() {
                let deeper = below(&index.to_string());
                if deeper.is_empty() {
                    continue;
                }
                if let Some(item) = kept(item, &deeper)? {
                    out.push(item);
                }
            }
            (!out.is_empty()).then_some(Node::Array(out))
        }
        Node::Scalar(_) => None,
    })
}

/// `node` without the part `pointer` reaches (unchanged if it reaches
/// nothing; the whole document is never removed).
fn without<'a>(node: Node<'a>, pointer: &[String]) -> Node<'a> {
    let Some((first, rest)) = pointer.split_first() else {
        return node;
    };
    match node {
        Node::Object(members) => Node::Object(
            members
                .into_iter()
                .filter_map(|(key, value)| {
                    if key_name(key).as_deref() != Some(first.as_str()) {
                        return Some((key, value));
                    }
                    (!rest.is_empty()).then(|| (key, without(value, rest)))
                })
                .collect(),
        ),
        Node::Array(items) => Node::Array(
            items
                .into_iter()
                .enumerate()
                .filter_map(|(index, item)| {
                    if index.to_string() != *first {
                        return Some(item);
                    }
                    (!rest.is_empty()).then(|| without(item, rest))
                })
                .collect(),
        ),
        scalar => scalar,
    }
}

/// A member's key, unescaped.
fn key_name(key: &[u8]) -> Option<Cow<'_, str>> {
    if !key.contains(&b'\\') {
        return std::str::from_utf8(key.get(1..key.len() - 1)?)
            .ok()
            .map(Cow::Borrowed);
    }
    serde_json::from_slice::<String>(key).ok().map(Cow::Owned)
}

fn write(node: &Node<'_>, out: &mut Vec<u8>) {
    match node {
        Node::Scalar(text) => out.extend_from_slice(text),
        Node::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Node::Object(members) => {
            out.push(b'{');
            for (i, (key, value)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(key);
                out.push(b':');
                write(value, out);
            }
            out.push(b'}');
        }
    }
}

/// Reads the canonicaliser's output: no whitespace, so every token starts
/// where the last ended. Its nesting is already bounded by the
/// canonicaliser.
struct Reader<'a> {
    text: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn node(&mut self) -> Option<Node<'a>> {
        match *self.text.get(self.pos)? {
            b'{' => {
                self.pos += 1;
                let mut members = Vec::new();
                if self.eat(b'}') {
                    return Some(Node::Object(members));
                }
                loop {
                    let key = self.string()?;
                    self.eat(b':').then_some(())?;
                    members.push((key, self.node()?));
                    if self.eat(b'}') {
                        return Some(Node::Object(members));
                    }
                    self.eat(b',').then_some(())?;
                }
            }
            b'[' => {
                self.pos += 1;
                let mut items = Vec::new();
                if self.eat(b']') {
                    return Some(Node::Array(items));
                }
                loop {
                    items.push(self.node()?);
                    if self.eat(b']') {
                        return Some(Node::Array(items));
                    }
                    self.eat(b',').then_some(())?;
                }
            }
            b'"' => self.string().map(Node::Scalar),
            _ => {
                let start = self.pos;
                while self
                    .text
                    .get(self.pos)
                    .is_some_and(|b| !matches!(b, b',' | b']' | b'}' | b':'))
                {
                    self.pos += 1;
                }
                (self.pos > start).then(|| Node::Scalar(&self.text[start..self.pos]))
            }
        }
    }

    /// A string, quotes included.
    fn string(&mut self) -> Option<&'a [u8]> {
        let start = self.pos;
        self.eat(b'"').then_some(())?;
        loop {
            match *self.text.get(self.pos)? {
                b'\\' => self.pos += 2,
                b'"' => {
                    self.pos += 1;
                    return Some(&self.text[start..self.pos]);
                }
                _ => self.pos += 1,
            }
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        let found = self.text.get(self.pos) == Some(&byte);
        self.pos += usize::from(found);
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::canonical_json::canonical_json;

    fn apply(json: &str, keep: &[&str], ignore: &[&str]) -> String {
        let parse = |ps: &[&str]| {
            ps.iter()
                .map(|p| JsonPointer::parse(p).unwrap())
                .collect::<Vec<_>>()
        };
        let canonical = canonical_json(json.as_bytes()).unwrap();
        String::from_utf8(select(&canonical, &parse(keep), &parse(ignore)).unwrap()).unwrap()
    }

    #[test]
    fn ignore_and_keep_select_by_pointer() {
        let doc = r#"{"amount":1999,"currency":"eur","metadata":{"client_time":"t","order":"o-1"},"items":[1,2,3],"a/b":1,"m~n":2}"#;
        assert_eq!(
            apply(doc, &[], &["/metadata/client_time"]),
            r#"{"a/b":1,"amount":1999,"currency":"eur","items":[1,2,3],"metadata":{"order":"o-1"},"m~n":2}"#
        );
        assert_eq!(
            apply(doc, &["/amount", "/currency"], &[]),
            r#"{"amount":1999,"currency":"eur"}"#
        );
        assert_eq!(apply(doc, &["/items/1"], &[]), r#"{"items":[2]}"#);
        assert_eq!(apply(doc, &["/a~1b", "/m~0n"], &[]), r#"{"a/b":1,"m~n":2}"#);
        assert_eq!(apply(doc, &["/missing"], &[]), "{}");
        assert_eq!(apply(doc, &[""], &["/items"]), apply(doc, &[], &["/items"]));
        assert_eq!(
            apply(r#"{"big":100000000000000000001}"#, &["/big"], &[]),
            r#"{"big":100000000000000000001}"#
        );
    }

    #[test]
    fn invalid_pointers_are_refused() {
        assert!(JsonPointer::parse("amount").is_err());
        assert!(JsonPointer::parse("/a~2").is_err());
        assert!(JsonPointer::parse("/a~").is_err());
        assert_eq!(JsonPointer::parse("/a~1b/~0").unwrap().0, ["a/b", "~"]);
    }
}
