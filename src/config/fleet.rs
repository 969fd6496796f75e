//! `[fleet]` and `[[models]]`: how fleetgate watches its nodes and routes to them, and
//! which models it serves on which nodes — the settings, their defaults, and the block
//! size prefix routing counts `fleet.prefix_bytes` in.

use serde::Deserialize;

/// Bytes per hashed block of a text prompt in prefix routing (`fleet/prefix.rs`).
/// Defined here, not beside the hashing, because it is also the least
/// `fleet.prefix_bytes` (a prefix shorter than one block has no key), and the config
/// must not depend on the fleet it configures.
pub const PREFIX_BLOCK_BYTES: usize = 256;

/// How fleetgate watches its nodes and waits for them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSettings {
    /// How often every node's `/health` and `/v1/models` are probed.
    #[serde(default = "default_probe_interval_ms")]
    pub probe_interval_ms: u64,
    /// A probe not answered within this counts as a failure.
    #[serde(default = "default_probe_timeout_ms")]
    pub probe_timeout_ms: u64,
    /// A failed node is ejected for this long, doubling with each failure in a row up
    /// to `eject_max_ms`; after that a successful probe re-admits it.
    #[serde(default = "default_eject_base_ms")]
    pub eject_base_ms: u64,
    #[serde(default = "default_eject_max_ms")]
    pub eject_max_ms: u64,
    /// Requests per model that may wait for a node below its `max_in_flight`; more
    /// get 503 at once.
    #[serde(default = "default_queue_size")]
    pub queue_size: u32,
    /// The longest a request waits in that queue before 503.
    #[serde(default = "default_queue_timeout_ms")]
    pub queue_timeout_ms: u64,
    /// Which waiting request gets the next free node slot: `fair` (the key that has
    /// been served the fewest tokens for its `share`) or `arrival` (first come, first
    /// served).
    #[serde(default)]
    pub queue_order: QueueOrder,
    /// How long a non-streaming request may take upstream before 504
    /// `upstream_deadline`; omitted `max_tokens` are cut to what fits in it.
    #[serde(default = "default_request_window_ms")]
    pub request_window_ms: u64,
    /// During a cold boot, how often a keep-alive byte is sent to the waiting client.
    #[serde(default = "default_keepalive_interval_ms")]
    pub keepalive_interval_ms: u64,
    /// How a model's requests choose their node, unless the model says otherwise:
    /// `prefix` (the node that owns the prompt's prefix, so vLLM's prefix cache is
    /// reused) or `load` (the least-loaded of two random nodes).
    #[serde(default)]
    pub routing: Routing,
    /// `prefix` routing: how much of a prompt's start decides its node. Prompts whose
    /// first `prefix_bytes` bytes agree (token ids: 4 bytes each) go to the same node;
    /// counted in whole blocks of 256 bytes ([`PREFIX_BLOCK_BYTES`]).
    #[serde(default = "default_prefix_bytes")]
    pub prefix_bytes: usize,
    /// `prefix` routing: the owner of a prefix is passed over for the least-loaded pick
    /// when its load (requests in flight plus those waiting in its vLLM, over its weight)
    /// is more than `prefix_imbalance_abs` above the lightest node's and more than
    /// `prefix_imbalance_rel` times it (and always when it is at `max_in_flight`).
    #[serde(default = "default_prefix_imbalance_abs")]
    pub prefix_imbalance_abs: f64,
    #[serde(default = "default_prefix_imbalance_rel")]
    pub prefix_imbalance_rel: f64,
    /// `prefix` routing: how many recently seen prefixes each replica remembers per
    /// model (8 bytes each). Only a prefix seen before goes to its owner; a new one takes
    /// the least-loaded pick.
    #[serde(default = "default_prefix_tracked")]
    pub prefix_tracked: usize,
    /// Whether a node without `max_in_flight` gets a limit learned from the load it
    /// reports, so that once it queues the excess waits in the fleet queue.
    #[serde(default)]
    pub hold: Hold,
}

/// Whether requests are held at the gateway once a node queues (`fleet.hold`).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Hold {
    /// A node without `max_in_flight` that reports requests waiting gets a limit learned
    /// from its load (`fleet/hold.rs`).
    #[default]
    Auto,
    /// Only `max_in_flight` limits what is sent to a node: vLLM queues the rest.
    Off,
}

/// How a model's requests choose their node (`fleet.routing`, `models.routing`).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Routing {
    /// The default: it measured better (`benches/prefix-routing`).
    #[default]
    Prefix,
    Load,
}

