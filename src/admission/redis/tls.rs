//! The TLS setup of the Redis connections (`redis_tls`): a server's certificate is
//! checked against the platform's roots (which honour `SSL_CERT_FILE` and
//! `SSL_CERT_DIR`, as in other rustls programs) plus `ca_file`; `cert_file` and
//! `key_file` are presented to a server that asks for a client certificate. Read once,
//! at start-up: an unreadable or invalid file stops the start, named.

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::RedisTlsSettings;

/// The rustls client setup `settings` describe.
pub(super) fn client_config(settings: &RedisTlsSettings) -> Result<rustls::ClientConfig, String> {
    let roots = trusted_roots(settings.ca_file.as_deref())?;
    // The provider named, not the process default: the build has only this one, and a
    // library must not install a default for the whole program.
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS setup: {e}"))?
    .with_root_certificates(roots);
    match (&settings.cert_file, &settings.key_file) {
        (None, None) => Ok(builder.with_no_client_auth()),
        (Some(cert), Some(key)) => {
            let chain = certificates(cert, "redis_tls.cert_file")?;
            let key = private_key(key)?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                format!("redis_tls.cert_file and redis_tls.key_file do not make a client certificate: {e}")
            })
        }
        (Some(_), None) => Err("redis_tls.cert_file is set without redis_tls.key_file".to_owned()),
        (None, Some(_)) => Err("redis_tls.key_file is set without redis_tls.cert_file".to_owned()),
    }
}

/// The platform's roots and those of `ca_file`.
fn trusted_roots(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    let platform = rustls_native_certs::load_native_certs();
    // A certificate of the platform's that rustls cannot use is skipped, as other
    // rustls programs do; one that cannot be read at all is said, but does not stop the
    // start when there are other roots to trust.
    roots.add_parsable_certificates(platform.certs);
    for error in &platform.errors {
        tracing::warn!(%error, "redis_tls: cannot read some of the platform's CA certificates");
    }
    if let Some(ca_file) = ca_file {
        for certificate in certificates(ca_file, "redis_tls.ca_file")? {
            roots.add(certificate).map_err(|e| {
                format!(
                    "redis_tls.ca_file {}: not a CA certificate: {e}",
                    ca_file.display()
                )
            })?;
        }
    }
    if roots.is_empty() {
        return Err(
            "no CA certificate to check Redis's certificate with: the platform has none (or \
             SSL_CERT_FILE names none); name one with redis_tls.ca_file"
                .to_owned(),
        );
    }
    Ok(roots)
}

/// The certificates of a PEM file, at least one.
fn certificates(path: &Path, setting: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(path, setting)?;
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{setting} {}: not a PEM file: {e}", path.display()))?;
    if certificates.is_empty() {
        return Err(format!(
            "{setting} {}: no certificate in it (a PEM file, `-----BEGIN CERTIFICATE-----`)",
            path.display()
        ));
    }
    Ok(certificates)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let pem = read(path, "redis_tls.key_file")?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        format!(
            "redis_tls.key_file {}: no private key in it (a PEM file, `-----BEGIN PRIVATE KEY-----`): {e}",
            path.display()
        )
    })
}

fn read(path: &Path, setting: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{setting} {}: cannot read it: {e}", path.display()))
}
