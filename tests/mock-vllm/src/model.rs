//! The toy language model: a next-token distribution that depends only on the last two
//! tokens, so prompt logprobs and sampling are deterministic and cheap.
//!
//! Only the generation words (ids `WORD_BASE..WORD_BASE+C`) get real probability mass:
//! Zipf-shaped logits (`" the"` likeliest) plus context noise. Every other id gets a tiny
//! "tail" logprob that decreases with its id, so a full-vocab distribution (−1 prompt
//! logprobs) can be walked in rank order without sorting the vocab.

use super::tokenizer::{Tokenizer, WORD_BASE};

/// Logprob of the best tail token; each further tail rank is 1e-4 lower.
const TAIL_LOGPROB: f64 = -20.0;
/// Amplitude of the context noise added to the Zipf logits.
const NOISE: f64 = 1.5;

/// SplitMix64: a tiny, stable PRNG (its output must not change with a crate upgrade,
/// since tests rely on "same request + same seed ⇒ same text").
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        finalize(self.0)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Mix `value` into hash `h`.
pub(crate) fn mix(h: u64, value: u64) -> u64 {
    finalize(h ^ finalize(value.wrapping_add(0x9E37_79B9_7F4A_7C15)))
}

/// Sampling knobs after vLLM's defaults are applied.
#[derive(Clone, Debug)]
pub(crate) struct Sampling {
    pub temperature: f64,
    /// 0 or −1 = disabled.
    pub top_k: i64,
    pub top_p: f64,
    pub min_p: f64,
}

/// The distribution at one position: the generation words ranked best first.
#[derive(Clone, Debug)]
pub(crate) struct StepDist {
    ranked: Vec<(u32, f64)>,
}

#[derive(Clone, Debug)]
pub(crate) struct ToyModel {
    vocab_size: u32,
    /// Number of generation words in the vocab (C).
    words: u32,
}

impl ToyModel {
    pub fn new(tokenizer: &Tokenizer) -> Self {
        Self {
            vocab_size: tokenizer.vocab_size(),
            words: tokenizer.word_count(),
        }
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// The next-token distribution after `context` (only its last two ids matter).
    pub fn dist(&self, context: &[u32]) -> StepDist {
        let key = context
            .iter()
            .rev()
            .take(2)
            .fold(0x6D6F_636B_766C_6C6D, |h, &id| mix(h, u64::from(id)));
        let logits: Vec<f64> = (0..self.words)
            .map(|i| {
                let noise = (mix(key, u64::from(i)) >> 11) as f64 / (1u64 << 53) as f64;
                -(f64::from(i) + 1.0).ln() + NOISE * noise
            })
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        let mut ranked: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| (WORD_BASE + i as u32, round4(l - lse)))
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        StepDist { ranked }
    }

    /// `(logprob, rank)` of any id (rank 1 = likeliest).
    pub fn lookup(&self, dist: &StepDist, id: u32) -> (f64, u32) {
        if let Some(pos) = dist.ranked.iter().position(|&(c, _)| c == id) {
            return (dist.ranked[pos].1, pos as u32 + 1);
        }
        // Tail ids in id order, skipping the word range.
        let q = if id < WORD_BASE { id } else { id - self.words };
        (tail_logprob(q), self.words + 1 + q)
    }

    /// The id and logprob at 0-based rank `r` (< vocab_size).
    pub fn at_rank(&self, dist: &StepDist, r: u32) -> (u32, f64) {
        if let Some(&entry) = dist.ranked.get(r as usize) {
            return entry;
        }
        let q = r - self.words;
        let id = if q < WORD_BASE { q } else { q + self.words };
        (id, tail_logprob(q))
    }

    /// The `k` likeliest ids with their logprobs.
    pub fn top(&self, dist: &StepDist, k: usize) -> Vec<(u32, f64)> {
        let k = u32::try_from(k).unwrap_or(u32::MAX).min(self.vocab_size);
        (0..k).map(|r| self.at_rank(dist, r)).collect()
    }

    /// Draw the next token with vLLM's sampling knobs (temperature, top-k, top-p, min-p).
    pub fn sample(&self, dist: &StepDist, sampling: &Sampling, rng: &mut Rng) -> u32 {
        let draw = rng.next_f64();
        let Some(&(best, _)) = dist.ranked.first() else {
            return WORD_BASE;
        };
        if sampling.temperature < 1e-5 {
            return best;
        }
        let mut weights: Vec<(u32, f64)> = dist
            .ranked
            .iter()
            .map(|&(id, lp)| (id, (lp / sampling.temperature).exp()))
            .collect();
        if sampling.top_k > 0 {
            weights.truncate(sampling.top_k as usize);
        }
        let total: f64 = weights.iter().map(|w| w.1).sum();
        let max = weights[0].1;
        let mut cumulative = 0.0;
        let mut keep = 0;
        for &(_, w) in &weights {
            if keep > 0 && (cumulative >= sampling.top_p * total || w < sampling.min_p * max) {
                break;
            }
            cumulative += w;
            keep += 1;
        }
        weights.truncate(keep);
        let mut target = draw * cumulative;
        for &(id, w) in &weights {
            if target < w {
                return id;
            }
            target -= w;
        }
        weights.last().map_or(best, |w| w.0)
    }
}

fn tail_logprob(q: u32) -> f64 {
    round4(TAIL_LOGPROB - f64::from(q) * 1e-4)
}

/// Logprobs are rounded to 4 decimals so they print short, like vLLM's bf16-ish values.
fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_cover_the_vocab_consistently() {
        let tok = Tokenizer::new(80);
        let model = ToyModel::new(&tok);
        let dist = model.dist(&[1, 7]);
        let mut seen = [false; 80];
        for r in 0..80 {
            let (id, lp) = model.at_rank(&dist, r);
            assert!(!seen[id as usize]);
            seen[id as usize] = true;
            assert_eq!(model.lookup(&dist, id), (lp, r + 1));
        }
    }
}
