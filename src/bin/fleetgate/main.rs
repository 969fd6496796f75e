//! The `fleetgate` command: argument parsing only; the work is in the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use fleetgate::config::Config;
use fleetgate::key_limits::{Limit, LimitInput};
use fleetgate::keys::{LimitsChange, NewLimits};
use fleetgate::server;

mod cli;
mod demo;
mod jobs;
mod log;
mod operations;

/// mimalloc rather than glibc's malloc: a request makes many small allocations that
/// other threads free, and under load glibc's arenas spent about a tenth of the
/// gateway's CPU consolidating and unlinking chunks.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "fleetgate",
    version,
    about = "A strict, metering gateway in front of vLLM servers"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Run the gateway on embedded defaults, in front of a simulated vLLM, with a demo key.
    Demo {
        /// Address to serve on (`host:port`); pick another when 8080 is taken.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Where the demo's SQLite store (`demo.db`) is kept, apart from the store of
        /// `serve`.
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
    },
    /// Manage API keys.
    Keys {
        #[command(flatten)]
        config: ConfigArg,
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Recent requests from the request metadata log, newest first (never prompt or
    /// completion text: the log holds none).
    Log {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        selection: SelectionArgs,
        /// Only requests for this model (its `id` in the config).
        #[arg(long)]
        model: Option<String>,
        /// Only this status (`429`) or class of statuses (`4xx`, `5xx`).
        #[arg(long, value_parser = log::status_arg)]
        status: Option<fleetgate::store::StatusMatch>,
        /// How many requests to show at most.
        #[arg(long, default_value_t = 50, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=i64::from(log::MAX_LOG_ROWS)))]
        limit: u32,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Requests and tokens per UTC day, key and model, from the request log (the last
    /// 30 days unless --since says otherwise).
    Spend {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        selection: SelectionArgs,
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Completion jobs (any key's): list, show one, cancel. Metadata only, never a
    /// job's request or result.
    Jobs {
        #[command(flatten)]
        config: ConfigArg,
        #[command(subcommand)]
        command: JobsCommand,
    },
    /// Check the config file without starting anything: every problem at once, each
    /// with its line (or the variable that set it); exit status 1 when there is any.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Copy the SQLite store to a new file while the gateway serves (a consistent
    /// snapshot; restore by pointing `database_url` at the copy). PostgreSQL: pg_dump.
    Backup {
        #[command(flatten)]
        config: ConfigArg,
        /// The file to write; it must not exist, unless --force.
        dest: PathBuf,
        /// Replace DEST if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Print the OpenAPI document.
    Openapi,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Check a config file (`--config`, as `serve` reads it, `FLEETGATE_*` overrides
    /// included) and print a summary of what it sets up.
    Check {
        #[command(flatten)]
        config: ConfigArg,
    },
}

#[derive(Subcommand)]
enum JobsCommand {
    /// The newest jobs first.
    List {
        /// Only this key's jobs: its id or prefix.
        #[arg(long, value_name = "ID_OR_PREFIX")]
        key: Option<String>,
        /// Only jobs with this status (queued, running, succeeded, failed, expired,
        /// cancelled).
        #[arg(long, value_parser = jobs::status_arg)]
        status: Option<fleetgate::store::JobStatus>,
        /// How many jobs to show at most.
        #[arg(long, default_value_t = 50, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=i64::from(jobs::MAX_LIST)))]
        limit: u32,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// One job's metadata, as JSON.
    Show {
        /// The job's id (`job_…`).
        id: String,
    },
    /// Cancel a job: a queued one never runs; a running one is stopped upstream.
    Cancel {
        /// The job's id (`job_…`).
        id: String,
    },
}

/// The selection flags of `log` and `spend`.
#[derive(clap::Args)]
struct SelectionArgs {
    /// Only this key's requests: its id or prefix.
    #[arg(long, value_name = "ID_OR_PREFIX")]
    key: Option<String>,
    /// From this time on: a time ago (`90s`, `15m`, `2h`, `7d`), a UTC day
    /// (`2026-12-01`) or a UTC time (`2026-12-01T10:30:00Z`).
    #[arg(long, value_name = "TIME")]
    since: Option<String>,
    /// Before this time (same forms as --since).
    #[arg(long, value_name = "TIME")]
    until: Option<String>,
}

impl SelectionArgs {
    /// The selection, its times read against now; `default_since` when --since is not
    /// given.
    fn read(&self, default_since: Option<&str>) -> anyhow::Result<log::Selection<'_>> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let time = |flag: &str, value: Option<&str>| {
            value
                .map(|v| log::time_arg(v, now_ms).map_err(|e| anyhow::anyhow!("{flag}: {e}")))
                .transpose()
        };
        let since_ms = time("--since", self.since.as_deref().or(default_since))?;
        let until_ms = time("--until", self.until.as_deref())?;
        log::check_range(since_ms, until_ms)?;
        Ok(log::Selection {
            key: self.key.as_deref(),
            since_ms,
            until_ms,
        })
    }
}

#[derive(clap::Args)]
struct ConfigArg {
    /// The TOML configuration file.
    #[arg(
        long = "config",
        env = "FLEETGATE_CONFIG",
        default_value = "config/fleetgate.toml",
        global = true
    )]
    path: PathBuf,
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Create a key; its secret is printed once, alone on the last line (or as JSON).
    /// Limits not given are the configured defaults (`[limits]`).
    Create {
        /// A name for the key (who or what uses it), shown in listings and logs.
        #[arg(long)]
        name: String,
        /// Its owner's email address, for the records.
        #[arg(long)]
        email: Option<String>,
        #[command(flatten)]
        limits: CreateLimits,
        /// When the key stops working: how long from now (`90d`, `12h`), an RFC 3339
        /// time (`2027-01-01T00:00:00Z`) or a UTC day (`2027-01-01`). Default: never.
        #[arg(long, value_name = "WHEN", value_parser = cli::expiry_arg)]
        expires: Option<i64>,
        /// Print the key (secret included) as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Give a key a new secret, printed once, alone on the last line (or as JSON): same
    /// id, prefix, limits, usage, budget, expiry, jobs and saved work. The secret it
    /// replaces keeps working for the grace period, then only the new one does.
    /// Rotating again during a grace keeps only the secret that rotation replaces.
    Rotate {
        /// The key's id or prefix.
        id_or_prefix: String,
        /// How long the replaced secret keeps working (`90s`, `15m`, `2h`, `7d`; at most
        /// 30d); `0` stops it at once.
        #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = cli::grace_arg)]
        grace: u64,
        /// Print the key (new secret included) as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their secrets) with their effective limits.
    List {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id or prefix; it stops working at once.
    Revoke {
        /// The key's id, or its prefix (the secret's first characters, as listed).
        id_or_prefix: String,
    },
    /// Change a key's own limits (`default` returns one to the configured default) or
    /// its expiry, then print its effective limits and expiry. A running server applies
    /// them to new requests.
    Set {
        /// The key's id or prefix.
        id_or_prefix: String,
        #[command(flatten)]
        limits: SetLimits,
    },
    /// This month's (UTC) used tokens, effective limits and remaining budget of a key.
    ///
    /// Used tokens are those of finished requests, read from the usage ledger. Tokens
    /// reserved by requests still running are only visible to the running server and
    /// are not included.
    Usage {
        /// The key's id or prefix.
        id_or_prefix: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// The limit flags of `keys create`. The bounds are the key service's
/// ([`fleetgate::key_limits::Limit`]); `cli::limit_arg` checks each value against them.
/// Each allows negative numbers: else clap would take `--max-queued -1`'s `-1` for a flag
/// and say only `unexpected argument`, where the check says what the value must be.
#[derive(clap::Args)]
struct CreateLimits {
    /// Prompt + completion tokens per calendar month (UTC).
    #[arg(long, value_name = "TOKENS", allow_negative_numbers = true, value_parser = cli::limit_arg(Limit::MonthlyBudget))]
    monthly_budget: Option<LimitInput>,
    /// Request starts per minute (at least 1).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = cli::limit_arg(Limit::RequestsPerMinute))]
    rpm: Option<LimitInput>,
    /// Requests running at once (at least 1).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = cli::limit_arg(Limit::MaxConcurrent))]
    max_concurrent: Option<LimitInput>,
    /// Requests waiting beyond the running ones (0 or more).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = cli::limit_arg(Limit::MaxQueued))]
    max_queued: Option<LimitInput>,
    /// The key's weight in its models' fleet queues (1 to 1000): while a model's nodes
    /// are all busy, keys with work waiting get node slots in proportion to their share,
    /// counted in tokens.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = cli::limit_arg(Limit::Share))]
    share: Option<LimitInput>,
}

/// The limit flags of `keys set`: at least one; each a value or `default` (negative
/// numbers allowed, as for `keys create`, to reach the check).
#[derive(clap::Args)]
#[group(required = true, multiple = true)]
struct SetLimits {
    /// Prompt + completion tokens per calendar month (UTC), or `default`.
    #[arg(long, value_name = "TOKENS|default", allow_negative_numbers = true, value_parser = cli::limit_setting(Limit::MonthlyBudget))]
    monthly_budget: Option<cli::Setting<LimitInput>>,
    /// Request starts per minute (at least 1), or `default`.
    #[arg(long, value_name = "N|default", allow_negative_numbers = true, value_parser = cli::limit_setting(Limit::RequestsPerMinute))]
    rpm: Option<cli::Setting<LimitInput>>,
    /// Requests running at once (at least 1), or `default`.
    #[arg(long, value_name = "N|default", allow_negative_numbers = true, value_parser = cli::limit_setting(Limit::MaxConcurrent))]
    max_concurrent: Option<cli::Setting<LimitInput>>,
    /// Requests waiting beyond the running ones (0 or more), or `default`.
    #[arg(long, value_name = "N|default", allow_negative_numbers = true, value_parser = cli::limit_setting(Limit::MaxQueued))]
    max_queued: Option<cli::Setting<LimitInput>>,
    /// The key's weight in its models' fleet queues (1 to 1000), or `default`.
    #[arg(long, value_name = "N|default", allow_negative_numbers = true, value_parser = cli::limit_setting(Limit::Share))]
    share: Option<cli::Setting<LimitInput>>,
    /// When the key stops working (as for `keys create`: `90d`, an RFC 3339 time, a UTC
    /// day; a time already past refuses the key from now on), or `never`.
    #[arg(long, value_name = "WHEN|never", value_parser = cli::expiry_setting)]
    expires: Option<cli::Setting<i64>>,
}

impl CreateLimits {
    fn limits(self) -> NewLimits {
        NewLimits {
            monthly_budget: self.monthly_budget,
            requests_per_minute: self.rpm,
            max_concurrent: self.max_concurrent,
            max_queued: self.max_queued,
            share: self.share,
        }
    }
}

impl SetLimits {
    fn change(self) -> LimitsChange {
        LimitsChange {
            monthly_budget: self.monthly_budget.map(cli::Setting::into_option),
            requests_per_minute: self.rpm.map(cli::Setting::into_option),
            max_concurrent: self.max_concurrent.map(cli::Setting::into_option),
            max_queued: self.max_queued.map(cli::Setting::into_option),
            share: self.share.map(cli::Setting::into_option),
        }
    }
}

impl ConfigArg {
    fn load(&self) -> anyhow::Result<Config> {
        Config::load(&self.path).with_context(|| format!("loading {}", self.path.display()))
    }
}

/// Errors are printed as one line, their causes joined by `: ` — never with a
/// backtrace, whatever `RUST_BACKTRACE` says: they are the user's to act on, not a bug.
#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Serve { config: arg } => {
            let config = arg.load()?;
            let _log = server::init_logging(config.log_format, &config.traces)?;
            let setting = format!("`listen` in {}", arg.path.display());
            let listener = server::bind(config.listen, &setting).await?;
            let address = listener.local_addr()?;
            let state = server::prepare(config).await?;
            // Only now: a store that cannot be opened fails start-up before this line.
            tracing::info!(%address, "fleetgate listening");
            server::serve(state, listener, server::shutdown_signal()).await
        }
        Command::Demo { listen, data_dir } => demo::run(listen, &data_dir).await,
        Command::Keys { config, command } => {
            let config = config.load()?;
            let store = fleetgate::store::connect(&config.database_url).await?;
            let (store, defaults) = (store.as_ref(), &config.limits);
            let out = match command {
                KeysCommand::Create {
                    name,
                    email,
                    limits,
                    expires,
                    json,
                } => {
                    let new = cli::NewKey {
                        name: &name,
                        email: email.as_deref(),
                        limits: limits.limits(),
                        expires_at: expires,
                    };
                    cli::create_key(store, defaults, &new, json).await?
                }
                KeysCommand::Rotate {
                    id_or_prefix,
                    grace,
                    json,
                } => cli::rotate_key(store, defaults, &id_or_prefix, grace, json).await?,
                KeysCommand::List { json } => cli::list_keys(store, defaults, json).await?,
                KeysCommand::Revoke { id_or_prefix } => {
                    cli::revoke_key(store, defaults, &id_or_prefix).await?
                }
                KeysCommand::Set {
                    id_or_prefix,
                    limits,
                } => {
                    let expires = limits.expires.map(cli::Setting::into_option);
                    let change = limits.change();
                    cli::set_limits(store, defaults, &id_or_prefix, &change, expires).await?
                }
                KeysCommand::Usage { id_or_prefix, json } => {
                    cli::key_usage(store, defaults, &id_or_prefix, json).await?
                }
            };
            println!("{out}");
            Ok(())
        }
        Command::Log {
            config,
            selection,
            model,
            status,
            limit,
            json,
        } => {
            let selection = selection.read(None)?;
            let config = config.load()?;
            let store = fleetgate::store::connect(&config.database_url).await?;
            let out = log::log(
                store.as_ref(),
                &config.limits,
                &selection,
                model,
                status,
                limit,
                json,
            )
            .await?;
            // JSON lines: no line at all when nothing matches.
            if !out.is_empty() {
                println!("{out}");
            }
            Ok(())
        }
        Command::Spend {
            config,
            selection,
            json,
        } => {
            let selection = selection.read(Some("30d"))?;
            let config = config.load()?;
            let store = fleetgate::store::connect(&config.database_url).await?;
            println!(
                "{}",
                log::spend(store.as_ref(), &config.limits, &selection, json).await?
            );
            Ok(())
        }
        Command::Jobs { config, command } => {
            let config = config.load()?;
            let store = fleetgate::store::connect(&config.database_url).await?;
            let store = store.as_ref();
            let out = match command {
                JobsCommand::List {
                    key,
                    status,
                    limit,
                    json,
                } => jobs::list(store, &config.limits, key.as_deref(), status, limit, json).await?,
                JobsCommand::Show { id } => jobs::show(store, &id).await?,
                JobsCommand::Cancel { id } => jobs::cancel(store, &id).await?,
            };
            if !out.is_empty() {
                println!("{out}");
            }
            Ok(())
        }
        Command::Config {
            command: ConfigCommand::Check { config },
        } => {
            println!("{}", operations::check(&config.path)?);
            Ok(())
        }
        Command::Backup {
            config,
            dest,
            force,
        } => {
            let config = config.load()?;
            let backup = fleetgate::store::backup(&config.database_url, &dest, force).await?;
            println!("{}", operations::said(&backup));
            Ok(())
        }
        Command::Openapi => {
            println!(
                "{}",
                fleetgate::http::router::openapi_document().to_pretty_json()?
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    /// Every flag and argument of every subcommand says what it is in `--help`.
    #[test]
    fn every_argument_has_help_text() {
        fn check(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in command.get_arguments() {
                let builtin = matches!(arg.get_id().as_str(), "help" | "version");
                if !builtin && arg.get_help().is_none() {
                    missing.push(format!("{path} {}", arg.get_id()));
                }
            }
            for sub in command.get_subcommands() {
                check(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        check(&Args::command(), "fleetgate", &mut missing);
        assert!(missing.is_empty(), "without help text: {missing:?}");
    }
}
