//! A deterministic toy tokenizer with a static vocabulary (a function of `vocab_size`
//! only, so every mock instance and every run agrees on the ids).
//!
//! Id layout:
//!
//! | ids | piece |
//! |---|---|
//! | 0 | `<unk>` (only for characters whose byte tokens do not fit in a small vocab) |
//! | 1 | `<|begin_of_text|>` (the BOS when `vocab_size` ≤ 128 000) |
//! | 2 | `<|end_of_text|>` |
//! | 3 .. 67 | the generation words of [`WORDS`] (`" the"`, `" of"`, …) |
//! | 67 .. 323 | one byte each |
//! | 323 .. 9 348 | two printable-ASCII characters |
//! | 9 348 .. 26 924 | three lowercase ASCII letters |
//! | 26 924 .. 128 000 | `<|reserved_N|>` fillers |
//! | 128 000 .. | Llama-3 specials: 128 000 BOS, 128 001 EOS, then `<|reserved_special_token_K|>` |
//!
//! Ids at or above `vocab_size` do not exist. Encoding is greedy longest-match over the
//! pieces that exist, so it never yields more tokens than the text has bytes (plus BOS),
//! and decoding the ids gives the text back exactly whenever every byte has an id
//! (`vocab_size` ≥ 323 covers all of them; smaller vocabs map what they lack to
//! `<unk>`). The literal text `<|begin_of_text|>` encodes to BOS, as HF tokenizers do.

pub const BOS_TEXT: &str = "<|begin_of_text|>";
const EOS_TEXT: &str = "<|end_of_text|>";
const UNK_TEXT: &str = "<unk>";

const UNK_ID: u32 = 0;
const SMALL_BOS_ID: u32 = 1;
const SMALL_EOS_ID: u32 = 2;
/// First id of the generation words; the toy model samples only from these.
pub(crate) const WORD_BASE: u32 = 3;
const BYTE_BASE: u32 = WORD_BASE + WORDS.len() as u32;
const PRINTABLE: u32 = 95; // b' '..=b'~'
const PAIR_BASE: u32 = BYTE_BASE + 256;
const TRIPLE_BASE: u32 = PAIR_BASE + PRINTABLE * PRINTABLE;
const FILLER_BASE: u32 = TRIPLE_BASE + 26 * 26 * 26;
const LLAMA3_BOS_ID: u32 = 128_000;
const LLAMA3_EOS_ID: u32 = 128_001;

/// The generation vocabulary, likeliest first (the toy model ranks them Zipf-style).
pub(crate) const WORDS: [&str; 64] = [
    " the", " of", " and", " to", " a", " in", " is", " that", " it", " was", " for", " on",
    " with", " as", " be", " at", " by", " this", " not", " are", " from", " or", " have", " an",
    " they", " which", " one", " you", " were", " all", " we", " her", " she", " there", " would",
    " their", " will", " when", " who", " him", " been", " has", " more", " if", " no", " out",
    " so", " said", " what", " up", " its", " about", " into", " than", " them", " can", " only",
    " other", " new", " some", " time", ".", ",", " could",
];

#[derive(Clone, Debug)]
pub struct Tokenizer {
    vocab_size: u32,
}

impl Tokenizer {
    /// `vocab_size` must exceed [`WORD_BASE`] (checked by the server at start).
    pub fn new(vocab_size: u32) -> Self {
        Self { vocab_size }
    }

    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    pub fn bos_id(&self) -> u32 {
        if self.vocab_size > LLAMA3_BOS_ID {
            LLAMA3_BOS_ID
        } else {
            SMALL_BOS_ID
        }
    }

    /// Number of generation words that have an id in this vocab.
    pub(crate) fn word_count(&self) -> u32 {
        (WORDS.len() as u32).min(self.vocab_size.saturating_sub(WORD_BASE))
    }

