//! What a found row decides, and what an error is, the same on every
//! engine.

use std::{sync::Arc, time::Duration};

use super::dialect::{Engine, ErrorClass, KeyRow};
use crate::{
    fingerprint::Fingerprint,
    record::{
        CorruptRecord,
        codec::{self, Compression},
    },
    store::{Claim, Found, FoundState, KeyState, StoreError},
};

/// A live row as the rule reads it ([`Found::decide`]): a row without a
/// record yet (a lease's claim, or a transaction's row committed without
/// its record) is in flight, a record is completed.
pub(crate) fn decide<G>(
    fingerprint: &Fingerprint,
    row: KeyRow,
    compression: &Compression,
) -> Result<Claim<G>, StoreError> {
    let left = Duration::from_millis(row.ms_left.max(0) as u64);
    Found {
        fingerprint: <[u8; 32]>::try_from(row.fingerprint.as_slice())
            .map(Fingerprint::from_bytes)
            .map_err(|_| CorruptRecord("a fingerprint that is not 32 bytes")),
        state: match row.record {
            None => FoundState::InFlight {
                retry_after: left,
                ours: None,
            },
            Some(bytes) => FoundState::Completed {
                record: codec::decode_with(bytes, compression).map(|(_, r)| Arc::new(r)),
                expires_in: left,
            },
        },
    }
    .decide(fingerprint)
}

/// What a live row tells an operator: a record is completed, none yet is a
/// claim in flight.
pub(crate) fn key_state(row: KeyRow, compression: &Compression) -> Result<KeyState, StoreError> {
    let left = Duration::from_millis(row.ms_left.max(0) as u64);
    Ok(match row.record {
        None => KeyState::InFlight { retry_after: left },
        Some(bytes) => KeyState::Completed {
            record: Arc::new(codec::decode_with(bytes, compression)?.1),
            expires_in: left,
        },
    })
}

/// `error` as a store error, said the way a person reading the log needs
/// it: a refused transaction is the request's own; a missing table, a
/// read-only or busy database say so (and what the engine knows of why).
pub(crate) fn store_error<D: Engine>(engine: &D, table: &str, error: sqlx::Error) -> StoreError {
    let class = D::classify(&error);
    let said = |what: String| {
        let why = engine
            .explain(class, &error)
            .map(|w| format!(" ({w})"))
            .unwrap_or_default();
        let said = format!("{what}{why}: {error}");
        StoreError::Unavailable(match class {
            // Unavailable now, and until somebody acts: never transient.
            ErrorClass::ReadOnly
            | ErrorClass::MissingTable
            | ErrorClass::PermissionDenied
            | ErrorClass::BadCredentials
            | ErrorClass::NoDatabase => Box::new(UntilFixed(said)),
            _ => said.into(),
        })
    };
    match class {
        ErrorClass::Refused => StoreError::Refused(Box::new(error)),
        ErrorClass::MissingTable => said(format!(
            "the idempotency table {table} does not exist (create it: create_table_if_missing() on the store's builder, or migrate(); or it was dropped)"
        )),
        ErrorClass::ReadOnly => said("the database is read-only".to_owned()),
        ErrorClass::PermissionDenied => said(format!(
            "the database user may not use the idempotency table {table} (grant it SELECT, INSERT, UPDATE and DELETE)"
        )),
        ErrorClass::BadCredentials => said(
            "the database server refuses the credentials (check the user and its password)"
                .to_owned(),
        ),
        ErrorClass::NoDatabase => said(
            "the database does not exist on the server (was it dropped?)".to_owned(),
        ),
        ErrorClass::Busy => said("the database is busy: another connection holds its write lock".to_owned()),
        ErrorClass::Conflict => said(
            "the database ended the transaction to resolve a conflict with another (a deadlock, or a failed certification on a cluster); nothing committed".to_owned(),
        ),
        ErrorClass::LockTimeout | ErrorClass::Duplicate | ErrorClass::Other => {
            match engine.explain(class, &error) {
                Some(why) => StoreError::Unavailable(format!("{why}: {error}").into()),
                None => StoreError::Unavailable(Box::new(error)),
            }
        }
    }
}

/// A store unavailable until somebody acts — a read-only database, a
/// missing table, a refused user — said as such: not
/// [transient](StoreError::is_transient).
#[derive(Debug)]
pub(crate) struct UntilFixed(pub(crate) String);

impl std::fmt::Display for UntilFixed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UntilFixed {}

/// `error` from creating `table` (the records' or the outbox's): a user
/// without the right to create tables is told so, with both ways out —
/// never the table grants, which a missing table cannot take yet.
pub(crate) fn create_error<D: Engine>(engine: &D, table: &str, error: sqlx::Error) -> StoreError {
    match D::classify(&error) {
        ErrorClass::PermissionDenied => StoreError::Misconfigured(format!(
            "the database user may not create the table {table} ({error}): grant it the right to \
             create tables in the schema (PostgreSQL: GRANT CREATE ON SCHEMA <schema> TO <user>; \
             MySQL/MariaDB: GRANT CREATE, INDEX ON <database>.* TO <user>), or create the table \
             with your migrations (the engine's SCHEMA) and connect without \
             create_table_if_missing()"
        )),
        ErrorClass::ReadOnly => StoreError::Misconfigured(format!(
            "the table {table} cannot be created: the database is read-only ({error})"
        )),
        _ => store_error(engine, table, error),
    }
}
