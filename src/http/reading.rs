//! What one key's request bodies hold while they are read. A body is read whole before
//! the request is admitted (up to `max_body_bytes`, within `body_read_timeout_ms`), so
//! without a bound a key with many connections could upload many large bodies slowly
//! at once and take the process's memory from everyone. Each key's bodies being read
//! hold at most `connections.reading_bytes_per_key` (counted by their declared length,
//! or their limit when they declare none); beyond it the request gets 429 `queue_full`
//! at once, before a byte of its body is read, as the contract answers "rather than
//! consuming unbounded memory".

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, header};

use crate::error::ApiError;
use crate::http::held::{Held, Hold};

/// When to try an upload again that found its key's bodies at their bound: an upload
/// of the key's is likely done by then.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The bytes each key's bodies being read hold now.
pub struct Reading {
    per_key: usize,
    held: Arc<Held<i64>>,
}

/// A body's share of its key's bound, given back when dropped (read, refused or gone).
pub type ReadingHold = Hold<i64>;

impl Reading {
    pub fn new(per_key: usize) -> Arc<Self> {
        Arc::new(Self {
            per_key,
            held: Held::new(),
        })
    }

    /// Holds what a body of `key`'s will take (its `Content-Length`, else `limit`), or
    /// refuses with 429 `queue_full` when its key's bodies would hold more than the bound.
    pub fn hold(
        &self,
        key: i64,
        headers: &HeaderMap,
        limit: usize,
    ) -> Result<ReadingHold, ApiError> {
        let bytes = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(limit, |declared| declared.min(limit));
        // One body is always let through, whatever its size: a key is never locked out.
        let fits = |now: usize| now == 0 || now.saturating_add(bytes) <= self.per_key;
        self.held
            .hold(key, bytes, fits)
            .map_err(|held| ApiError::BodiesBeingRead {
                held,
                limit: self.per_key,
                retry_after: RETRY_AFTER,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declaring(len: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, len.into());
        headers
    }

    #[test]
    fn a_keys_bodies_hold_at_most_the_bound_and_give_it_back() {
        let reading = Reading::new(100);
        let first = reading.hold(1, &declaring(60), 1000).unwrap();
        let refused = reading.hold(1, &declaring(60), 1000).err().unwrap();
        assert_eq!(refused.code(), "queue_full");
        // Another key is not held back by this one's uploads.
        let other = reading.hold(2, &declaring(60), 1000).unwrap();
        drop(first);
        let again = reading.hold(1, &HeaderMap::new(), 50).unwrap();
        assert_eq!(
            again.amount(),
            50,
            "a body that declares no length holds its limit"
        );
        drop((other, again));
        assert!(reading.held.is_empty());
        // One body alone always goes through, even over the bound.
        assert!(reading.hold(3, &declaring(500), 1000).is_ok());
    }
}
