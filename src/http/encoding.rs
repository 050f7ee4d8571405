//! A stored response's content coding, as a retry accepts it. Compression
//! belongs outside the layer, so that the stored response is the plain one
//! and each retry gets the coding it asked for; placed inside, the layer
//! stores a gzip body and must not replay it to a client that never asked
//! for gzip.

use std::{
    io::Read,
    sync::atomic::{AtomicBool, Ordering},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, header::CONTENT_ENCODING};

/// Whether the misplaced compression layer was logged.
static INSIDE_SAID: AtomicBool = AtomicBool::new(false);

/// The coding of a response the layer is about to store, if any: logged
/// once per process, since it means compression sits inside the layer.
pub(crate) fn note_stored(headers: &HeaderMap) {
    let coded = coding(headers.get_all(CONTENT_ENCODING).iter()).is_some();
    if coded && !INSIDE_SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "idempotency: a response reached the layer already compressed (Content-Encoding): \
             the compression layer sits inside the idempotency layer. Put it outside, so that each \
             retry gets the coding it asks for; meanwhile replays decode gzip and deflate for \
             clients that do not accept them. Said once per process."
        );
    }
}

/// What a retry receives of a stored body: as it is (`Ok(None)`: the retry
/// accepts its coding, or it has none), decoded (`Ok(Some(body))`), or
/// `Err(coding)` when it is in a coding the retry does not accept and the
/// layer cannot decode.
pub(crate) fn for_retry(
    stored: &[(HeaderName, HeaderValue)],
    body: &Bytes,
    accept: Option<&HeaderValue>,
) -> Result<Option<Bytes>, String> {
    let codings = stored
        .iter()
        .filter(|(name, _)| name == CONTENT_ENCODING)
        .map(|(_, value)| value);
    let Some(coding) = coding(codings) else {
        return Ok(None);
    };
    if accepts(accept, &coding) {
        return Ok(None);
    }
    let mut decoded = Vec::new();
    let read = match coding.as_str() {
        "gzip" | "x-gzip" => flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut decoded),
        "deflate" => flate2::read::ZlibDecoder::new(&body[..]).read_to_end(&mut decoded),
        _ => return Err(coding),
    };
    read.map(|_| Some(decoded.into())).map_err(|_| coding)
}

/// The content coding of a response's `Content-Encoding` values,
/// lowercase (several, as `gzip, br`); `None` for none or `identity`.
fn coding<'a>(values: impl Iterator<Item = &'a HeaderValue>) -> Option<String> {
    let codings: Vec<String> = values
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect();
    (!codings.is_empty()).then(|| codings.join(", "))
}

/// Whether `Accept-Encoding` accepts `coding` (by name or `*`, with a
/// non-zero weight). A request without the header is taken to want none:
/// RFC 9110 would allow any, but no client that omits it expects a
/// compressed body.
fn accepts(accept: Option<&HeaderValue>, coding: &str) -> bool {
    let Some(accept) = accept.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    accept.split(',').any(|item| {
        let mut parts = item.split(';');
        let name = parts.next().unwrap_or_default().trim();
        let zero = parts.any(|p| {
            p.trim()
                .strip_prefix("q=")
                .and_then(|q| q.trim().parse::<f32>().ok())
                .is_some_and(|q| q == 0.0)
        });
        !zero && (name.eq_ignore_ascii_case(coding) || name == "*")
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn gzip(text: &[u8]) -> Bytes {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(text).unwrap();
        encoder.finish().unwrap().into()
    }

    fn encoded(coding: &'static str) -> Vec<(HeaderName, HeaderValue)> {
        vec![(CONTENT_ENCODING, HeaderValue::from_static(coding))]
    }

    #[test]
    fn a_coding_the_retry_does_not_accept_is_decoded_or_refused() {
        let body = gzip(b"{\"id\":1}");
        let accept = |v: &'static str| Some(HeaderValue::from_static(v));
        let gz = encoded("gzip");
        assert_eq!(for_retry(&gz, &body, accept("gzip, br").as_ref()), Ok(None));
        assert_eq!(for_retry(&gz, &body, accept("*").as_ref()), Ok(None));
        let plain = Ok(Some(Bytes::from_static(b"{\"id\":1}")));
        assert_eq!(for_retry(&gz, &body, None), plain);
        assert_eq!(for_retry(&gz, &body, accept("br").as_ref()), plain);
        assert_eq!(for_retry(&gz, &body, accept("gzip;q=0").as_ref()), plain);
        assert_eq!(for_retry(&encoded("br"), &body, None), Err("br".to_owned()));
        assert_eq!(for_retry(&[], &body, None), Ok(None));
        assert_eq!(for_retry(&encoded("identity"), &body, None), Ok(None));
    }
}
