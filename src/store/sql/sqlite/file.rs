//! The database file a SQLite store opened, and what can become of it
//! while the store runs: deleted or replaced (new connections would open an
//! empty file, existing ones write into one that no longer exists), full,
//! or read-only.

use std::path::PathBuf;

use sqlx::SqlitePool;

use crate::store::{StoreError, sql::dialect::ErrorClass};

#[derive(Debug)]
pub(super) struct DatabaseFile {
    /// `None` for an in-memory database.
    path: Option<PathBuf>,
    /// The file's identity when the store opened it.
    identity: Option<Identity>,
}

impl DatabaseFile {
    pub(super) fn of(pool: &SqlitePool) -> Self {
        let path = pool.connect_options().get_filename().to_path_buf();
        let identity = identity(&path);
        Self {
            path: identity.is_some().then_some(path),
            identity,
        }
    }

    /// An error when the file the store opened was deleted or replaced.
    pub(super) fn still_there(&self) -> Result<(), StoreError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        if identity(path) == self.identity {
            return Ok(());
        }
        Err(StoreError::Unavailable(
            format!(
                "the database file {} was deleted or replaced while the store was running: nothing \
                 more is written to it; restart the process (charges and records written before \
                 are in the file it opened, if that still exists elsewhere)",
                path.display()
            )
            .into(),
        ))
    }

    /// What the file says about an error.
    pub(super) fn explain(&self, class: ErrorClass, error: &sqlx::Error) -> Option<String> {
        let path = self.path.as_ref()?;
        if let Err(gone) = self.still_there() {
            return Some(gone.to_string());
        }
        let code = error
            .as_database_error()
            .and_then(|e| e.code())
            .and_then(|code| code.parse::<i32>().ok())
            .unwrap_or(0);
        match (class, code & 0xff) {
            // SQLITE_FULL
            (_, 13) => Some(format!(
                "the file system holding {} is full",
                path.display()
            )),
            (ErrorClass::ReadOnly, _) => Some(format!("{} is read-only", path.display())),
            _ => None,
        }
    }
}

/// A file's device and inode (elsewhere than Unix: whether it exists).
#[cfg(unix)]
type Identity = (u64, u64);
#[cfg(not(unix))]
type Identity = ();

fn identity(path: &std::path::Path) -> Option<Identity> {
    let metadata = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Some((metadata.dev(), metadata.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = metadata;
        Some(())
    }
}

/// Opening `path` failed: a read-only file system or file says so.
pub(super) fn open_error(path: &str, error: sqlx::Error) -> StoreError {
    let code = error
        .as_database_error()
        .and_then(|e| e.code())
        .and_then(|code| code.parse::<i32>().ok())
        .unwrap_or(0);
    let what = match code & 0xff {
        // SQLITE_READONLY
        8 => "the database is read-only (a read-only file or file system)",
        // SQLITE_CANTOPEN
        14 => {
            "the database file cannot be opened or created (its directory missing, or not writable)"
        }
        // SQLITE_FULL
        13 => "the file system is full",
        // SQLITE_NOTADB
        26 => "the file is not a SQLite database",
        _ => "the database cannot be opened",
    };
    StoreError::Unavailable(format!("{what}: {path}: {error}").into())
}
