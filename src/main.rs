//! The `fleetgate` command: argument parsing only; the work is in the library.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use fleetgate::config::Config;
use fleetgate::{cli, demo, server};

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
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        email: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their secrets).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id or prefix; it stops working at once.
    Revoke { id_or_prefix: String },
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
            server::init_logging(config.log_format);
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("binding {}", config.listen))?;
            tracing::info!(address = %listener.local_addr()?, "fleetgate listening");
            let state = server::prepare(config).await?;
            server::serve(state, listener, server::shutdown_signal()).await
        }
        Command::Demo { listen, data_dir } => demo::run(listen, &data_dir).await,
        Command::Keys { config, command } => {
            let store = fleetgate::store::connect(&config.load()?.database_url).await?;
            let out = match command {
                KeysCommand::Create { name, email, json } => {
                    cli::create_key(store.as_ref(), &name, email.as_deref(), json).await?
                }
                KeysCommand::List { json } => cli::list_keys(store.as_ref(), json).await?,
                KeysCommand::Revoke { id_or_prefix } => {
                    cli::revoke_key(store.as_ref(), &id_or_prefix).await?
                }
            };
            println!("{out}");
            Ok(())
        }
        Command::Openapi => {
            println!("{}", fleetgate::openapi::document().to_pretty_json()?);
            Ok(())
        }
    }
}
