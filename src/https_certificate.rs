//! The certificate the HTTPS listener serves (`[tls]`): read from its PEM files at
//! start-up, and again on every reload (SIGHUP or `POST /admin/reload`), so that a
//! renewed certificate is served without a restart.
//!
//! rustls asks [`ServedCertificate`] for the certificate at each handshake; a reload
//! swaps it in one atomic step, so each new connection gets the old one or the new one,
//! whole, and a connection already open is not touched (its handshake is over). A
//! reload whose files cannot be read, do not parse, or whose key is not the
//! certificate's keeps the certificate served and says which file and why.
//!
//! What is logged of a certificate is public: its SHA-256 fingerprint (as `openssl x509
//! -noout -fingerprint -sha256` prints it) and when it expires; never the key.

mod validity;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::{self, PemObject as _};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest as _, Sha256};

use crate::config::TlsSettings;

/// Why the certificate files could not be used; each names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum CertificateError {
    #[error("cannot read the {what} file {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the {what} file {} is not valid PEM: {detail}", path.display())]
    Pem {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error("the certificate file {} holds no certificate (a PEM `CERTIFICATE` block)", .0.display())]
    NoCertificate(PathBuf),
    #[error("the key file {} holds no private key (a PEM `PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY` block)", .0.display())]
    NoKey(PathBuf),
    #[error("the key file {} holds a private key that cannot be used: {source}", path.display())]
    UnusableKey {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the key in {} is not the key of the certificate in {}", key.display(), cert.display())]
    Mismatch { cert: PathBuf, key: PathBuf },
}

/// The certificate served now, and the files it is read from.
pub struct ServedCertificate {
    files: TlsSettings,
    provider: Arc<CryptoProvider>,
    served: ArcSwap<CertifiedKey>,
}

impl fmt::Debug for ServedCertificate {
    // rustls wants its resolvers `Debug`; the key is not shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServedCertificate")
            .field("cert_file", &self.files.cert_file)
            .field("key_file", &self.files.key_file)
            .finish_non_exhaustive()
    }
}

impl ServedCertificate {
    /// Reads the files of `files`; an error names the file at fault.
    pub fn load(files: &TlsSettings) -> Result<Self, CertificateError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let served = read(files, &provider)?;
        Ok(Self {
            files: files.clone(),
            provider,
            served: ArcSwap::from_pointee(served),
        })
    }

    /// Reads the files again and serves what they hold to the connections that open
    /// from now on; on an error the certificate served stays.
    pub fn reload(&self) -> Result<(), CertificateError> {
        let next = read(&self.files, &self.provider)?;
        self.served.store(Arc::new(next));
        Ok(())
    }

    /// What is served now, for the log: fingerprint and expiry.
    pub fn describe(&self) -> Described {
        Described::of(&self.served.load())
    }

    /// The TLS settings of the HTTPS listener: this certificate (as it is at each
    /// handshake), HTTP/2 and HTTP/1.1 offered by ALPN, TLS 1.2 and 1.3.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, rustls::Error> {
        let mut config = ServerConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Reads the files again (see [`Self::reload`]) and logs the outcome: the
    /// certificate now served, or the error and the one still served.
    pub fn reload_logged(&self) {
        match self.reload() {
            Ok(()) => tracing::info!(
                certificate = %self.describe(),
                "TLS certificate reloaded; new connections get it"
            ),
            Err(err) => tracing::error!(
                error = %err,
                certificate = %self.describe(),
                "TLS certificate not reloaded; the one served stays"
            ),
        }
    }
}

impl ResolvesServerCert for ServedCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.served.load_full())
    }
}

/// The chain and key of `files`, checked to belong together.
fn read(files: &TlsSettings, provider: &CryptoProvider) -> Result<CertifiedKey, CertificateError> {
    let (cert, key) = (&files.cert_file, &files.key_file);
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|items| items.collect::<Result<Vec<_>, _>>())
        .map_err(|err| pem_error("certificate", cert, err))?;
    if chain.is_empty() {
        return Err(CertificateError::NoCertificate(cert.clone()));
    }
    let private = match PrivateKeyDer::from_pem_file(key) {
        Ok(private) => private,
        Err(pem::Error::NoItemsFound) => return Err(CertificateError::NoKey(key.clone())),
        Err(err) => return Err(pem_error("key", key, err)),
    };
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|source| CertificateError::UnusableKey {
            path: key.clone(),
            source,
        })?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        Ok(()) => Ok(certified),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err(CertificateError::Mismatch {
                cert: cert.clone(),
                key: key.clone(),
            })
        }
        // A certificate rustls cannot parse: said as the certificate file's fault.
        Err(err) => Err(CertificateError::Pem {
            what: "certificate",
            path: cert.clone(),
            detail: err.to_string(),
        }),
    }
}

