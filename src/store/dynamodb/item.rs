//! One record as one DynamoDB item: its attributes, written and read in one
//! place.
//!
//! | attribute | type | holds |
//! |---|---|---|
//! | `pk` | S | the storage key (the scope's hash and the key): the partition key |
//! | `st` | S | `i` a claim in flight, `c` a completed record |
//! | `fp` | B | the request's fingerprint (32 bytes) |
//! | `tok` | B | the claim's fencing token (16 bytes), while in flight |
//! | `exp` | N | when the claim lapses or the record expires (Unix ms) |
//! | `ttl` | N | `exp` in Unix seconds, plus a margin: DynamoDB's TTL attribute |
//! | `rec` | B | the completed record, in the crate's record codec |
//! | `att` | N | the claims of the key begun so far, this one included, while in flight: a claim over a lapsed one counts on |
//! | `bgn` | N | when the first of them began (Unix ms), while in flight |
//!
//! DynamoDB deletes an item some time after its `ttl` (hours, even days):
//! `exp` decides, so an item past it reads as absent and is claimed over.

use std::{
    collections::HashMap,
    time::{Duration, UNIX_EPOCH},
};

use aws_sdk_dynamodb::{primitives::Blob, types::AttributeValue};

use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, CorruptRecord, codec},
    store::{Lapsed, LeaseToken, StorageKey},
};

pub(super) const PK: &str = "pk";
pub(super) const STATE: &str = "st";
pub(super) const FINGERPRINT: &str = "fp";
pub(super) const TOKEN: &str = "tok";
pub(super) const EXPIRES: &str = "exp";
pub(super) const TTL: &str = "ttl";
pub(super) const RECORD: &str = "rec";
pub(super) const ATTEMPTS: &str = "att";
pub(super) const BEGAN: &str = "bgn";

const IN_FLIGHT: &str = "i";
const COMPLETED: &str = "c";

/// How long after `exp` DynamoDB may delete an item: never before it
/// decides anything, whatever the clocks.
const TTL_MARGIN: Duration = Duration::from_secs(3600);

/// The largest record an item holds: DynamoDB's 400 KB item limit, less
/// the other attributes and their names.
pub(super) const MAX_RECORD: usize = 400 * 1024 - 1024;

/// An item as DynamoDB takes and gives it.
pub(super) type Item = HashMap<String, AttributeValue>;

/// The claim is free: nothing there, or what is there has lapsed or
/// expired (by `:now`).
pub(super) const FREE: &str = "attribute_not_exists(#pk) OR #exp < :now";

/// The claim `:tok` still holds the key, whatever its deadline: what an
/// operator's forced forget deletes, as read.
pub(super) const HELD: &str = "#tok = :tok AND #st = :i";

/// The claim `:tok` still holds the key and has not lapsed (by `:now`): a
/// lapsed lease is lost, as on every store, even before another claim
/// takes the key.
pub(super) const HELD_LIVE: &str = "#tok = :tok AND #st = :i AND #exp >= :now";

/// A completed record, exactly the one read (by its expiry).
pub(super) const THE_RECORD: &str = "#st = :c AND #exp = :exp";

pub(super) fn key_of(key: &StorageKey) -> Item {
    HashMap::from([(PK.to_owned(), AttributeValue::S(key.as_str().to_owned()))])
}

pub(super) fn number(n: u64) -> AttributeValue {
    AttributeValue::N(n.to_string())
}

pub(super) fn token_value(token: LeaseToken) -> AttributeValue {
    AttributeValue::B(Blob::new(token.to_bytes().to_vec()))
}

pub(super) fn in_flight_value() -> AttributeValue {
    AttributeValue::S(IN_FLIGHT.to_owned())
}

pub(super) fn completed_value() -> AttributeValue {
    AttributeValue::S(COMPLETED.to_owned())
}

fn ttl_of(expires_ms: u64) -> AttributeValue {
    number((expires_ms / 1000).saturating_add(TTL_MARGIN.as_secs()))
}

/// A claim: the item made a claim in flight, held by `:tok` until `:exp`,
/// counting on from a lapsed claim it replaces (`att`, `bgn`) — a
/// completed record replaced its item whole, so a claim over one counts
/// from one. Conditional on [`FREE`].
pub(super) const CLAIM: &str = "SET #st = :i, #fp = :fp, #tok = :tok, #exp = :exp, #ttl = :ttl, \
     #att = if_not_exists(#att, :zero) + :one, #bgn = if_not_exists(#bgn, :now) REMOVE #rec";

