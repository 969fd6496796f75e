//! Loading: serde's defaults, then one TOML file, then `FLEETGATE_*` environment
//! variables (figment), then validation (`validate.rs`). A relative SQLite path in the
//! file, and a relative `[tls]` or `redis_tls` file, is made relative to the file's
//! directory. Every problem is said at once (not only the first), each with where its
//! key was set: the file's line, or the variable.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};

use super::extract::extract;
use super::locate::{ENV_NOT_CONFIG, ENV_PREFIX, Origin, Places};
use super::schema::Config;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{0}")]
    Unreadable(String),
    /// Every problem found, in the file's order, said on one line.
    #[error("{}", said(.0))]
    Invalid(Vec<Problem>),
}

impl ConfigError {
    /// The problems found (none when the file could not be read).
    pub fn problems(&self) -> &[Problem] {
        match self {
            Self::Unreadable(_) => &[],
            Self::Invalid(problems) => problems,
        }
    }
}

/// One problem of a config: where its key was set, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub origin: Origin,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.origin {
            Origin::Line { line, .. } => write!(f, "line {line}: {}", self.message),
            Origin::Env(name) => write!(f, "{name}: {}", self.message),
            Origin::Unplaced => f.write_str(&self.message),
        }
    }
}

fn said(problems: &[Problem]) -> String {
    let said: Vec<String> = problems.iter().map(Problem::to_string).collect();
    said.join("; ")
}

impl Config {
    /// Loads `path` (TOML) with `FLEETGATE_*` overrides, then validates.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| {
            ConfigError::Unreadable(match err.kind() {
                std::io::ErrorKind::NotFound => {
                    "no such file (name another with --config or FLEETGATE_CONFIG)".to_owned()
                }
                _ => err.to_string(),
            })
        })?;
        let mut config = Self::from_toml(&text)?;
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
        let places = Places::new(toml)
            .map_err(|(origin, message)| ConfigError::Invalid(vec![Problem { origin, message }]))?;
        let env = Env::prefixed(ENV_PREFIX).split("__").filter(|key| {
            !ENV_NOT_CONFIG
                .iter()
                .any(|k| key.as_str().eq_ignore_ascii_case(k))
        });
        let extracted = extract(&Figment::new().merge(Toml::string(toml)).merge(env));
        let mut problems: Vec<Problem> = extracted
            .misfits
            .into_iter()
            .map(|misfit| Problem {
                origin: places.of(&misfit.key),
                message: misfit.message,
            })
            .collect();
        if let Some(config) = &extracted.config {
            // A rule about a value that was not read (so its default or a stand-in is
            // there) is not the user's: its key's problem is said already.
            let broken = config.broken_rules().into_iter().filter_map(|broken| {
                let key: Vec<String> = broken.key.split('.').map(str::to_owned).collect();
                let repaired = extracted.repaired.iter().any(|at| key.starts_with(at));
                (!repaired).then(|| Problem {
                    origin: places.of(&key),
                    message: broken.message,
                })
            });
            problems.extend(broken);
        }
        // In the file's order, then the variables', then the rest.
        problems.sort_by_key(|problem| match &problem.origin {
            Origin::Line { line, column } => (0, *line, *column),
            Origin::Env(_) => (1, 0, 0),
            Origin::Unplaced => (2, 0, 0),
        });
        match extracted.config {
            Some(config) if problems.is_empty() => Ok(config),
            _ if problems.is_empty() => Err(ConfigError::Invalid(vec![Problem {
                origin: Origin::Unplaced,
                message: "the configuration could not be read".to_owned(),
            }])),
            _ => Err(ConfigError::Invalid(problems)),
        }
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
            refused.starts_with("line 2: in [traces]: unknown key `endpoint`"),
            "{refused}"
        );
    }

    /// The lines of `document`'s problems, with what each says.
    fn problems(document: &str) -> Vec<(Origin, String)> {
        let refused = Config::from_toml(document).map(|_| ()).unwrap_err();
        refused
            .problems()
            .iter()
            .map(|p| (p.origin.clone(), p.message.clone()))
            .collect()
    }

    fn line(line: usize, column: usize) -> Origin {
        Origin::Line { line, column }
    }

    #[test]
    fn every_problem_is_said_with_its_line() {
        let document = "listen = 8080\n\
            redis_url = \"rediss//cache:6380\"\n\
            [limits]\n\
            rpm = 3\n\
            share = 0\n\
            [fleet]\n\
            prefix_bytes = 100\n\
            routing = \"random\"\n\
            [[models]]\n\
            id = \"a\"\n\
            [[models.upstreams]]\n\
            url = \"http://127.0.0.1:1\"\n\
            gpu = \"g\"\n\
            [[models]]\n\
            id = \"b\"\n\
            default = true\n\
            [[models.upstreams]]\n\
            url = \"http://127.0.0.1:2\"\n\
            [[models.upstreams]]\n\
            gpu = \"g\"\n  url =    \"ftp://127.0.0.1:3\"\n";
        let problems = problems(document);
        let lines: Vec<&Origin> = problems.iter().map(|(origin, _)| origin).collect();
        assert_eq!(
            lines,
            [1, 2, 4, 5, 7, 8, 17, 21]
                .map(|n| line(n, 1 + 2 * usize::from(n == 21)))
                .iter()
                .collect::<Vec<_>>(),
            "{problems:#?}"
        );
        let said: Vec<&str> = problems.iter().map(|(_, said)| said.as_str()).collect();
        for (said, expected) in said.iter().zip([
            "listen: invalid type",
            "redis_url must start with redis://, rediss:// (TLS), unix:// or redis+unix:// (got no scheme)",
            "in [limits]: unknown key `rpm`",
            "limits.share must be between 1 and 1000 (got 0)",
            "fleet.prefix_bytes must be between",
            "fleet.routing: unknown value `random`",
            "in [models[1].upstreams[0]]: missing key `gpu`",
            "models.upstreams.url of 'b' must be an http(s) URL",
        ]) {
            assert!(said.starts_with(expected), "{said}");
        }
    }

    #[test]
    fn a_syntax_error_is_said_alone_with_its_line() {
        let problems = problems("[limits]\nshare = 1\n[[models]\nid = \"m\"\n");
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].0, line(3, 9));
        assert!(problems[0].1.starts_with("TOML syntax: "), "{problems:?}");
    }

    /// A wrong element of an array is stood in for, not removed: the problems of the
    /// elements after it keep their own indices and lines.
    #[test]
    fn a_wrong_array_element_keeps_the_next_ones_in_place() {
        let problems = problems(
            "[[models]]\nid = \"a\"\nupstreams = [\"http://127.0.0.1:1\"]\n\
             [[models]]\nid = \"b\"\ndefault = true\n\
             [[models.upstreams]]\nurl = \"http://127.0.0.1:2\"\ngpu = \"g\"\n\
             [[models.upstreams]]\nurl = \"127.0.0.1:3\"\ngpu = \"g\"\n",
        );
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert_eq!(problems[0].0, line(3, 14), "the element itself");
        assert!(
            problems[0]
                .1
                .starts_with("models[0].upstreams[0]: invalid type"),
            "{problems:?}"
        );
        assert_eq!(problems[1].0, line(11, 1));
        assert!(
            problems[1].1.starts_with("models.upstreams.url of 'b'"),
            "{problems:?}"
        );
    }

    #[test]
    fn a_missing_section_is_said_without_a_line() {
        let problems = problems("listen = \"127.0.0.1:0\"\n");
        assert_eq!(
            problems,
            [(Origin::Unplaced, "missing key `models`".to_owned())]
        );
    }
}
