//! A presented bearer token: shaped like a key we issue (`crate::key_secret`), then its
//! hash compared with the stored one in constant time.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use subtle::ConstantTimeEq as _;

use crate::key_secret::{PREFIX_LEN, SECRET_LEN, SECRET_PREFIX, SECRET_RANDOM_BYTES, hash_secret};

/// Splits a presented bearer token into its prefix (for the store lookup) and its hash
/// (to [`verify`] against the record). Returns `None` for anything that is not shaped
/// exactly like a key we issue — wrong leading `fg-`, wrong length, characters outside
/// the base64url alphabet, non-canonical encoding — so it can be rejected without
/// touching the store.
pub fn parse_bearer(secret: &str) -> Option<(&str, [u8; 32])> {
    if secret.len() != SECRET_LEN {
        return None;
    }
    let encoded = secret.strip_prefix(SECRET_PREFIX)?;
    // The engine rejects padding, characters outside the alphabet and non-zero trailing
    // bits, so only encodings that `key_secret::generate` can produce get through.
    let mut decoded = [0u8; SECRET_RANDOM_BYTES];
    match URL_SAFE_NO_PAD.decode_slice(encoded, &mut decoded) {
        Ok(SECRET_RANDOM_BYTES) => {}
        _ => return None,
    }
    // All ASCII (checked by the decode), so byte indexing is on a char boundary.
    let prefix = secret.get(..PREFIX_LEN)?;
    Some((prefix, hash_secret(secret)))
}

/// Compares a stored hash with a presented one in constant time (for equal lengths; a
/// stored hash of the wrong length never matches).
pub fn verify(record_hash: &[u8], presented_hash: &[u8; 32]) -> bool {
    record_hash.ct_eq(presented_hash.as_slice()).into()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::key_secret::generate;

    #[test]
    fn parse_bearer_accepts_generated_keys() {
        for _ in 0..100 {
            let key = generate();
            let (prefix, hash) = parse_bearer(key.secret.expose()).unwrap();
            assert_eq!(prefix, key.prefix);
            assert_eq!(hash, key.hash);
            assert!(verify(&key.hash, &hash));
        }
    }

    #[test]
    fn parse_bearer_rejects_junk() {
        let good = generate().secret.expose().to_owned();
        let body = &good[3..];
        let cases = [
            String::new(),
            "fg-".to_owned(),
            "sk-".to_owned() + body,
            "FG-".to_owned() + body,
            good[..good.len() - 1].to_owned(),
            good.clone() + "A",
            // right length, wrong alphabet
            format!("fg-{}", "+".repeat(43)),
            format!("fg-{}", "/".repeat(43)),
            format!("fg-{}=", &body[..42]),
            format!("fg-{} ", &body[..42]),
            // a multi-byte character that keeps the byte length at 46
            format!("fg-é{}", &body[..41]),
            // non-canonical: the last character carries 4 bits, its low 2 must be zero
            format!("fg-{}B", &"A".repeat(42)),
            "Bearer ".to_owned() + &good,
        ];
        for case in &cases {
            assert!(parse_bearer(case).is_none(), "accepted {case:?}");
        }
        assert!(parse_bearer(&format!("fg-{}A", "A".repeat(42))).is_some());
    }

    #[test]
    fn verify_is_exact() {
        let a = generate();
        let b = generate();
        assert!(verify(&a.hash, &a.hash));
        assert!(!verify(&a.hash, &b.hash));
        assert!(!verify(&a.hash[..31], &a.hash));
        assert!(!verify(&[], &a.hash));
        let mut flipped = a.hash;
        flipped[31] ^= 1;
        assert!(!verify(&flipped, &a.hash));
    }
}
