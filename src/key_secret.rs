//! Key secrets: their format, generation and hashing, what the store keeps of a new key
//! ([`NewKey`]), and a presented bearer token checked against a stored hash
//! ([`parse_bearer`], [`verify`]).
//!
//! A key's secret is `fg-` followed by the unpadded base64url encoding of 32 random
//! bytes: 46 ASCII characters in all. Its first [`PREFIX_LEN`] characters are the
//! *prefix*, stored in the clear and safe to show in support tools and logs; it is also
//! what the store looks a presented key up by. The secret itself is never stored: only
//! its SHA-256 hash is.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore as _;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

/// What every secret starts with.
pub const SECRET_PREFIX: &str = "fg-";
/// Random bytes in a secret.
pub const SECRET_RANDOM_BYTES: usize = 32;
/// Length of the base64url (no padding) encoding of [`SECRET_RANDOM_BYTES`] bytes.
const SECRET_ENCODED_LEN: usize = (SECRET_RANDOM_BYTES * 4).div_ceil(3);
/// Total length of a secret.
pub const SECRET_LEN: usize = SECRET_PREFIX.len() + SECRET_ENCODED_LEN;
/// Length of the visible prefix (`fg-` and 9 characters of the random part).
pub const PREFIX_LEN: usize = 12;

/// A key's secret. `Debug` and `Display` show only the prefix; call [`Secret::expose`]
/// to get the full value (to hand it to the key's owner, once).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The full secret. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The visible prefix of this secret.
    pub fn prefix(&self) -> &str {
        self.0.get(..PREFIX_LEN).unwrap_or(&self.0)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({}…)", self.prefix())
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}…", self.prefix())
    }
}

/// A freshly generated key: the secret to give out once, and what the store keeps.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub secret: Secret,
    pub prefix: String,
    pub hash: [u8; 32],
}

/// Generates a new key from the thread-local CSPRNG (ChaCha, seeded and periodically
/// reseeded from the OS).
pub fn generate() -> NewKey {
    let mut bytes = [0u8; SECRET_RANDOM_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    let mut secret = String::with_capacity(SECRET_LEN);
    secret.push_str(SECRET_PREFIX);
    URL_SAFE_NO_PAD.encode_string(bytes, &mut secret);
    let secret = Secret(secret);
    NewKey {
        prefix: secret.prefix().to_owned(),
        hash: hash_secret(secret.expose()),
        secret,
    }
}

/// A new secret for a key being rotated: its prefix is kept (so the key keeps the name
/// its logs, jobs and commands know it by) and the rest is fresh from the CSPRNG. The
/// prefix is shown openly anyway, so what makes the secret secret is the rest: 34
/// fresh characters, 202 random bits, as in any key [`generate`] makes. `None` when
/// `prefix` is not shaped like one of ours.
pub fn generate_for_prefix(prefix: &str) -> Option<NewKey> {
    let fresh = generate();
    let rest = fresh.secret.expose().get(PREFIX_LEN..)?;
    let secret = format!("{prefix}{rest}");
    // Base64url characters each stand for 6 bits of their own, so any prefix of the
    // alphabet's characters keeps the encoding canonical; the parse checks that it is.
    let (_, hash) = parse_bearer(&secret)?;
    Some(NewKey {
        secret: Secret(secret),
        prefix: prefix.to_owned(),
        hash,
    })
}

/// SHA-256 of the secret.
///
/// A fast, unsalted hash is the right tool here, unlike for passwords: the secret
/// carries 256 bits of CSPRNG entropy, so there is nothing to brute-force or look up
/// in a precomputed table, and a slow KDF would only cost time on every request.
pub fn hash_secret(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

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

    #[test]
    fn generated_key_is_well_formed() {
        let key = generate();
        let s = key.secret.expose();
        assert_eq!(s.len(), SECRET_LEN);
        assert_eq!(SECRET_LEN, 46);
        assert!(s.starts_with("fg-"));
        assert!(
            s[3..]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
        assert_eq!(key.prefix.len(), PREFIX_LEN);
        assert_eq!(key.prefix, &s[..PREFIX_LEN]);
        assert_eq!(key.hash, hash_secret(s));
    }

    #[test]
    fn generated_keys_differ() {
        let keys: std::collections::HashSet<String> = (0..1000)
            .map(|_| generate().secret.expose().to_owned())
            .collect();
        assert_eq!(keys.len(), 1000);
    }

    #[test]
    fn secret_is_redacted() {
        let key = generate();
        let s = key.secret.expose();
        let shown = [
            format!("{:?}", key.secret),
            format!("{}", key.secret),
            format!("{key:?}"),
        ];
        for text in shown {
            assert!(!text.contains(s), "{text}");
            assert!(text.contains(&key.prefix), "{text}");
        }
        assert_eq!(key.secret.to_string(), format!("{}…", key.prefix));
    }

    #[test]
    fn hash_is_sha256() {
        // SHA-256("abc")
        assert_eq!(
            hash_secret("abc"),
            [
                0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae,
                0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61,
                0xf2, 0x00, 0x15, 0xad
            ]
        );
    }

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
    fn a_rotated_secret_keeps_the_prefix_and_nothing_else() {
        let first = generate();
        let second = generate_for_prefix(&first.prefix).unwrap();
        assert_eq!(second.prefix, first.prefix);
        assert!(second.secret.expose().starts_with(&first.prefix));
        assert_ne!(second.secret, first.secret);
        assert_eq!(
            parse_bearer(second.secret.expose()),
            Some((first.prefix.as_str(), second.hash))
        );
        assert!(!verify(&first.hash, &second.hash));
        for bad in ["", "fg-", "fg-AAAAAAAAAA", "sk-AAAAAAAAA", "fg-AAAA+AAAA"] {
            assert!(generate_for_prefix(bad).is_none(), "{bad:?}");
        }
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
