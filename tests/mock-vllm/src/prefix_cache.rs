//! The node's prefix cache, as vLLM's automatic prefix caching keeps it: the KV blocks
//! of recent prompts, [`BLOCK_TOKENS`] tokens each, keyed by a hash chained over every
//! token up to the block's end (so a block matches only after the same whole prefix),
//! evicted least recently used first beyond a capacity. A prompt's leading blocks found
//! here are hits; the rest of it is prefilled. The counters are vLLM's
//! `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`, in tokens.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::lock::lock;
use super::model::mix;

/// vLLM's default KV block size.
pub(crate) const BLOCK_TOKENS: usize = 16;

pub(crate) struct PrefixCache {
    capacity_blocks: usize,
    inner: Mutex<Blocks>,
}

#[derive(Default)]
struct Blocks {
    /// Block hash → its last use.
    used: HashMap<u64, u64>,
    /// Last use → block hash: the eviction order.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
    queries: u64,
    hits: u64,
}

impl Blocks {
    fn touch(&mut self, block: u64) {
        self.clock += 1;
        if let Some(previous) = self.used.insert(block, self.clock) {
            self.by_use.remove(&previous);
        }
        self.by_use.insert(self.clock, block);
    }
}

impl PrefixCache {
    /// Holds `capacity_tokens` tokens (whole blocks); 0 caches nothing.
    pub fn new(capacity_tokens: usize) -> Self {
        Self {
            capacity_blocks: capacity_tokens / BLOCK_TOKENS,
            inner: Mutex::new(Blocks::default()),
        }
    }

    /// Looks a prompt up and caches its whole blocks: returns the tokens found cached.
    /// Like vLLM, at least the last token is always computed, so a fully cached prompt
    /// hits one block less.
    pub fn query(&self, ids: &[u32]) -> usize {
        let mut hash = 0u64;
        let chain: Vec<u64> = ids
            .chunks_exact(BLOCK_TOKENS)
            .map(|block| {
                hash = block.iter().fold(hash, |h, &id| mix(h, u64::from(id)));
                hash
            })
            .collect();
        let mut blocks = lock(&self.inner);
        let most = ids.len().saturating_sub(1) / BLOCK_TOKENS;
        let hit_blocks = chain
            .iter()
            .take(most)
            .take_while(|block| blocks.used.contains_key(block))
            .count();
        let hit_tokens = hit_blocks * BLOCK_TOKENS;
        blocks.queries += ids.len() as u64;
        blocks.hits += hit_tokens as u64;
        if self.capacity_blocks > 0 {
            for &block in &chain {
                blocks.touch(block);
            }
            while blocks.used.len() > self.capacity_blocks {
                let Some((_, oldest)) = blocks.by_use.pop_first() else {
                    break;
                };
                blocks.used.remove(&oldest);
            }
        }
        hit_tokens
    }

    /// (queried tokens, hit tokens) since start.
    pub fn counters(&self) -> (u64, u64) {
        let blocks = lock(&self.inner);
        (blocks.queries, blocks.hits)
    }
}
