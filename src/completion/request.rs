//! Strict parsing of the /v1/completions request body.
