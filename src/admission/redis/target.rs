//! Where the shared limiter's Redis is and how to reach it: the URL, read by the `redis`
//! crate's parser, and for a `rediss://` URL the TLS setup (`tls.rs`). Made before
//! anything connects, so a malformed URL or an unusable certificate file stops the start
//! at once; every connection to this Redis is then opened from it
//! (`wire::redis_stream`).

use std::sync::Arc;

use ::redis::{ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};
use rustls_pki_types::ServerName;
use tokio_rustls::TlsConnector;

use super::tls;
use crate::config::RedisTlsSettings;
use crate::wire::redis_stream::{self, Address};

/// The Redis URL or its TLS settings cannot be used (the only construction errors of
/// the limiter).
#[derive(Debug, thiserror::Error)]
pub enum InvalidRedisUrl {
    #[error("invalid Redis URL: {0}")]
    Url(String),
    #[error("{0}")]
    Tls(String),
}

/// A Redis server: its address (with TLS for `rediss://`), and the credentials and
/// database the URL names.
pub struct RedisTarget {
    pub(super) address: Address,
    pub(super) settings: RedisConnectionInfo,
}

impl RedisTarget {
    /// The server of `url`, reached with `tls` when the URL is `rediss://`.
    pub fn new(url: &str, tls: &RedisTlsSettings) -> Result<Self, InvalidRedisUrl> {
        let info = url
            .into_connection_info()
            .map_err(|e| InvalidRedisUrl::Url(e.to_string()))?;
        let plain_only = |address| {
            if tls.is_set() {
                return Err(InvalidRedisUrl::Tls(
                    "redis_tls is set, but redis_url is not a rediss:// URL".to_owned(),
                ));
            }
            Ok(address)
        };
        let address = match info.addr() {
            ConnectionAddr::Tcp(host, port) => plain_only(Address::Tcp {
                host: host.clone(),
                port: *port,
                tls: None,
            })?,
            ConnectionAddr::Unix(path) => plain_only(Address::Unix(path.clone()))?,
            ConnectionAddr::TcpTls {
                host,
                port,
                insecure,
                ..
            } => {
                if *insecure {
                    return Err(InvalidRedisUrl::Url(
                        "#insecure (no certificate check) is not supported; trust the \
                         server's CA with redis_tls.ca_file instead"
                            .to_owned(),
                    ));
                }
                Address::Tcp {
                    host: host.clone(),
                    port: *port,
                    tls: Some(secured(host, tls)?),
                }
            }
            _ => {
                return Err(InvalidRedisUrl::Url(
                    "an address fleetgate cannot connect to".to_owned(),
                ));
            }
        };
        Ok(Self {
            address,
            settings: info.redis_settings().clone(),
        })
    }
}

/// TLS to `host` as `settings` say: the name its certificate must carry is
/// `server_name`, else the host.
fn secured(host: &str, settings: &RedisTlsSettings) -> Result<redis_stream::Tls, InvalidRedisUrl> {
    let (name, setting) = match &settings.server_name {
        Some(name) => (name.as_str(), "redis_tls.server_name"),
        None => (host, "the Redis URL's host"),
    };
    let server_name = ServerName::try_from(name.to_owned()).map_err(|_| {
        InvalidRedisUrl::Tls(format!(
            "{setting} {name:?} is not a DNS name or an IP address a certificate can name"
        ))
    })?;
    let config = tls::client_config(settings).map_err(InvalidRedisUrl::Tls)?;
    Ok(redis_stream::Tls {
        connector: TlsConnector::from(Arc::new(config)),
        server_name,
    })
}
