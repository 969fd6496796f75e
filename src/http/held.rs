//! Amounts held per key at once — connections per peer address, bytes of bodies being
//! read per API key — each hold given back when it is dropped, however its work ends.
//! A key that holds nothing leaves the map, so it holds only keys in use.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// What each key holds now.
pub struct Held<K> {
    held: Mutex<HashMap<K, usize>>,
}

/// `amount` held for `key` until dropped.
pub struct Hold<K: Hash + Eq> {
    held: Arc<Held<K>>,
    key: K,
    amount: usize,
}

impl<K: Hash + Eq + Copy> Held<K> {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            held: Mutex::default(),
        })
    }

    /// Holds `amount` more for `key` when `fits` allows it, given what the key holds
    /// now; else `Err` with what it holds.
    pub fn hold(
        self: &Arc<Self>,
        key: K,
        amount: usize,
        fits: impl FnOnce(usize) -> bool,
    ) -> Result<Hold<K>, usize> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let now = held.get(&key).copied().unwrap_or(0);
        if !fits(now) {
            return Err(now);
        }
        held.insert(key, now.saturating_add(amount));
        Ok(Hold {
            held: Arc::clone(self),
            key,
            amount,
        })
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }
}

impl<K: Hash + Eq> Hold<K> {
    pub fn amount(&self) -> usize {
        self.amount
    }
}

impl<K: Hash + Eq> Drop for Hold<K> {
    fn drop(&mut self) {
        let mut held = self
            .held
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(now) = held.get_mut(&self.key) {
            *now = now.saturating_sub(self.amount);
            if *now == 0 {
                held.remove(&self.key);
            }
        }
    }
}
