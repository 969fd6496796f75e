//! `fleetgate demo`: the gateway on its embedded defaults — an in-process simulated vLLM,
//! a SQLite store in a local data directory, and a fresh key — with a ready-to-paste
//! curl line and OpenAI SDK snippet. Nothing else needs to be installed.

use std::net::SocketAddr;
use std::path::Path;

use fleetgate::config::Config;
use fleetgate::server;
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
    let config = Config::from_toml(&format!(
        r#"
listen = "{listen}"
database_url = "sqlite://{data}/demo.db"

[[models]]
id = "{DEMO_MODEL}"
default = true

[[models.upstreams]]
url = "{upstream}"
gpu = "demo-gpu-0"
"#,
        data = data_dir.display(),
        upstream = mock.url(),
    ))?;
    let _log = server::init_logging(config.log_format, &config.traces)?;
    let listener = server::bind(config.listen, "--listen (e.g. --listen 127.0.0.1:8081)").await?;
    let address = listener.local_addr()?;
    let state = server::prepare(config).await?;
    let key = fleetgate::key_secret::generate();
    state
        .store()
        .create_key(
            "demo",
            None,
            &key,
            &fleetgate::store::LimitOverrides::default(),
        )
        .await?;
    println!("{}", instructions(address, key.secret.expose()));
    server::serve(state, listener, server::shutdown_signal()).await?;
    mock.shutdown().await;
    Ok(())
}

fn instructions(address: SocketAddr, secret: &str) -> String {
    format!(
        r#"fleetgate demo is serving on http://{address} in front of a simulated vLLM ({DEMO_CHECKPOINT}).
A key named "demo" was created for this run.

Try it with curl:

curl -s http://{address}/v1/completions -H "Authorization: Bearer {secret}" -H "Content-Type: application/json" -d '{{"model": "{DEMO_MODEL}", "prompt": "The capital of France is", "max_tokens": 8}}'

Or with the OpenAI Python SDK (pip install openai):

from openai import OpenAI
client = OpenAI(base_url="http://{address}/v1", api_key="{secret}")
resp = client.completions.create(model="{DEMO_MODEL}", prompt="The capital of France is", max_tokens=8, extra_body={{"top_k": 20}})
print(resp.choices[0].text)

Or in the browser, with the key above: the Workbench at http://{address}/workbench and Loom at http://{address}/loom

API reference: http://{address}/swagger   Press Ctrl-C to stop."#
    )
}
