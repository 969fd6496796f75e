//! The `fleetgate` command: argument parsing only; the work is in the library.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use fleetgate::config::Config;
use fleetgate::keys::{Limit, LimitInput, LimitsChange, NewLimits};
use fleetgate::server;

mod cli;
mod demo;

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
        /// Address to serve on.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Where the SQLite store is kept.
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
    /// Print the OpenAPI document.
    Openapi,
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
        #[arg(long)]
        name: String,
        #[arg(long)]
        email: Option<String>,
        #[command(flatten)]
        limits: CreateLimits,
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their secrets) with their effective limits.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id or prefix; it stops working at once.
    Revoke { id_or_prefix: String },
    /// Change a key's own limits (`default` returns one to the configured default), then
    /// print its effective limits. A running server applies them to new requests.
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
        #[arg(long)]
        json: bool,
    },
}

/// The limit flags of `keys create`. The bounds are the key service's
/// ([`fleetgate::keys::Limit`]); `cli::limit_arg` checks each value against them.
#[derive(clap::Args)]
struct CreateLimits {
    /// Prompt + completion tokens per calendar month (UTC).
    #[arg(long, value_name = "TOKENS", value_parser = cli::limit_arg(Limit::MonthlyBudget))]
    monthly_budget: Option<LimitInput>,
    /// Request starts per minute (at least 1).
    #[arg(long, value_name = "N", value_parser = cli::limit_arg(Limit::RequestsPerMinute))]
    rpm: Option<LimitInput>,
    /// Requests running at once (at least 1).
    #[arg(long, value_name = "N", value_parser = cli::limit_arg(Limit::MaxConcurrent))]
    max_concurrent: Option<LimitInput>,
    /// Requests waiting beyond the running ones (0 or more).
    #[arg(long, value_name = "N", value_parser = cli::limit_arg(Limit::MaxQueued))]
    max_queued: Option<LimitInput>,
}

/// The limit flags of `keys set`: at least one; each a value or `default`.
#[derive(clap::Args)]
#[group(required = true, multiple = true)]
struct SetLimits {
    /// Prompt + completion tokens per calendar month (UTC), or `default`.
    #[arg(long, value_name = "TOKENS|default", value_parser = cli::limit_setting(Limit::MonthlyBudget))]
    monthly_budget: Option<cli::Setting<LimitInput>>,
    /// Request starts per minute (at least 1), or `default`.
    #[arg(long, value_name = "N|default", value_parser = cli::limit_setting(Limit::RequestsPerMinute))]
    rpm: Option<cli::Setting<LimitInput>>,
    /// Requests running at once (at least 1), or `default`.
    #[arg(long, value_name = "N|default", value_parser = cli::limit_setting(Limit::MaxConcurrent))]
    max_concurrent: Option<cli::Setting<LimitInput>>,
    /// Requests waiting beyond the running ones (0 or more), or `default`.
    #[arg(long, value_name = "N|default", value_parser = cli::limit_setting(Limit::MaxQueued))]
    max_queued: Option<cli::Setting<LimitInput>>,
}

impl CreateLimits {
    fn limits(self) -> NewLimits {
        NewLimits {
            monthly_budget: self.monthly_budget,
            requests_per_minute: self.rpm,
            max_concurrent: self.max_concurrent,
            max_queued: self.max_queued,
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
        }
    }
}

impl ConfigArg {
    fn load(&self) -> anyhow::Result<Config> {
        Config::load(&self.path).with_context(|| format!("loading {}", self.path.display()))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::Serve { config } => {
            let config = config.load()?;
            let _log = server::init_logging(config.log_format, &config.traces)?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("binding {}", config.listen))?;
            tracing::info!(address = %listener.local_addr()?, "fleetgate listening");
            let state = server::prepare(config).await?;
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
                    json,
                } => {
                    let limits = limits.limits();
                    cli::create_key(store, defaults, &name, email.as_deref(), &limits, json).await?
                }
                KeysCommand::List { json } => cli::list_keys(store, defaults, json).await?,
                KeysCommand::Revoke { id_or_prefix } => {
                    cli::revoke_key(store, defaults, &id_or_prefix).await?
                }
                KeysCommand::Set {
                    id_or_prefix,
                    limits,
                } => cli::set_limits(store, defaults, &id_or_prefix, &limits.change()).await?,
                KeysCommand::Usage { id_or_prefix, json } => {
                    cli::key_usage(store, defaults, &id_or_prefix, json).await?
                }
            };
            println!("{out}");
            Ok(())
        }
        Command::Openapi => {
            println!(
                "{}",
                fleetgate::router::openapi_document().to_pretty_json()?
            );
            Ok(())
        }
    }
}
