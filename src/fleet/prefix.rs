//! Prefix-cache-aware routing (`routing = "prefix"`): a request goes to the node that
//! owns the start of its first prompt, so that the KV cache vLLM keeps of that prefix
//! (automatic prefix caching) is reused instead of recomputed on every node.
//!
//! - The key: the first `fleet.prefix_bytes` bytes of a text prompt (token ids: that
//!   many bytes' worth, [`BYTES_PER_ID`] per id), cut down to whole blocks of
//!   [`PREFIX_BLOCK_BYTES`], hashed with FNV-1a (64-bit). FNV runs byte after byte, so the hash
//!   at a block's end is chained over every block before it. Text is matched on its
//!   bytes: no tokenizer, no allocation, at most `prefix_bytes` read. A prompt shorter
//!   than one block has no key.
//! - The owner: weighted rendezvous (highest random weight) hashing of the key over the
//!   model's nodes that take requests, each known by the hash of its URL. Every replica
//!   configured with the same node URLs computes the same owner without talking to the
//!   others, and a node that joins, leaves or is ejected moves only the keys it wins or
//!   held: the others keep their owner.
//! - A prefix this replica has not seen recently ([`Seen`]) is held by no node yet, so it
//!   goes to its owner (or runner-up) only if no node is less loaded
//!   ([`Balance::STRICT`]); else to the least-loaded pick. Prompts that share nothing thus spread as evenly as with
//!   `routing = "load"`, while a prefix seen before keeps to its owner within the
//!   configured balance. The table of seen keys has a fixed size (`fleet.prefix_tracked`
//!   per model), so memory does not grow with traffic.
//!
//! The pick itself (the owner unless it is overloaded or full, then the runner-up in the
//! ranking, else the least-loaded pick) is in `model.rs`.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::PREFIX_BLOCK_BYTES;

/// Token ids count as this many bytes each (a BPE token averages about 4 bytes of
/// English), so a text prompt and its token ids are keyed on about the same prefix.
pub const BYTES_PER_ID: usize = 4;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The start of a request's first prompt, as routing sees it (a batch is routed by its
/// first prompt; `n` does not matter).
#[derive(Clone, Copy, Debug)]
pub enum PromptStart<'a> {
    Text(&'a [u8]),
    Tokens(&'a [u32]),
}

/// Where a request wants to go; worked out once per request (`Model::affinity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Affinity {
    /// `routing = "load"`: the least-loaded pick.
    Load,
    /// `routing = "prefix"`, but the prompt is shorter than one block.
    NoKey,
    /// The prompt's prefix key, and whether this replica saw it recently.
    Key { key: u64, seen: bool },
}

/// How the node of a request was picked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// `routing = "load"`.
    Load,
    /// The prefix's owner.
    Owner,
    /// The owner was overloaded or at its `max_in_flight`: the node that ranks next
    /// for the prefix.
    RunnerUp,
    /// The owner and the runner-up of a prefix seen before were overloaded or full:
    /// the least-loaded pick.
    FallbackLoad,
    /// No node is likely to hold the prompt's prefix (too short to have one, or new and
    /// its owner and runner-up busier than the lightest node): the least-loaded pick.
    NoOwner,
}

