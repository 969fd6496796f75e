//! `mock-vllm`: the simulated vLLM server as a standalone process (for the demo and
//! manual testing). Prints `mock-vllm listening on http://ADDR` once bound.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use mock_vllm::{MockConfig, MockVllm};

#[derive(Parser, Debug)]
#[command(
    name = "mock-vllm",
    about = "A simulated vLLM OpenAI-compatible server"
)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// The model id served (vLLM's --served-model-name).
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B")]
    served_model_name: String,
    #[arg(long, default_value_t = 8192)]
    max_model_len: u32,
    #[arg(long, default_value_t = 20)]
    max_logprobs: u32,
    #[arg(long, default_value_t = 128_256)]
    vocab_size: u32,
    /// Delay before the first token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    ttft_ms: u64,
    /// Delay between generated tokens, in milliseconds.
    #[arg(long, default_value_t = 0)]
    token_delay_ms: u64,
    /// Tokens the prefix cache holds (0: no prefix caching).
    #[arg(long, default_value_t = 0)]
    prefix_cache_tokens: usize,
    /// Prefill time per prompt token not in the prefix cache, in microseconds.
    #[arg(long, default_value_t = 0)]
    prefill_us_per_token: u64,
    /// Requests decoded at once; more wait (reported as vllm:num_requests_waiting).
    /// Unlimited when not given.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_num_seqs: Option<u32>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let config = MockConfig {
        served_model_name: args.served_model_name,
        max_model_len: args.max_model_len,
        max_logprobs: args.max_logprobs,
        vocab_size: args.vocab_size,
        time_to_first_token: Duration::from_millis(args.ttft_ms),
        token_delay: Duration::from_millis(args.token_delay_ms),
        prefix_cache_tokens: args.prefix_cache_tokens,
        prefill_per_token: Duration::from_micros(args.prefill_us_per_token),
        max_num_seqs: args.max_num_seqs,
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let mock = MockVllm::start_on(listener, config).await?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "mock-vllm listening on {}", mock.url())?;
    stdout.flush()?;
    tokio::signal::ctrl_c().await?;
    mock.shutdown().await;
    Ok(())
}
