//! The key service: create, list, find by id or prefix, revoke, set limits, read the
//! ledger's usage. The admin API and the `fleetgate keys` commands both go through it and
//! only parse their input and render its answers; the limit values are checked here, by
//! [`Limit::check_input`], before anything reaches the store.

use crate::admission::{KeyLimits, Month};
use crate::config::LimitDefaults;
use crate::key_limits::{InvalidLimit, Limit, LimitInput};
use crate::key_secret::{Secret, generate, generate_for_prefix};
use crate::store::{KeyRecord, LimitOverrides, LimitUpdate, Store, StoreError, now_unix};
use crate::times::format_duration;

/// How many fresh keys `create` tries when a generated prefix is already taken (a
/// 54-bit collision: in practice never twice).
const CREATE_ATTEMPTS: usize = 3;
/// How long a rotated key's previous secret keeps working when no grace is asked for:
/// a day, time to roll the new one out.
pub const DEFAULT_GRACE_SECS: u64 = 86_400;
/// The longest grace: a secret being replaced (perhaps because it leaked) should not
/// linger for months.
pub const MAX_GRACE_SECS: u64 = 30 * 86_400;
/// The latest expiry a key may have (9999-12-31T23:59:59Z), so that every expiry can be
/// written as an RFC 3339 time.
pub const MAX_EXPIRES_AT: i64 = 253_402_300_799;

/// A new key's own limits as asked for, not yet checked; `None`: the configured default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewLimits {
    pub monthly_budget: Option<LimitInput>,
    pub requests_per_minute: Option<LimitInput>,
    pub max_concurrent: Option<LimitInput>,
    pub max_queued: Option<LimitInput>,
    pub share: Option<LimitInput>,
}

impl NewLimits {
    /// The limits as the store takes them, or the first one out of bounds.
    pub fn check(&self) -> Result<LimitOverrides, InvalidLimit> {
        fn check<T: TryFrom<i128>>(
            limit: Limit,
            input: &Option<LimitInput>,
        ) -> Result<Option<T>, InvalidLimit> {
            input.as_ref().map(|v| limit.check_input(v)).transpose()
        }
        Ok(LimitOverrides {
            monthly_budget: check(Limit::MonthlyBudget, &self.monthly_budget)?,
            requests_per_minute: check(Limit::RequestsPerMinute, &self.requests_per_minute)?,
            max_concurrent: check(Limit::MaxConcurrent, &self.max_concurrent)?,
            max_queued: check(Limit::MaxQueued, &self.max_queued)?,
            share: check(Limit::Share, &self.share)?,
        })
    }
}

/// A change of a key's own limits as asked for, not yet checked. For each limit: `None`
/// leaves it as it is, `Some(None)` returns it to the configured default, `Some(Some(v))`
/// sets it to `v`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LimitsChange {
    pub monthly_budget: Option<Option<LimitInput>>,
    pub requests_per_minute: Option<Option<LimitInput>>,
    pub max_concurrent: Option<Option<LimitInput>>,
    pub max_queued: Option<Option<LimitInput>>,
    pub share: Option<Option<LimitInput>>,
}

impl LimitsChange {
    /// The change as the store takes it, or the first value out of bounds.
    pub fn check(&self) -> Result<LimitUpdate, InvalidLimit> {
        fn check<T: TryFrom<i128>>(
            limit: Limit,
            input: &Option<Option<LimitInput>>,
        ) -> Result<Option<Option<T>>, InvalidLimit> {
            input
                .as_ref()
                .map(|v| v.as_ref().map(|v| limit.check_input(v)).transpose())
                .transpose()
        }
        Ok(LimitUpdate {
            monthly_budget: check(Limit::MonthlyBudget, &self.monthly_budget)?,
            requests_per_minute: check(Limit::RequestsPerMinute, &self.requests_per_minute)?,
            max_concurrent: check(Limit::MaxConcurrent, &self.max_concurrent)?,
            max_queued: check(Limit::MaxQueued, &self.max_queued)?,
            share: check(Limit::Share, &self.share)?,
        })
    }
}