fn fnv(hash: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes
        .into_iter()
        .fold(hash, |h, b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}

/// The prefix key of a prompt, keyed on at most `depth_bytes` (whole blocks only).
pub fn key(start: PromptStart<'_>, depth_bytes: usize) -> Option<u64> {
    let whole_blocks = |len: usize, per_block: usize| {
        let blocks = len.min(depth_bytes / PREFIX_BLOCK_BYTES * per_block) / per_block;
        (blocks > 0).then_some(blocks * per_block)
    };
    match start {
        PromptStart::Text(bytes) => {
            let end = whole_blocks(bytes.len(), PREFIX_BLOCK_BYTES)?;
            Some(fnv(FNV_OFFSET, bytes[..end].iter().copied()))
        }
        PromptStart::Tokens(ids) => {
            let end = whole_blocks(ids.len(), PREFIX_BLOCK_BYTES / BYTES_PER_ID)?;
            Some(fnv(
                FNV_OFFSET,
                ids[..end].iter().flat_map(|id| id.to_le_bytes()),
            ))
        }
    }
}

/// A node's identity in the ranking: the FNV-1a hash of its URL.
pub fn seed(url: &str) -> u64 {
    fnv(FNV_OFFSET, url.bytes())
}

/// SplitMix64's finalizer: spreads the bits of the (key, node) pair.
fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The weighted rendezvous score of `key` on a node: `weight / -ln(u)` with `u` uniform
/// in (0, 1) drawn from the pair's hash. The highest score owns the key; a node wins
/// its weight's share of all keys.
pub fn score(key: u64, seed: u64, weight: u32) -> f64 {
    let hash = finalize(key ^ finalize(seed));
    let unit = ((hash >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    f64::from(weight) / -unit.ln()
}

/// When the owner is passed over for the least-loaded pick: its load (requests in
/// flight plus those its vLLM reports waiting, over its weight) is more than `abs`
/// above the lightest node's and more than `rel` times it.
#[derive(Clone, Copy, Debug)]
pub struct Balance {
    pub abs: f64,
    pub rel: f64,
}

impl Balance {
    /// For a new prefix: any node less loaded than the owner is better.
    pub const STRICT: Self = Self { abs: 0.0, rel: 1.0 };

    pub fn overloaded(&self, owner: f64, lightest: f64) -> bool {
        owner - lightest > self.abs && owner > lightest * self.rel
    }
}

/// The prefix keys a replica saw recently, for one model: a direct-mapped table in
/// which each slot keeps the latest key that hashed to it. Fixed memory, no lock, no
/// allocation; a key is forgotten once another takes its slot. (Empty slots hold 0, so
/// the one key in 2^64 that is 0 counts as seen from the start.)
pub struct Seen {
    slots: Box<[AtomicU64]>,
}

impl Seen {
    pub fn new(capacity: usize) -> Self {
        Self {
            slots: (0..capacity.max(1)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Whether `key` was seen since its slot last changed hands; remembered from now on
    /// either way.
    pub fn saw(&self, key: u64) -> bool {
        let slot = (finalize(key) % self.slots.len() as u64) as usize;
        self.slots[slot].swap(key, Ordering::Relaxed) == key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_key(text: &str) -> Option<u64> {
        key(PromptStart::Text(text.as_bytes()), 1024)
    }

    fn owner(key: u64, seats: &[(u64, u32)]) -> usize {
        let scores = seats.iter().map(|&(seed, weight)| score(key, seed, weight));
        scores
            .enumerate()
            .fold(
                (0, f64::MIN),
                |best, (i, s)| if s > best.1 { (i, s) } else { best },
            )
            .0
    }

    fn seats(n: usize) -> Vec<(u64, u32)> {
        (0..n)
            .map(|i| (seed(&format!("http://10.0.0.{i}:8000")), 1))
            .collect()
    }

    #[test]
    fn prompts_agreeing_on_their_keyed_start_share_a_key() {
        let document = "lorem ipsum ".repeat(200);
        let (a, b) = (format!("{document} branch A"), format!("{document} and B"));
        assert_eq!(text_key(&a), text_key(&b), "the depth is 1 KiB");
        assert!(text_key(&a).is_some());
        let other = format!("x{document}");
        assert_ne!(text_key(&a), text_key(&other), "differs in the first block");
        assert_eq!(
            text_key(&"y".repeat(PREFIX_BLOCK_BYTES - 1)),
            None,
            "no whole block"
        );
        // Shorter than the depth: keyed on its whole blocks, the rest ignored.
        let short = "z".repeat(PREFIX_BLOCK_BYTES + 10);
        assert_eq!(text_key(&short), text_key(&format!("{short}tail")));

        let ids: Vec<u32> = (0..300).collect();
        let token_key = |ids: &[u32]| key(PromptStart::Tokens(ids), 1024);
        assert_eq!(token_key(&ids), token_key(&ids[..256]), "1 KiB is 256 ids");
        assert_ne!(token_key(&ids), token_key(&ids[1..]));
        assert_eq!(token_key(&ids[..63]), None);
    }

    #[test]
    fn a_joining_node_takes_only_its_share_of_the_keys() {
        let (before, mut after) = (seats(4), seats(4));
        after.push((seed("http://10.0.0.99:8000"), 1));
        let keys = 20_000u64;
        let mut moved = 0;
        for k in 0..keys {
            let key = finalize(k);
            let (was, is) = (owner(key, &before), owner(key, &after));
            if was != is {
                assert_eq!(is, 4, "a key moved between two nodes that stayed");
                moved += 1;
            }
        }
        // Its fair share is a fifth.
        let share = f64::from(moved) / keys as f64;
        assert!((0.17..0.23).contains(&share), "moved {share}");
    }

    #[test]
    fn a_node_owns_its_weights_share_of_the_keys() {
        let mut weighted = seats(3);
        weighted[0].1 = 2;
        let keys = 20_000u64;
        let first = (0..keys)
            .filter(|&k| owner(finalize(k), &weighted) == 0)
            .count();
        let share = first as f64 / keys as f64;
        assert!((0.46..0.54).contains(&share), "weight 2 of 4 owns {share}");
    }

    #[test]
    fn the_seen_table_holds_at_most_its_capacity_of_keys() {
        let seen = Seen::new(64);
        let keys: Vec<u64> = (1..=10_000).map(finalize).collect();
        assert!(!seen.saw(keys[0]), "new");
        assert!(seen.saw(keys[0]), "seen");
        for &key in &keys {
            seen.saw(key);
        }
        assert!(seen.saw(keys[9_999]), "the latest key is remembered");
        // 64 slots cannot hold 10,000 keys: the oldest were pushed out.
        let old = keys[..1_000].iter().filter(|&&k| seen.saw(k)).count();
        assert_eq!(
            old, 0,
            "of the 1,000 oldest keys, {old} are still remembered"
        );
    }

    #[test]
    fn the_balance_needs_both_thresholds_crossed() {
        let balance = Balance { abs: 4.0, rel: 1.5 };
        assert!(!balance.overloaded(4.0, 0.0), "4 above is within abs");
        assert!(balance.overloaded(5.0, 0.0));
        assert!(!balance.overloaded(20.0, 15.0), "5 above, but 1.33 times");
        assert!(balance.overloaded(23.0, 15.0));
        assert!(
            !Balance::STRICT.overloaded(2.0, 2.0),
            "as light as the lightest"
        );
        assert!(Balance::STRICT.overloaded(2.5, 2.0));
    }
}
