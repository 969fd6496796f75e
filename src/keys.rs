//! API keys: generation, hashing and verification.
