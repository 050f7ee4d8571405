//! One way to take a mutex: every critical section in this crate is a
//! single operation on the data it guards (an insert, a take, a push), so
//! a panic while holding the lock cannot leave that data half-written and a
//! poisoned lock is safe to use.

use std::sync::{Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
