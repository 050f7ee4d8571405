//! The lease store: each operation one short autocommit statement, the
//! claim a lease with a fencing token, like the Redis store's — the same on
//! every engine.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use super::{
    Base,
    base::now_ms,
    decide::decide,
    dialect::Dialect,
    dialect::{Args, Connection, Engine, LeaseClaim},
    millis,
};
use crate::{
    fingerprint::Fingerprint,
    record::{CompletedRecord, codec},
    store::{Claim, Forgotten, KeyState, LeaseToken, StorageKey, Store, StoreError, claim_within},
};

/// A [`Store`] on a SQL database whose claims are leases, each operation one
/// short autocommit statement: a claim with a lease and a fencing token (an
/// expired claim is taken over by compare-and-swap), heartbeats, fenced
/// completion and release. Use it when the handler's effects live
/// elsewhere; the crash window is then the same as with Redis. For effects
/// in the same database, the transactional store ([`SqlTxStore`](super::SqlTxStore))
/// commits the record with them.
///
/// Named by engine: `PostgresStore`,
/// `SqliteStore`, `MySqlStore`. Cloning is cheap and
/// clones share the pool.
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn demo() -> Result<(), tower_idempotency::store::StoreError> {
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, SqliteStore};
///
/// let store = SqliteStore::builder()
///     .create_table_if_missing()
///     .connect("sqlite://records.db")
///     .await?;
/// let app: Router = Router::new()
///     .route("/v1/emails", post(|| async { "sent" }))
///     .layer(IdempotencyLayer::new(store).single_tenant());
/// # Ok(()) }
/// ```
pub struct SqlStore<D: Dialect> {
    pub(crate) base: Arc<Base<D>>,
}

impl<D: Dialect> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
        }
    }
}

impl<D: Engine> std::fmt::Debug for SqlStore<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(D::STORE)
            .field("table", &self.base.sql.table)
            .field("timeout", &self.base.timeout)
            .finish_non_exhaustive()
    }
}

super::table_methods!(SqlStore);

/// What one claim statement came to.
enum Attempt {
    Acquired,
    /// A live row holds the key: decided by it.
    Found(super::dialect::KeyRow),
    /// Nothing to decide by (the row went away, or committed after the
    /// statement's snapshot): asked again.
    Again,
}
impl<D: Engine> SqlStore<D> {
    /// One claim, on `on`: the lease inserted or taken over, or the row
    /// that holds the key. Not bounded here: the whole claim is, by
    /// `claim_within`, which finishes it in the background if it runs late.
    async fn attempt(
        base: &Base<D>,
        on: &mut Connection<D>,
        args: &Args<'_>,
    ) -> Result<Attempt, sqlx::Error> {
        let sql = &base.sql;
        let found = match D::LEASE_CLAIM {
            LeaseClaim::Answers => D::fetch(on, &sql.claim, args).await?,
            LeaseClaim::Counts => {
                if D::execute(on, &sql.claim, args).await? == 1 {
                    return Ok(Attempt::Acquired);
                }
                D::fetch(on, &sql.find, args).await?
            }
            LeaseClaim::ReadsBack => {
                D::execute(on, &sql.claim, args).await?;
                D::fetch(on, &sql.find, args).await?
            }
        };
        Ok(match found {
            Some(row) if row.acquired => Attempt::Acquired,
            Some(row) if row.token.as_deref() == Some(args.token) && row.ms_left > 0 => {
                Attempt::Acquired
            }
            Some(row) if row.ms_left > 0 => Attempt::Found(row),
            _ => Attempt::Again,
        })
    }

    /// Runs a statement fenced by `token` under this process's turn to
    /// write: whether it matched the claim.
    async fn fenced(
        &self,
        stmt: &super::dialect::Stmt,
        args: &Args<'_>,
    ) -> Result<bool, StoreError> {
        let _turn = self.base.engine.turn(Some(self.base.timeout)).await?;
        Ok(self.base.execute(stmt, args).await? == 1)
    }
}

impl<D: Engine> Store for SqlStore<D> {
    type Granted = LeaseToken;

    async fn claim(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let lease_ms = millis(lease, "lease")?;
        let started = Instant::now();
        let base = &self.base;
        // This process's turn, and a connection: waiting for them sends
        // nothing, so a claim that times out here is simply abandoned.
        let (turn, mut on) = base
            .bounded(async {
                let turn = base.engine.turn(Some(base.timeout)).await?;
                let on = base.pool.acquire().await.map_err(|e| base.error(e))?;
                Ok((turn, on))
            })
            .await?;
        // Owned, so that it can outlive this call (see `claim_within`).
        let (base, owned_key, fingerprint) = (self.base.clone(), key.clone(), *fingerprint);
        let claim = async move {
            let _turn = turn;
            let token = LeaseToken::generate().to_bytes();
            // A row removed between two statements (released, or expired and
            // swept), or committed after a statement's snapshot, makes the
            // claim ask again.
            for _ in 0..3 {
                let args = Args {
                    key: owned_key.as_str(),
                    fingerprint: fingerprint.as_bytes(),
                    token: &token,
                    ms: lease_ms,
                    now: now_ms(),
                    ..Args::default()
                };
                match Self::attempt(&base, &mut on, &args)
                    .await
                    .map_err(|e| base.error(e))?
                {
                    Attempt::Acquired => return Ok(Claim::Acquired(LeaseToken::from_bytes(token))),
                    Attempt::Found(row) => return decide(&fingerprint, row, &base.compression),
                    Attempt::Again => continue,
                }
            }
            Err(StoreError::Unavailable(
                "the claim found a record it could not read three times".into(),
            ))
        };
        claim_within(self, key, started, self.base.timeout, lease, claim).await
    }

    async fn extend(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let token = token.to_bytes();
        let args = Args {
            key: key.as_str(),
            token: &token,
            ms: millis(lease, "lease")?,
            now: now_ms(),
            ..Args::default()
        };
        self.fenced(&self.base.sql.extend, &args).await
    }

    async fn complete(
        &self,
        key: &StorageKey,
        token: &mut LeaseToken,
        fingerprint: &Fingerprint,
        record: Arc<CompletedRecord>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let record = codec::encode_with(fingerprint, &record, &self.base.compression);
        let token = token.to_bytes();
        let args = Args {
            key: key.as_str(),
            token: &token,
            record: &record,
            ms: millis(retention, "retention")?,
            now: now_ms(),
            ..Args::default()
        };
        self.fenced(&self.base.sql.complete, &args).await
    }

    async fn release(&self, key: &StorageKey, token: LeaseToken) -> Result<bool, StoreError> {
        let token = token.to_bytes();
        let args = Args {
            key: key.as_str(),
            token: &token,
            now: now_ms(),
            ..Args::default()
        };
        self.fenced(&self.base.sql.release, &args).await
    }

    async fn inspect(&self, key: &StorageKey) -> Result<KeyState, StoreError> {
        Ok(self
            .base
            .inspect_row(key)
            .await?
            .unwrap_or(KeyState::Absent))
    }

    async fn forget(&self, key: &StorageKey, force: bool) -> Result<Forgotten, StoreError> {
        self.base.forget_row(key, force).await
    }
}