/// [`CLAIM`]'s values, for a claim held by `token` until `deadline_ms`,
/// made at `now_ms`.
pub(super) fn claim_values(
    fingerprint: &Fingerprint,
    token: LeaseToken,
    deadline_ms: u64,
    now_ms: u64,
) -> [(&'static str, AttributeValue); 8] {
    [
        (":i", in_flight_value()),
        (
            ":fp",
            AttributeValue::B(Blob::new(fingerprint.as_bytes().to_vec())),
        ),
        (":tok", token_value(token)),
        (":exp", number(deadline_ms)),
        (":ttl", ttl_of(deadline_ms)),
        (":zero", number(0)),
        (":one", number(1)),
        (":now", number(now_ms)),
    ]
}

/// What a claim replaced, when it was a claim that lapsed: the attempts it
/// counted and when the first began. (An item written before these were
/// kept counts as one attempt, begun by its deadline.)
pub(super) fn lapsed(old: &Item) -> Option<Lapsed> {
    if !matches!(old.get(STATE), Some(AttributeValue::S(state)) if state == IN_FLIGHT) {
        return None;
    }
    let read = |name: &str| match old.get(name) {
        Some(AttributeValue::N(n)) => n.parse::<u64>().ok(),
        _ => None,
    };
    let began = read(BEGAN).or_else(|| read(EXPIRES)).unwrap_or(0);
    Some(Lapsed {
        attempts: read(ATTEMPTS).map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        since: UNIX_EPOCH + Duration::from_millis(began),
    })
}

/// A completed record (`encoded`: the codec's bytes), kept until
/// `expires_ms`.
pub(super) fn completed(
    key: &StorageKey,
    encoded: Vec<u8>,
    fingerprint: &Fingerprint,
    expires_ms: u64,
) -> Item {
    let mut item = key_of(key);
    item.insert(STATE.to_owned(), completed_value());
    item.insert(
        FINGERPRINT.to_owned(),
        AttributeValue::B(Blob::new(fingerprint.as_bytes().to_vec())),
    );
    item.insert(EXPIRES.to_owned(), number(expires_ms));
    item.insert(TTL.to_owned(), ttl_of(expires_ms));
    item.insert(RECORD.to_owned(), AttributeValue::B(Blob::new(encoded)));
    item
}

/// The new expiry of an extended claim: `SET #exp = :exp, ttl = :ttl`.
pub(super) fn extended(deadline_ms: u64) -> [(&'static str, AttributeValue); 2] {
    [(":exp", number(deadline_ms)), (":ttl", ttl_of(deadline_ms))]
}

/// What an item holds.
pub(super) enum Stored {
    InFlight {
        fingerprint: Fingerprint,
        token: LeaseToken,
        deadline_ms: u64,
    },
    Completed {
        fingerprint: Fingerprint,
        /// The codec's bytes.
        record: Vec<u8>,
        expires_ms: u64,
    },
}

impl Stored {
    pub(super) fn read(item: &Item) -> Result<Self, CorruptRecord> {
        let bytes = |name: &str| match item.get(name) {
            Some(AttributeValue::B(blob)) => Ok(blob.as_ref()),
            _ => Err(CorruptRecord(
                "a DynamoDB item without its binary attributes",
            )),
        };
        let expires = match item.get(EXPIRES) {
            Some(AttributeValue::N(n)) => n
                .parse::<u64>()
                .map_err(|_| CorruptRecord("a DynamoDB item whose expiry is not a number"))?,
            _ => return Err(CorruptRecord("a DynamoDB item without its expiry")),
        };
        let fingerprint = Fingerprint::from_bytes(
            bytes(FINGERPRINT)?
                .try_into()
                .map_err(|_| CorruptRecord("a DynamoDB item whose fingerprint is not 32 bytes"))?,
        );
        match item.get(STATE) {
            Some(AttributeValue::S(state)) if state == IN_FLIGHT => {
                Ok(Self::InFlight {
                    fingerprint,
                    token: LeaseToken::from_bytes(bytes(TOKEN)?.try_into().map_err(|_| {
                        CorruptRecord("a DynamoDB claim whose token is not 16 bytes")
                    })?),
                    deadline_ms: expires,
                })
            }
            Some(AttributeValue::S(state)) if state == COMPLETED => Ok(Self::Completed {
                fingerprint,
                record: bytes(RECORD)?.to_vec(),
                expires_ms: expires,
            }),
            _ => Err(CorruptRecord("a DynamoDB item in no known state")),
        }
    }

    /// Whether it still counts at `now_ms` (a lapsed claim, an expired
    /// record count as absent).
    pub(super) fn live(&self, now_ms: u64) -> bool {
        match self {
            Self::InFlight { deadline_ms, .. } => *deadline_ms >= now_ms,
            Self::Completed { expires_ms, .. } => *expires_ms >= now_ms,
        }
    }
}

/// `record` in the codec, for an item: a record over DynamoDB's item limit
/// is stored as unreplayable (its status, so a retry is refused rather than
/// run again), and logged.
pub(super) fn encode(
    key: &StorageKey,
    fingerprint: &Fingerprint,
    record: &CompletedRecord,
    compression: &codec::Compression,
) -> Vec<u8> {
    let encoded = codec::encode_with(fingerprint, record, compression);
    if encoded.len() <= MAX_RECORD {
        return encoded;
    }
    tracing::warn!(
        %key,
        bytes = encoded.len(),
        "idempotency: the record exceeds DynamoDB's 400 KB item limit; stored without its body \
         (retries are refused as unreplayable). Compress bodies (`Compression`) or lower the \
         layer's `max_stored_body`"
    );
    let smaller = match record {
        CompletedRecord::Response(response) => CompletedRecord::Unreplayable {
            status: response.status(),
            created_at: response.created_at(),
        },
        CompletedRecord::Message { created_at, .. } => CompletedRecord::Message {
            result: None,
            created_at: *created_at,
        },
        unreplayable @ CompletedRecord::Unreplayable { .. } => unreplayable.clone(),
    };
    codec::encode_with(fingerprint, &smaller, compression)
}
