//! `fleetgate demo`: the gateway on its embedded defaults — an in-process simulated vLLM,
//! a SQLite store in a local data directory, and a fresh key — with a ready-to-paste
//! curl line and OpenAI SDK snippet. Nothing else needs to be installed.
//!
//! The demo's config is written beside its store (`demo.toml`), so the commands that
//! read a store (`keys`, `log`, `spend`, `jobs`) read the demo's with `--config
//! DATA_DIR/demo.toml`. Each run revokes the keys earlier runs made, so only the key it
//! prints is live.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use fleetgate::config::Config;
use fleetgate::server;
use fleetgate::store::Store;
use mock_vllm::{MockConfig, MockVllm};

pub const DEMO_MODEL: &str = "llama-8b";
const DEMO_CHECKPOINT: &str = "meta-llama/Llama-3.1-8B";

pub async fn run(listen: SocketAddr, data_dir: &Path) -> anyhow::Result<()> {
    let mock = MockVllm::start(MockConfig {
        served_model_name: DEMO_CHECKPOINT.to_owned(),
        token_delay: std::time::Duration::from_millis(15),
        ..MockConfig::default()
    })
    .await?;
    let config_path = write_config(data_dir, listen, &mock.url())?;
    let config =
        Config::load(&config_path).with_context(|| format!("loading {}", config_path.display()))?;
    let _log = server::init_logging(config.log_format, &config.traces)?;
    let listener = server::bind(config.listen, "--listen (e.g. --listen 127.0.0.1:8081)").await?;
    let address = listener.local_addr()?;
    let state = server::prepare(config).await?;
    let revoked = revoke_earlier_demo_keys(state.store()).await?;
    let key = fleetgate::key_secret::generate();
    state
        .store()
        .create_key(
            DEMO_KEY_NAME,
            None,
            &key,
            &fleetgate::store::LimitOverrides::default(),
        )
        .await?;
    println!(
        "{}",
        instructions(address, key.secret.expose(), &config_path, revoked)
    );
    server::serve(state, listener, server::shutdown_signal()).await?;
    mock.shutdown().await;
    Ok(())
}

/// The name of the key each run makes; the demo's store holds no other keys unless
/// someone adds them with `keys create --config DATA_DIR/demo.toml`.
const DEMO_KEY_NAME: &str = "demo";

/// Writes the demo's config to `data_dir/demo.toml` (the store beside it) and returns
/// its path. The upstream is this run's simulated vLLM, gone when the demo stops; the
/// store commands do not use it.
fn write_config(data_dir: &Path, listen: SocketAddr, upstream: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating the demo's data directory {}", data_dir.display()))?;
    let path = data_dir.join("demo.toml");
    let toml = format!(
        r#"# Written by `fleetgate demo` at each start, for the commands that read its store:
#   fleetgate keys list --config {path}   (and log, spend, jobs)
# The upstream is the demo's simulated vLLM, which stops with the demo.
listen = "{listen}"
database_url = "sqlite://demo.db"

[[models]]
id = "{DEMO_MODEL}"
default = true

[[models.upstreams]]
url = "{upstream}"
gpu = "demo-gpu-0"
"#,
        path = path.display(),
    );
    std::fs::write(&path, toml).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Revokes the live keys earlier demo runs made (their usage and log stay); returns how
/// many.
async fn revoke_earlier_demo_keys(store: &dyn Store) -> anyhow::Result<usize> {
    let mut revoked = 0;
    for key in store.list_keys().await? {
        if key.name == DEMO_KEY_NAME && key.revoked_at.is_none() {
            store.revoke_key(&key.id.to_string()).await?;
            revoked += 1;
        }
    }
    Ok(revoked)
}

fn instructions(address: SocketAddr, secret: &str, config: &Path, revoked: usize) -> String {
    let earlier = match revoked {
        0 => String::new(),
        1 => " (the previous run's demo key was revoked)".to_owned(),
        n => format!(" ({n} demo keys of earlier runs were revoked)"),
    };
    let config = config.display();
    format!(
        r#"fleetgate demo is serving on http://{address} in front of a simulated vLLM ({DEMO_CHECKPOINT}).
A key named "{DEMO_KEY_NAME}" was created for this run{earlier}.

Try it with curl:

curl -s http://{address}/v1/completions -H "Authorization: Bearer {secret}" -H "Content-Type: application/json" -d '{{"model": "{DEMO_MODEL}", "prompt": "The capital of France is", "max_tokens": 8}}'

Or with the OpenAI Python SDK (pip install openai):

from openai import OpenAI
client = OpenAI(base_url="http://{address}/v1", api_key="{secret}")
resp = client.completions.create(model="{DEMO_MODEL}", prompt="The capital of France is", max_tokens=8, extra_body={{"top_k": 20}})
print(resp.choices[0].text)

Or in the browser, with the key above: the Workbench at http://{address}/workbench and Loom at http://{address}/loom

The demo's keys, request log and spend, from another terminal:
fleetgate keys list --config {config}   (also: log, spend, jobs list)

API reference: http://{address}/swagger   Press Ctrl-C to stop."#
    )
}