/// Which waiting request a model's fleet queue serves next (`fleet.queue_order`).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum QueueOrder {
    /// The key with the least service (tokens over its share) first; within a key,
    /// arrival order (`fleet/turns.rs`).
    #[default]
    Fair,
    /// First come, first served, whoever's key it is.
    Arrival,
}

impl Default for FleetSettings {
    fn default() -> Self {
        Self {
            probe_interval_ms: default_probe_interval_ms(),
            probe_timeout_ms: default_probe_timeout_ms(),
            eject_base_ms: default_eject_base_ms(),
            eject_max_ms: default_eject_max_ms(),
            queue_size: default_queue_size(),
            queue_timeout_ms: default_queue_timeout_ms(),
            queue_order: QueueOrder::default(),
            request_window_ms: default_request_window_ms(),
            keepalive_interval_ms: default_keepalive_interval_ms(),
            routing: Routing::default(),
            prefix_bytes: default_prefix_bytes(),
            prefix_imbalance_abs: default_prefix_imbalance_abs(),
            prefix_imbalance_rel: default_prefix_imbalance_rel(),
            prefix_tracked: default_prefix_tracked(),
            hold: Hold::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The short id clients send, e.g. `llama-8b`.
    pub id: String,
    /// Requests without `model` go to the default model; exactly one model is the default.
    #[serde(default)]
    pub default: bool,
    /// Largest `logprobs` accepted for this model (published as `capabilities.max_logprobs`).
    /// Keep it at or below the server's `--max-logprobs`.
    #[serde(default = "default_max_logprobs")]
    pub max_logprobs: u32,
    /// Tokens one sequence decodes per second, at worst: with `fleet.request_window_ms`
    /// it decides how many tokens a non-streaming request can get in time.
    #[serde(default = "default_decode_tokens_per_second")]
    pub decode_tokens_per_second: f64,
    /// Scale to zero: called (`POST`) when no node of the model is up; a 2xx answer
    /// confirms that a boot has started.
    #[serde(default)]
    pub wake_url: Option<String>,
    /// How long a woken model may take to come up before waiting requests fail.
    #[serde(default = "default_boot_timeout_ms")]
    pub boot_timeout_ms: u64,
    /// Called (`POST`) to put the model to sleep once it is idle (see `keep_warm_ms`).
    #[serde(default)]
    pub sleep_url: Option<String>,
    /// With `sleep_url`: the model sleeps once nothing has run on it for
    /// `idle_sleep_ms` and no `X-Acs-Workload: interactive` request came for
    /// `keep_warm_ms`.
    #[serde(default = "default_keep_warm_ms")]
    pub keep_warm_ms: u64,
    #[serde(default = "default_idle_sleep_ms")]
    pub idle_sleep_ms: u64,
    /// Overrides `fleet.routing` for this model.
    #[serde(default)]
    pub routing: Option<Routing>,
    pub upstreams: Vec<UpstreamConfig>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL of a vLLM server, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// Label returned in `X-Acs-Upstream-Gpu`.
    pub gpu: String,
    /// Relative capacity against the model's other upstreams (a node with weight 2 is
    /// given twice the in-flight requests of one with weight 1).
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Most requests sent to this node at once; beyond it requests wait in the fleet
    /// queue. Unlimited by default: vLLM queues well by itself.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
}

fn default_max_logprobs() -> u32 {
    20
}
fn default_weight() -> u32 {
    1
}
fn default_probe_interval_ms() -> u64 {
    2_000
}
fn default_probe_timeout_ms() -> u64 {
    5_000
}
fn default_eject_base_ms() -> u64 {
    1_000
}
fn default_eject_max_ms() -> u64 {
    30_000
}
fn default_queue_size() -> u32 {
    256
}
fn default_queue_timeout_ms() -> u64 {
    30_000
}
fn default_request_window_ms() -> u64 {
    600_000
}
fn default_keepalive_interval_ms() -> u64 {
    10_000
}
fn default_prefix_bytes() -> usize {
    1024
}
fn default_prefix_imbalance_abs() -> f64 {
    16.0
}
fn default_prefix_imbalance_rel() -> f64 {
    1.5
}
fn default_prefix_tracked() -> usize {
    16_384
}
/// 26 tokens/s over the default 600 s window: ~15,600 tokens.
fn default_decode_tokens_per_second() -> f64 {
    26.0
}
fn default_boot_timeout_ms() -> u64 {
    600_000
}
fn default_keep_warm_ms() -> u64 {
    30 * 60_000
}
fn default_idle_sleep_ms() -> u64 {
    5 * 60_000
}