/// A key just created: its record, and its secret, to hand out once.
#[derive(Debug, Clone)]
pub struct IssuedKey {
    pub record: KeyRecord,
    pub secret: Secret,
}

/// A key's usage this month as the usage ledger has it (finished requests only; what
/// running requests reserve is known to the running server's limiter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MonthUsage {
    pub record: KeyRecord,
    /// The limits in force.
    pub limits: KeyLimits,
    pub month: Month,
    /// Tokens (prompt + completion) recorded this month.
    pub used: u64,
    /// `budget − used`, at least 0.
    pub remaining: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// A limit value out of bounds; nothing was changed.
    #[error(transparent)]
    InvalidLimit(#[from] InvalidLimit),
    /// No key has this id or prefix.
    #[error("no key with id or prefix '{0}'")]
    NotFound(String),
    /// A rotation asked for a grace over [`MAX_GRACE_SECS`]; nothing was changed.
    #[error(
        "the grace period must be at most {max} ({MAX_GRACE_SECS} seconds), got {got} ({0} seconds)",
        max = format_duration(MAX_GRACE_SECS),
        got = format_duration(*.0)
    )]
    GraceTooLong(u64),
    /// An expiry before 1970 or after [`MAX_EXPIRES_AT`]; nothing was changed.
    #[error(
        "an expiry must be between 1970-01-01T00:00:00Z and 9999-12-31T23:59:59Z (got Unix second {0})"
    )]
    ExpiryOutOfRange(i64),
    /// A revoked key (by its prefix) cannot be rotated: revocation is final.
    #[error("key {0} is revoked, and a revoked key cannot be rotated; create a new key instead")]
    Revoked(String),
    /// The store failed (or, for a value only the store knows to refuse,
    /// [`StoreError::Invalid`]).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Key management over a store, with the configured limit defaults to resolve a key's
/// limits in force. Cheap: borrow one per request or command.
#[derive(Clone, Copy)]
pub struct KeyService<'a> {
    store: &'a dyn Store,
    defaults: &'a LimitDefaults,
}

impl<'a> KeyService<'a> {
    pub fn new(store: &'a dyn Store, defaults: &'a LimitDefaults) -> Self {
        Self { store, defaults }
    }

    /// The limits in force for a key: its own over the configured defaults.
    pub fn limits(&self, record: &KeyRecord) -> KeyLimits {
        KeyLimits::resolve(self.defaults, &record.limits)
    }

