//! Whether a presented secret may be used, given the record of the key its prefix names
//! and the time: the key's current secret, or its previous one during a rotation's
//! grace, of a key neither revoked nor expired.

use crate::error::ApiError;
use crate::key_secret::verify;
use crate::store::KeyRecord;
use crate::times::format_time;

/// Why a presented secret is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Neither of the key's secrets (or a previous one no longer kept): as if there
    /// were no such key.
    Unknown,
    /// A secret of a revoked key.
    Revoked,
    /// A secret of a key that expired at this Unix second.
    Expired { at: i64 },
    /// The secret a rotation replaced, after its grace ended at this Unix second.
    Replaced { at: i64 },
}

/// How a refused key is answered: 401 `invalid_api_key` always, with a message that
/// says why to whoever holds one of the key's secrets (any other secret learns nothing).
impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Unknown => Self::Unauthorized("Invalid API key."),
            Refusal::Revoked => Self::Unauthorized("This API key has been revoked."),
            Refusal::Expired { at } => Self::KeyRefused(format!(
                "This API key expired at {}. Ask its administrator for a new expiry or a new key.",
                format_time(at)
            )),
            Refusal::Replaced { at } => Self::KeyRefused(format!(
                "This secret was replaced by a new one (the key was rotated) and stopped \
                 working at {}. Use the key's new secret.",
                format_time(at)
            )),
        }
    }
}

/// Checks `presented` (a SHA-256 hash, see [`crate::key_secret::parse_bearer`])
/// against `record` at `now` (Unix seconds). Both hashes are compared in constant time.
pub fn check(record: &KeyRecord, presented: &[u8; 32], now: i64) -> Result<(), Refusal> {
    let current = verify(&record.hash, presented);
    let previous = record
        .previous_hash
        .as_deref()
        .is_some_and(|hash| verify(hash, presented));
    if !current && !previous {
        return Err(Refusal::Unknown);
    }
    if !record.is_active() {
        return Err(Refusal::Revoked);
    }
    if let Some(at) = record.expires_at.filter(|&at| at <= now) {
        return Err(Refusal::Expired { at });
    }
    if !current && record.previous_secret_expires_at(now).is_none() {
        let at = record.previous_expires_at.unwrap_or(now);
        return Err(Refusal::Replaced { at });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::key_secret::{generate, generate_for_prefix};
    use crate::store::LimitOverrides;

    const NOW: i64 = 1_800_000_000;

    fn record(hash: [u8; 32]) -> KeyRecord {
        KeyRecord {
            id: 1,
            name: "k".to_owned(),
            email: None,
            prefix: "fg-AAAAAAAAA".to_owned(),
            hash: hash.to_vec(),
            created_at: NOW - 100,
            revoked_at: None,
            limits: LimitOverrides::default(),
            expires_at: None,
            previous_hash: None,
            previous_expires_at: None,
        }
    }

    #[test]
    fn the_current_secret_works_until_the_key_expires() {
        let key = generate();
        let other = generate();
        let mut record = record(key.hash);
        assert_eq!(check(&record, &key.hash, NOW), Ok(()));
        assert_eq!(check(&record, &other.hash, NOW), Err(Refusal::Unknown));
        record.expires_at = Some(NOW + 1);
        assert_eq!(check(&record, &key.hash, NOW), Ok(()));
        assert_eq!(
            check(&record, &key.hash, NOW + 1),
            Err(Refusal::Expired { at: NOW + 1 })
        );
        assert_eq!(check(&record, &other.hash, NOW + 1), Err(Refusal::Unknown));
        record.revoked_at = Some(NOW);
        assert_eq!(check(&record, &key.hash, NOW + 1), Err(Refusal::Revoked));
    }

    #[test]
    fn the_previous_secret_works_until_its_grace_ends() {
        let old = generate();
        let new = generate_for_prefix(&old.prefix).unwrap();
        let mut record = record(new.hash);
        record.previous_hash = Some(old.hash.to_vec());
        record.previous_expires_at = Some(NOW + 10);
        for now in [NOW, NOW + 9] {
            assert_eq!(check(&record, &old.hash, now), Ok(()));
            assert_eq!(check(&record, &new.hash, now), Ok(()));
        }
        assert_eq!(
            check(&record, &old.hash, NOW + 10),
            Err(Refusal::Replaced { at: NOW + 10 })
        );
        assert_eq!(check(&record, &new.hash, NOW + 10), Ok(()));
        // An expiry or a revocation stops both.
        record.expires_at = Some(NOW + 5);
        for hash in [&old.hash, &new.hash] {
            assert_eq!(
                check(&record, hash, NOW + 5),
                Err(Refusal::Expired { at: NOW + 5 })
            );
        }
        record.revoked_at = Some(NOW);
        assert_eq!(check(&record, &old.hash, NOW), Err(Refusal::Revoked));
    }
}
