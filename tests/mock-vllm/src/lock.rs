//! Mutexes whose poisoning is ignored.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Lock a mutex, ignoring poisoning (the data stays consistent: every critical section
/// is a single push/replace).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