    /// Creates a key with these limits and, if given, the Unix second from which it is
    /// refused (both checked first: an invalid one creates nothing). An expiry already
    /// past is taken: the key is refused from the start.
    pub async fn create(
        &self,
        name: &str,
        email: Option<&str>,
        limits: &NewLimits,
        expires_at: Option<i64>,
    ) -> Result<IssuedKey, KeyError> {
        let limits = limits.check()?;
        let expires_at = expires_at.map(check_expiry).transpose()?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let key = generate();
            let created = self
                .store
                .create_expiring_key(name, email, &key, &limits, expires_at);
            match created.await {
                Ok(record) => {
                    return Ok(IssuedKey {
                        record,
                        secret: key.secret,
                    });
                }
                Err(StoreError::Duplicate(_)) if attempt < CREATE_ATTEMPTS => continue,
                Err(err) => return Err(err.into()),
            }
        }
    }

    /// All keys, revoked ones included, oldest first.
    pub async fn list(&self) -> Result<Vec<KeyRecord>, KeyError> {
        Ok(self.store.list_keys().await?)
    }

    /// The key with this id (all digits) or prefix, revoked or not.
    pub async fn find(&self, id_or_prefix: &str) -> Result<KeyRecord, KeyError> {
        self.store
            .key(id_or_prefix)
            .await?
            .ok_or_else(|| not_found(id_or_prefix))
    }

    /// Revokes a key; it stops working at once. Revoking twice keeps the first time.
    pub async fn revoke(&self, id_or_prefix: &str) -> Result<KeyRecord, KeyError> {
        self.store
            .revoke_key(id_or_prefix)
            .await?
            .ok_or_else(|| not_found(id_or_prefix))
    }

    /// Changes a key's own limits (revoked keys too). The values are checked before the
    /// key is looked up: an invalid one is refused even for an unknown key.
    pub async fn set_limits(
        &self,
        id_or_prefix: &str,
        change: &LimitsChange,
    ) -> Result<KeyRecord, KeyError> {
        let update = change.check()?;
        self.store
            .set_limits(id_or_prefix, &update)
            .await?
            .ok_or_else(|| not_found(id_or_prefix))
    }

    /// Sets (`Some`, Unix seconds) or clears (`None`) the time from which a key is
    /// refused (revoked keys too). An expiry already past is taken: the key is refused
    /// from now on.
    pub async fn set_expiry(
        &self,
        id_or_prefix: &str,
        expires_at: Option<i64>,
    ) -> Result<KeyRecord, KeyError> {
        let expires_at = expires_at.map(check_expiry).transpose()?;
        self.store
            .set_expiry(id_or_prefix, expires_at)
            .await?
            .ok_or_else(|| not_found(id_or_prefix))
    }

    /// Gives a key a new secret (same id, prefix, limits, usage, budget, expiry, jobs
    /// and saved work) and returns it, to hand out once. The secret it replaces keeps
    /// working for `grace_secs` more seconds (0: it stops now). Rotating again during a
    /// grace keeps only the secret this rotation replaces, with the new grace: the one
    /// before it stops at once. A revoked key is refused ([`KeyError::Revoked`]).
    pub async fn rotate(&self, id_or_prefix: &str, grace_secs: u64) -> Result<IssuedKey, KeyError> {
        if grace_secs > MAX_GRACE_SECS {
            return Err(KeyError::GraceTooLong(grace_secs));
        }
        let record = self.find(id_or_prefix).await?;
        if !record.is_active() {
            return Err(KeyError::Revoked(record.prefix));
        }
        let key = generate_for_prefix(&record.prefix).ok_or_else(|| {
            StoreError::Invalid(format!("key {} has a malformed prefix", record.prefix))
        })?;
        // Within i64: the grace is at most MAX_GRACE_SECS.
        let previous_until = (grace_secs > 0).then(|| now_unix() + grace_secs as i64);
        let record = self
            .store
            .rotate_key(&record.id.to_string(), &key.hash, previous_until)
            .await?
            .ok_or_else(|| not_found(id_or_prefix))?;
        Ok(IssuedKey {
            record,
            secret: key.secret,
        })
    }

    /// A key's usage in `month` from the usage ledger, with its limits in force.
    pub async fn usage(&self, id_or_prefix: &str, month: Month) -> Result<MonthUsage, KeyError> {
        let record = self.find(id_or_prefix).await?;
        let used = self
            .store
            .month_usage(record.id, &month.to_string())
            .await?;
        let limits = self.limits(&record);
        Ok(MonthUsage {
            remaining: limits.monthly_budget.saturating_sub(used),
            record,
            limits,
            month,
            used,
        })
    }
}

fn not_found(id_or_prefix: &str) -> KeyError {
    KeyError::NotFound(id_or_prefix.to_owned())
}

