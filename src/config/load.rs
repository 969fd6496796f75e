//! Loading: serde's defaults, then one TOML file, then `FLEETGATE_*` environment
//! variables (figment), then validation (`validate.rs`). A relative SQLite path in the
//! file, and a relative `[tls]` or `redis_tls` file, is made relative to the file's
//! directory, and figment's errors are said once each, by key.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};

use super::schema::Config;

/// Environment variables that are read elsewhere and are not configuration keys.
const ENV_NOT_CONFIG: &[&str] = &["config"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Every problem figment found, one per `; `, each naming its key.
    #[error("{0}")]
    Load(String),
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// Loads `path` (TOML) with `FLEETGATE_*` overrides, then validates.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        if !path.exists() {
            return Err(ConfigError::Invalid(
                "no such file (name another with --config or FLEETGATE_CONFIG)".to_owned(),
            ));
        }
        let mut config = Self::from_figment(Figment::new().merge(Toml::file_exact(path)))?;
        let dir = path.parent().unwrap_or(Path::new(""));
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        config.database_url = sqlite_relative_to(&config.database_url, &dir);
        if let Some(tls) = &mut config.tls {
            tls.cert_file = dir.join(&tls.cert_file);
            tls.key_file = dir.join(&tls.key_file);
        }
        config.redis_tls.relative_to(&dir);
        config.source = Some(path.to_owned());
        Ok(config)
    }

    /// Parses a TOML document with `FLEETGATE_*` overrides, then validates.
    pub fn from_toml(toml: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::new().merge(Toml::string(toml)))
    }

    fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let env = Env::prefixed("FLEETGATE_").split("__").filter(|key| {
            !ENV_NOT_CONFIG
                .iter()
                .any(|k| key.as_str().eq_ignore_ascii_case(k))
        });
        let config: Config = figment
            .merge(env)
            .extract()
            .map_err(|e| ConfigError::Load(describe(e)))?;
        config.validate().map_err(ConfigError::Invalid)?;
        Ok(config)
    }
}

/// `url` with a relative SQLite file path made relative to `dir`; any other URL as it is.
fn sqlite_relative_to(url: &str, dir: &Path) -> String {
    let Some(rest) = url.strip_prefix("sqlite:") else {
        return url.to_owned();
    };
    let file = rest.strip_prefix("//").unwrap_or(rest);
    if file.is_empty() || file.starts_with(':') || Path::new(file).is_absolute() {
        return url.to_owned();
    }
    format!("sqlite://{}", dir.join(file).display())
}

/// figment's errors, said once each as `key: problem` — without its profile prefix
/// (`default.`), its doubled quoting of expected names, or the file name the caller
/// already gives; a value from the environment says so.
fn describe(errors: figment::Error) -> String {
    use figment::Source;
    use figment::error::Kind;
    let said: Vec<String> = errors
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let problem = match &e.kind {
                Kind::UnknownField(found, expected) => format!(
                    "unknown key `{found}`; expected one of: {}",
                    expected.join(", ")
                ),
                Kind::UnknownVariant(found, expected) => format!(
                    "unknown value `{found}`; expected one of: {}",
                    expected.join(", ")
                ),
                other => other.to_string(),
            };
            let origin = match e.metadata.as_ref() {
                Some(meta) if !matches!(meta.source, Some(Source::File(_))) => {
                    format!(" (from {})", meta.name)
                }
                _ => String::new(),
            };
            let at = match &e.kind {
                // The unknown key is named in the problem; say where it sits.
                Kind::UnknownField(..) if e.path.len() > 1 => {
                    format!("in [{}]: ", e.path[..e.path.len() - 1].join("."))
                }
                Kind::UnknownField(..) => String::new(),
                _ if key.is_empty() => String::new(),
                _ => format!("{key}: "),
            };
            format!("{at}{problem}{origin}")
        })
        .collect();
    said.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::tests::document;

    #[test]
    fn a_relative_sqlite_path_is_relative_to_the_config_directory() {
        let dir = Path::new("/etc/fleetgate");
        assert_eq!(
            sqlite_relative_to("sqlite://data/fleetgate.db", dir),
            "sqlite:///etc/fleetgate/data/fleetgate.db"
        );
        assert_eq!(
            sqlite_relative_to("sqlite:fg.db?mode=rwc", dir),
            "sqlite:///etc/fleetgate/fg.db?mode=rwc"
        );
        for kept in [
            "sqlite:///var/lib/fleetgate/fleetgate.db",
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://",
            "postgres://fg@db/fleetgate",
        ] {
            assert_eq!(sqlite_relative_to(kept, dir), kept);
        }
    }

    #[test]
    fn relative_redis_tls_files_are_relative_to_the_config_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleetgate.toml");
        let keys = "ca_file = \"tls/ca.pem\"\ncert_file = \"/etc/tls/client.pem\"";
        std::fs::write(&path, document("redis_tls", keys, "")).unwrap();
        let tls = Config::load(&path).unwrap().redis_tls;
        assert_eq!(tls.ca_file, Some(dir.path().join("tls/ca.pem")));
        assert_eq!(tls.cert_file, Some("/etc/tls/client.pem".into()));
        assert_eq!(tls.key_file, None);
    }

    #[test]
    fn an_unknown_key_is_named_with_its_section() {
        let document = document("traces", "endpoint = \"http://collector:4318\"", "");
        let refused = Config::from_toml(&document)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            refused.starts_with("in [traces]: unknown key `endpoint`"),
            "{refused}"
        );
    }
}