    /// Tokenise `text`, prepending BOS when `add_special_tokens` (vLLM's default).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        let bytes = text.as_bytes();
        let mut ids = Vec::with_capacity(bytes.len() / 2 + 1);
        if add_special_tokens {
            ids.push(self.bos_id());
        }
        let mut i = 0;
        while i < bytes.len() {
            let (id, len) = self.longest_piece(&bytes[i..]);
            ids.push(id);
            i += len;
        }
        ids
    }

    /// Decode ids to text, special tokens kept (like `tokenizer.decode(ids)` in vLLM's echo).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut buf = Vec::new();
        for &id in ids {
            self.write_piece(id, &mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// The text of one token (`decode([id])`): a lone byte of a multi-byte character
    /// becomes U+FFFD, as in vLLM's logprob strings.
    pub fn token_text(&self, id: u32) -> String {
        let mut buf = Vec::new();
        self.write_piece(id, &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// The raw vocab string of a token (`convert_ids_to_tokens`), GPT-2 byte-level style:
    /// space → `Ġ`, newline → `Ċ`, tab → `ĉ`, non-ASCII bytes → `<0xNN>`.
    pub fn raw_token(&self, id: u32) -> String {
        let mut buf = Vec::new();
        self.write_piece(id, &mut buf);
        match String::from_utf8(buf) {
            Ok(s) => s.replace(' ', "Ġ").replace('\n', "Ċ").replace('\t', "ĉ"),
            Err(e) => e
                .as_bytes()
                .iter()
                .map(|b| format!("<0x{b:02X}>"))
                .collect(),
        }
    }

    /// Append the bytes of token `id` to `out`.
    pub(crate) fn write_piece(&self, id: u32, out: &mut Vec<u8>) {
        match id {
            UNK_ID => out.extend_from_slice(UNK_TEXT.as_bytes()),
            SMALL_BOS_ID | LLAMA3_BOS_ID => out.extend_from_slice(BOS_TEXT.as_bytes()),
            SMALL_EOS_ID | LLAMA3_EOS_ID => out.extend_from_slice(EOS_TEXT.as_bytes()),
            _ if id < BYTE_BASE => {
                out.extend_from_slice(WORDS[(id - WORD_BASE) as usize].as_bytes())
            }
            _ if id < PAIR_BASE => out.push((id - BYTE_BASE) as u8),
            _ if id < TRIPLE_BASE => {
                let k = id - PAIR_BASE;
                out.extend_from_slice(&[printable(k / PRINTABLE), printable(k % PRINTABLE)]);
            }
            _ if id < FILLER_BASE => {
                let k = id - TRIPLE_BASE;
                out.extend_from_slice(&[letter(k / 676), letter(k / 26 % 26), letter(k % 26)]);
            }
            _ if id < LLAMA3_BOS_ID => {
                out.extend_from_slice(format!("<|reserved_{id}|>").as_bytes())
            }
            _ => {
                let k = id - LLAMA3_EOS_ID - 1;
                out.extend_from_slice(format!("<|reserved_special_token_{k}|>").as_bytes());
            }
        }
    }

    fn exists(&self, id: u32) -> bool {
        id < self.vocab_size
    }

    /// The longest existing piece at the start of `rest` (non-empty): `(id, byte length)`.
    fn longest_piece(&self, rest: &[u8]) -> (u32, usize) {
        if rest.starts_with(BOS_TEXT.as_bytes()) {
            return (self.bos_id(), BOS_TEXT.len());
        }
        let mut best: Option<(u32, usize)> = None;
        let mut consider = |id: u32, len: usize| {
            if self.exists(id) && best.is_none_or(|(_, l)| len > l) {
                best = Some((id, len));
            }
        };
        for (k, word) in WORDS.iter().enumerate() {
            if rest.starts_with(word.as_bytes()) {
                consider(WORD_BASE + k as u32, word.len());
            }
        }
        if let [a, b, c, ..] = rest
            && [a, b, c].iter().all(|x| x.is_ascii_lowercase())
        {
            let k = u32::from(a - b'a') * 676 + u32::from(b - b'a') * 26 + u32::from(c - b'a');
            consider(TRIPLE_BASE + k, 3);
        }
        if let [a, b, ..] = rest
            && is_printable(*a)
            && is_printable(*b)
        {
            consider(
                PAIR_BASE + u32::from(a - b' ') * PRINTABLE + u32::from(b - b' '),
                2,
            );
        }
        consider(BYTE_BASE + u32::from(rest[0]), 1);
        // A vocab too small to hold this byte: the whole character becomes <unk>.
        best.unwrap_or((UNK_ID, utf8_width(rest[0]).min(rest.len())))
    }
}

fn is_printable(b: u8) -> bool {
    (b' '..=b'~').contains(&b)
}

fn printable(k: u32) -> u8 {
    b' ' + k as u8
}

fn letter(k: u32) -> u8 {
    b'a' + k as u8
}

fn utf8_width(lead: u8) -> usize {
    match lead {
        0xF0.. => 4,
        0xE0.. => 3,
        0xC0.. => 2,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_bounds() {
        let tok = Tokenizer::new(128_256);
        for text in [
            "",
            "Hello world",
            " the cat sat.",
            "héllo — 日本語 🎉\n\ttabs",
            BOS_TEXT,
        ] {
            let ids = tok.encode(text, true);
            assert_eq!(ids[0], 128_000);
            assert!(ids.len() <= text.len() + 1);
            assert!(ids.iter().all(|&id| id < 128_256));
            let decoded = tok.decode(&ids[1..]);
            assert_eq!(decoded, text);
        }
        assert_eq!(tok.encode(" the", false), vec![WORD_BASE]);
    }

    #[test]
    fn small_vocab_stays_in_range() {
        let tok = Tokenizer::new(50);
        let ids = tok.encode("héllo the of", true);
        assert_eq!(ids[0], 1);
        assert!(ids.iter().all(|&id| id < 50));
        assert_eq!(tok.word_count(), 47);
    }
}