fn pem_error(what: &'static str, path: &Path, err: pem::Error) -> CertificateError {
    match err {
        pem::Error::Io(source) => CertificateError::Read {
            what,
            path: path.to_owned(),
            source,
        },
        other => CertificateError::Pem {
            what,
            path: path.to_owned(),
            detail: pem_problem(&other),
        },
    }
}

/// What is wrong with a PEM file, in words that quote none of it.
fn pem_problem(err: &pem::Error) -> String {
    match err {
        pem::Error::MissingSectionEnd { .. } => {
            "a block has no `-----END` line (is the file cut short?)".to_owned()
        }
        pem::Error::IllegalSectionStart { .. } => "a `-----BEGIN` line is malformed".to_owned(),
        pem::Error::Base64Decode(_) => "a block is not valid base64".to_owned(),
        pem::Error::NoItemsFound => "it holds no PEM block".to_owned(),
        other => other.to_string(),
    }
}

/// A certificate as the log says it: `sha256 AB:CD:…, expires 2027-03-01 12:00:00 UTC`.
pub struct Described {
    fingerprint: String,
    expires: Option<String>,
}

impl Described {
    fn of(certified: &CertifiedKey) -> Self {
        let leaf = certified.cert.first().map_or(&[][..], |c| c.as_ref());
        let fingerprint = Sha256::digest(leaf)
            .iter()
            .map(|byte| format!("{byte:02X}"))
            .collect::<Vec<_>>()
            .join(":");
        Self {
            fingerprint,
            expires: validity::not_after(leaf),
        }
    }
}

impl fmt::Display for Described {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256 {}", self.fingerprint)?;
        match &self.expires {
            Some(expires) => write!(f, ", expires {expires}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate for `name` and its key, as PEM.
    fn self_signed(name: &str) -> (String, String) {
        let made = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
        (made.cert.pem(), made.signing_key.serialize_pem())
    }

    fn files(dir: &Path, cert: &str, key: &str) -> TlsSettings {
        let (cert_file, key_file) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert_file, cert).unwrap();
        std::fs::write(&key_file, key).unwrap();
        TlsSettings {
            cert_file,
            key_file,
        }
    }

    #[test]
    fn a_reload_serves_the_new_files_and_a_bad_one_keeps_the_old() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed("old.test");
        let settings = files(dir.path(), &cert, &key);
        let served = ServedCertificate::load(&settings).unwrap();
        let old = served.describe().to_string();
        assert!(
            old.starts_with("sha256 ") && old.contains(", expires "),
            "{old}"
        );

        let (new_cert, new_key) = self_signed("new.test");
        files(dir.path(), &new_cert, &new_key);
        served.reload().unwrap();
        let new = served.describe().to_string();
        assert_ne!(new, old);

        // The next certificate with the old key: refused, the one served stays.
        let (other_cert, _) = self_signed("other.test");
        files(dir.path(), &other_cert, &new_key);
        let refused = served.reload().unwrap_err().to_string();
        assert!(
            refused.contains("key.pem") && refused.contains("is not the key of the certificate"),
            "{refused}"
        );
        assert_eq!(served.describe().to_string(), new);
    }

    #[test]
    fn each_bad_file_is_named_with_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed("a.test");
        let said = |cert: &str, key: &str| {
            ServedCertificate::load(&files(dir.path(), cert, key))
                .unwrap_err()
                .to_string()
        };
        let no_cert = said("not a certificate\n", &key);
        assert!(
            no_cert.contains("cert.pem holds no certificate"),
            "{no_cert}"
        );
        let no_key = said(&cert, &cert);
        assert!(no_key.contains("key.pem holds no private key"), "{no_key}");
        let torn = said(&cert[..cert.len() / 2], &key);
        assert!(
            torn.contains("cert.pem is not valid PEM: a block has no `-----END` line"),
            "{torn}"
        );
        let missing = ServedCertificate::load(&TlsSettings {
            cert_file: files(dir.path(), &cert, &key).cert_file,
            key_file: dir.path().join("absent.pem"),
        })
        .unwrap_err()
        .to_string();
        assert!(
            missing.starts_with("cannot read the key file") && missing.contains("absent.pem"),
            "{missing}"
        );
        // Nothing of the key is ever said.
        let body: String = key.lines().nth(1).unwrap().chars().take(20).collect();
        for said in [no_cert, no_key, torn, missing] {
            assert!(!said.contains(&body), "{said}");
        }
    }
}