/// An expiry within the range every expiry may take.
pub fn check_expiry(at: i64) -> Result<i64, KeyError> {
    if (0..=MAX_EXPIRES_AT).contains(&at) {
        Ok(at)
    } else {
        Err(KeyError::ExpiryOutOfRange(at))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn defaults() -> LimitDefaults {
        LimitDefaults {
            enabled: true,
            monthly_budget: 1_000,
            requests_per_minute: 600,
            max_concurrent: 16,
            max_queued: 64,
            share: 1,
        }
    }

    fn whole(value: i128) -> Option<LimitInput> {
        Some(LimitInput::Whole(value))
    }

    /// One bad value per limit, through `create` and `set_limits`: refused naming the
    /// field, and the store unchanged.
    #[tokio::test]
    async fn bad_limits_are_refused_before_the_store() {
        let store = crate::store::connect("sqlite::memory:").await.unwrap();
        let defaults = defaults();
        let keys = KeyService::new(store.as_ref(), &defaults);
        let kept = keys
            .create("kept", None, &NewLimits::default(), None)
            .await
            .unwrap();

        let bad: [(Limit, LimitInput, &str); 11] = [
            (
                Limit::MonthlyBudget,
                LimitInput::Whole(i128::from(i64::MAX) + 1),
                "monthly_budget must be between 0 and 9223372036854775807 (got 9223372036854775808)",
            ),
            (
                Limit::MonthlyBudget,
                LimitInput::Whole(-1),
                "monthly_budget must be between 0 and 9223372036854775807 (got -1)",
            ),
            (
                Limit::RequestsPerMinute,
                LimitInput::Whole(0),
                "requests_per_minute must be between 1 and 2147483647 (got 0)",
            ),
            (
                Limit::RequestsPerMinute,
                LimitInput::Other("\"ten\"".to_owned()),
                "requests_per_minute must be a whole number between 1 and 2147483647 (got \"ten\")",
            ),
            (
                Limit::MaxConcurrent,
                LimitInput::Whole(0),
                "max_concurrent must be between 1 and 2147483647 (got 0)",
            ),
            (
                Limit::MaxConcurrent,
                LimitInput::Whole(2_147_483_648),
                "max_concurrent must be between 1 and 2147483647 (got 2147483648)",
            ),
            (
                Limit::MaxQueued,
                LimitInput::Whole(3_000_000_000),
                "max_queued must be between 0 and 2147483647 (got 3000000000)",
            ),
            (
                Limit::MaxQueued,
                LimitInput::Other("1.5".to_owned()),
                "max_queued must be a whole number between 0 and 2147483647 (got 1.5)",
            ),
            (
                Limit::Share,
                LimitInput::Whole(0),
                "share must be between 1 and 1000 (got 0)",
            ),
            (
                Limit::Share,
                LimitInput::Whole(1001),
                "share must be between 1 and 1000 (got 1001)",
            ),
            (
                Limit::Share,
                LimitInput::Other("\"2\"".to_owned()),
                "share must be a whole number between 1 and 1000 (got \"2\")",
            ),
        ];
        for (limit, input, message) in bad {
            let mut new = NewLimits::default();
            let mut change = LimitsChange::default();
            match limit {
                Limit::MonthlyBudget => {
                    new.monthly_budget = Some(input.clone());
                    change.monthly_budget = Some(Some(input.clone()));
                }
                Limit::RequestsPerMinute => {
                    new.requests_per_minute = Some(input.clone());
                    change.requests_per_minute = Some(Some(input.clone()));
                }
                Limit::MaxConcurrent => {
                    new.max_concurrent = Some(input.clone());
                    change.max_concurrent = Some(Some(input.clone()));
                }
                Limit::MaxQueued => {
                    new.max_queued = Some(input.clone());
                    change.max_queued = Some(Some(input.clone()));
                }
                Limit::Share => {
                    new.share = Some(input.clone());
                    change.share = Some(Some(input.clone()));
                }
            }
            match keys.create("bad", None, &new, None).await {
                Err(KeyError::InvalidLimit(err)) => {
                    assert_eq!(err.limit(), limit);
                    assert_eq!(err.to_string(), message);
                }
                other => panic!("{input:?}: expected InvalidLimit, got {other:?}"),
            }
            for target in [kept.record.prefix.as_str(), "404"] {
                match keys.set_limits(target, &change).await {
                    Err(KeyError::InvalidLimit(err)) => {
                        assert_eq!(err.limit(), limit);
                        assert_eq!(err.to_string(), message);
                    }
                    other => panic!("{input:?}: expected InvalidLimit, got {other:?}"),
                }
            }
        }
        assert_eq!(keys.list().await.unwrap(), [kept.record]);
    }

    #[tokio::test]
    async fn create_find_set_usage_revoke() {
        let store = crate::store::connect("sqlite::memory:").await.unwrap();
        let defaults = defaults();
        let keys = KeyService::new(store.as_ref(), &defaults);

        let edges = NewLimits {
            monthly_budget: whole(i128::from(i64::MAX)),
            requests_per_minute: whole(1),
            max_concurrent: whole(i128::from(i32::MAX)),
            max_queued: whole(0),
            share: whole(1000),
        };
        let issued = keys
            .create("edges", Some("e@x"), &edges, None)
            .await
            .unwrap();
        assert!(issued.secret.expose().starts_with(&issued.record.prefix));
        assert_eq!(
            issued.record.limits,
            LimitOverrides {
                monthly_budget: Some(i64::MAX as u64),
                requests_per_minute: Some(1),
                max_concurrent: Some(i32::MAX as u32),
                max_queued: Some(0),
                share: Some(1000),
            }
        );
        let id = issued.record.id.to_string();
        assert_eq!(keys.find(&id).await.unwrap(), issued.record);
        assert_eq!(
            keys.find(&issued.record.prefix).await.unwrap(),
            issued.record
        );
        assert!(matches!(
            keys.find("fg-nosuchkey").await,
            Err(KeyError::NotFound(ref k)) if k == "fg-nosuchkey"
        ));

        let change = LimitsChange {
            monthly_budget: Some(whole(500)),
            requests_per_minute: Some(None),
            share: Some(None),
            ..LimitsChange::default()
        };
        let record = keys.set_limits(&id, &change).await.unwrap();
        assert_eq!(record.limits.monthly_budget, Some(500));
        assert_eq!(record.limits.requests_per_minute, None);
        assert_eq!(keys.limits(&record).requests_per_minute, 600);
        assert_eq!(record.limits.share, None);
        assert_eq!(keys.limits(&record).share, 1, "the default");
        assert_eq!(record.limits.max_queued, Some(0), "left as it was");
        assert!(matches!(
            keys.set_limits("12345", &change).await,
            Err(KeyError::NotFound(_))
        ));

        let month = Month::now();
        store
            .record_usage(&crate::store::UsageRow {
                key_id: record.id,
                request_id: "req_1".to_owned(),
                month: month.to_string(),
                prompt_tokens: 100,
                completion_tokens: 20,
                created_at: 0,
            })
            .await
            .unwrap();
        let usage = keys.usage(&record.prefix, month).await.unwrap();
        assert_eq!((usage.used, usage.remaining), (120, 380));
        assert_eq!(usage.limits.monthly_budget, 500);
        assert!(matches!(
            keys.usage("fg-nosuchkey", month).await,
            Err(KeyError::NotFound(_))
        ));

        let revoked = keys.revoke(&record.prefix).await.unwrap();
        assert!(!revoked.is_active());
        assert!(matches!(
            keys.revoke("fg-nosuchkey").await,
            Err(KeyError::NotFound(_))
        ));
        assert_eq!(keys.list().await.unwrap(), [revoked]);
    }

    fn hash_of(secret: &Secret) -> [u8; 32] {
        crate::key_secret::parse_bearer(secret.expose()).unwrap().1
    }

    /// A rotation keeps the key (id, prefix, limits, usage) and gives it a new secret;
    /// both work during the grace, only the new one after it. Rotating again keeps only
    /// the secret that rotation replaced; a grace of 0 keeps none.
    #[tokio::test]
    async fn rotate_keeps_the_key_and_the_old_secret_for_the_grace() {
        use crate::keys::check::{Refusal, check};

        let store = crate::store::connect("sqlite::memory:").await.unwrap();
        let defaults = defaults();
        let keys = KeyService::new(store.as_ref(), &defaults);
        let limits = NewLimits {
            max_queued: whole(3),
            ..NewLimits::default()
        };
        let first = keys.create("r", None, &limits, None).await.unwrap();
        let month = Month::now();
        store
            .record_usage(&crate::store::UsageRow {
                key_id: first.record.id,
                request_id: "req_1".to_owned(),
                month: month.to_string(),
                prompt_tokens: 7,
                completion_tokens: 3,
                created_at: 0,
            })
            .await
            .unwrap();

        let now = now_unix();
        let second = keys.rotate(&first.record.prefix, 3_600).await.unwrap();
        let record = &second.record;
        assert_eq!(
            (record.id, &record.prefix, record.limits, record.created_at),
            (
                first.record.id,
                &first.record.prefix,
                first.record.limits,
                first.record.created_at
            )
        );
        assert_ne!(second.secret, first.secret);
        assert!(second.secret.expose().starts_with(&record.prefix));
        let grace_end = record.previous_secret_expires_at(now).unwrap();
        assert!(
            (now + 3_600..=now + 3_601).contains(&grace_end),
            "{grace_end}"
        );
        assert_eq!(keys.usage(&record.prefix, month).await.unwrap().used, 10);
        let (old, new) = (hash_of(&first.secret), hash_of(&second.secret));
        assert_eq!(check(record, &old, now), Ok(()));
        assert_eq!(check(record, &new, now), Ok(()));
        assert_eq!(
            check(record, &old, grace_end),
            Err(Refusal::Replaced { at: grace_end })
        );
        assert_eq!(check(record, &new, grace_end), Ok(()));

        // Again during the grace: the secret just replaced is kept, the first stops.
        let third = keys.rotate(&record.id.to_string(), 60).await.unwrap();
        let newest = hash_of(&third.secret);
        assert_eq!(check(&third.record, &old, now), Err(Refusal::Unknown));
        assert_eq!(check(&third.record, &new, now), Ok(()));
        assert_eq!(check(&third.record, &newest, now), Ok(()));

        // No grace: only the new secret, at once.
        let fourth = keys.rotate(&record.prefix, 0).await.unwrap();
        assert_eq!(fourth.record.previous_secret_expires_at(now), None);
        assert_eq!(check(&fourth.record, &newest, now), Err(Refusal::Unknown));
        assert_eq!(check(&fourth.record, &hash_of(&fourth.secret), now), Ok(()));

        // Refused, changing nothing: a grace over the bound, an unknown or revoked key.
        assert!(matches!(
            keys.rotate(&record.prefix, MAX_GRACE_SECS + 1).await,
            Err(KeyError::GraceTooLong(_))
        ));
        assert!(matches!(
            keys.rotate("fg-nosuchkey", 0).await,
            Err(KeyError::NotFound(_))
        ));
        keys.revoke(&record.prefix).await.unwrap();
        let refused = keys.rotate(&record.prefix, 0).await.unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "key {} is revoked, and a revoked key cannot be rotated; create a new key instead",
                record.prefix
            )
        );
        let kept = keys.find(&record.prefix).await.unwrap();
        assert_eq!(kept.hash, fourth.record.hash);
    }

    #[tokio::test]
    async fn an_expiry_is_set_checked_and_cleared() {
        use crate::keys::check::{Refusal, check};

        let store = crate::store::connect("sqlite::memory:").await.unwrap();
        let defaults = defaults();
        let keys = KeyService::new(store.as_ref(), &defaults);
        let now = now_unix();
        let issued = keys
            .create("e", None, &NewLimits::default(), Some(now + 60))
            .await
            .unwrap();
        let hash = hash_of(&issued.secret);
        assert_eq!(issued.record.expires_at, Some(now + 60));
        assert_eq!(check(&issued.record, &hash, now), Ok(()));
        assert_eq!(
            check(&issued.record, &hash, now + 60),
            Err(Refusal::Expired { at: now + 60 })
        );
        let prefix = &issued.record.prefix;
        let past = keys.set_expiry(prefix, Some(now - 1)).await.unwrap();
        assert!(!past.is_usable(now));
        assert_eq!(
            check(&past, &hash, now),
            Err(Refusal::Expired { at: now - 1 })
        );
        let cleared = keys.set_expiry(prefix, None).await.unwrap();
        assert_eq!(cleared.expires_at, None);
        assert_eq!(check(&cleared, &hash, i64::MAX), Ok(()));

        for bad in [-1, MAX_EXPIRES_AT + 1] {
            assert!(matches!(
                keys.set_expiry(prefix, Some(bad)).await,
                Err(KeyError::ExpiryOutOfRange(at)) if at == bad
            ));
            assert!(matches!(
                keys.create("bad", None, &NewLimits::default(), Some(bad))
                    .await,
                Err(KeyError::ExpiryOutOfRange(_))
            ));
        }
        assert_eq!(keys.list().await.unwrap(), [cleared]);
    }
}
