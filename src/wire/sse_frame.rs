//! What one SSE frame of a completion stream says about tokens (and, by [`usage`], what
//! the usage object at the end of a whole JSON answer says).
//!
//! The meter reads every frame it relays (see `meter`). A vLLM frame is ~300 bytes of
//! JSON with a dozen keys, of which four matter here; serde_json's derived
//! deserializer parses and checks every key and every value, which was a fifth of the
//! gateway's CPU relaying streams flat out. [`Reader::read`] first walks the frame once,
//! matching the keys it needs and skipping the rest, and leaves to serde any frame in
//! which it meets something it does not expect: an escaped or repeated key, a value of
//! another type, a number that is not a plain `u64`. On well-formed JSON the two read
//! the same (a test checks them against each other); the walk does not validate the
//! values it skips, so a frame that is not JSON at all may be read where serde would
//! refuse it — vLLM writes well-formed frames, and nothing but the token count of a
//! stream cut short depends on it.
//!
//! A stream's frames differ from one another mostly inside one string: the token's
//! text. The reader keeps the last frame it walked, and a frame that differs from it
//! only inside one string value is not walked again; that took the meter from ~4,000
//! to ~900 instructions a vLLM frame.

use std::ops::Range;

use serde::Deserialize;

/// Token counts as the upstream reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Counts {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// What a frame says, kept between frames so that reading one allocates nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frame {
    pub choices: Vec<Choice>,
    pub usage: Option<Counts>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub index: u64,
    /// The number of tokens in the choice's `logprobs`, when it has them.
    pub logprob_tokens: Option<u64>,
}

/// A frame longer than this is not kept to compare the next one with: vLLM's are a few
/// hundred bytes, and one with logprobs differs from the next in more than one string.
const KEPT_MAX: usize = 4 * 1024;

/// Reads the frames of one stream, one after another.
#[derive(Default)]
pub struct Reader {
    /// What the last frame said, its buffer reused so that reading allocates nothing.
    frame: Frame,
    /// The last frame the walk read itself (empty after one left to serde, or too long
    /// to keep).
    last: Vec<u8>,
    /// The insides of `last`'s string values (not its keys), between their quotes, in
    /// order.
    strings: Vec<Range<usize>>,
}

impl Reader {
    /// Reads the JSON payload of a `data:` frame; `None` when it is not a completion
    /// chunk (an error event, or not JSON).
    ///
    /// The walk skips a string value by finding its closing quote and reads nothing
    /// inside it. So a frame that is the last one walked with the inside of one string
    /// value replaced — the same bytes before the string, the same bytes from its
    /// closing quote on, and the new inside ending, as the walk reads it, exactly where
    /// those bytes begin — is walked the same way to the same result, which is then
    /// kept rather than found again: two comparisons and a search of the one string,
    /// instead of a walk of every key.
    pub fn read(&mut self, data: &[u8]) -> Option<&Frame> {
        if !self.last.is_empty() && self.differs_inside_one_string(data) {
            return Some(&self.frame);
        }
        self.last.clear();
        self.frame.clear();
        self.strings.clear();
        let mut json = Walk {
            bytes: data,
            at: 0,
            strings: std::mem::take(&mut self.strings),
        };
        let walked = walk(&mut json, &mut self.frame).is_some();
        self.strings = json.strings;
        if walked {
            if data.len() <= KEPT_MAX {
                self.last.extend_from_slice(data);
            }
            return Some(&self.frame);
        }
        self.frame.clear();
        parse(data, &mut self.frame).then_some(&self.frame)
    }

    /// Whether `data` is `last` with at most the inside of one string value changed.
    fn differs_inside_one_string(&self, data: &[u8]) -> bool {
        let last = self.last.as_slice();
        let same = common_prefix(last, data);
        if same == last.len() && same == data.len() {
            return true;
        }
        // The string the first difference is in: it begins at or before it and ends
        // (its closing quote) at or after it.
        let after = self.strings.partition_point(|s| s.end < same);
        let Some(string) = self.strings.get(after).filter(|s| s.start <= same) else {
            return false;
        };
        let rest = &last[string.end..];
        let Some(end) = data.len().checked_sub(rest.len()) else {
            return false;
        };
        if end < string.start || &data[end..] != rest {
            return false;
        }
        let mut json = Walk::new(data);
        json.at = string.start - 1;
        json.string().is_some() && json.at == end + 1
    }
}

/// How many bytes `a` and `b` begin with alike, compared 16 at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let mut same = 0;
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        let (Ok(x), Ok(y)) = (<[u8; 16]>::try_from(x), <[u8; 16]>::try_from(y)) else {
            break;
        };
        let differ = u128::from_le_bytes(x) ^ u128::from_le_bytes(y);
        if differ != 0 {
            return same + differ.trailing_zeros() as usize / 8;
        }
        same += 16;
    }
    same + a[same..]
        .iter()
        .zip(&b[same..])
        .take_while(|(x, y)| x == y)
        .count()
}

/// The token counts of the usage object `data` starts with (what follows it is not
/// read), walked as a frame is and left to serde when the walk meets anything it does
/// not expect; `None` when it is not a usage object. For a whole JSON answer's usage,
/// which the JSON meter finds at its end.
pub fn usage(data: &[u8]) -> Option<Counts> {
    counts(&mut Walk::new(data)).or_else(|| {
        let mut values = serde_json::Deserializer::from_slice(data).into_iter::<Counts>();
        values.next()?.ok()
    })
}

impl Frame {
    fn clear(&mut self) {
        self.choices.clear();
        self.usage = None;
    }
}

/// What serde's derived deserializer reads of `data` into an empty `frame`.
fn parse(data: &[u8], frame: &mut Frame) -> bool {
    let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
        return false;
    };
    frame.usage = chunk.usage;
    frame
        .choices
        .extend(chunk.choices.iter().map(|choice| Choice {
            index: choice.index,
            logprob_tokens: choice.logprobs.as_ref().map(|l| l.tokens.len() as u64),
        }));
    true
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<Counts>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    index: u64,
    #[serde(default)]
    logprobs: Option<ChunkLogprobs>,
}

#[derive(Deserialize)]
struct ChunkLogprobs {
    #[serde(default)]
    tokens: Vec<serde::de::IgnoredAny>,
}

/// The single pass; `None` leaves the frame to serde.
fn walk(json: &mut Walk<'_>, frame: &mut Frame) -> Option<()> {
    let (mut choices, mut usage) = (false, false);
    json.object(|json, key| match key {
        b"choices" => {
            once(&mut choices)?;
            json.array(|json| {
                frame.choices.push(choice(json)?);
                Some(())
            })
        }
        b"usage" => {
            once(&mut usage)?;
            frame.usage = if json.null() {
                None
            } else {
                Some(counts(json)?)
            };
            Some(())
        }
        _ => json.skip(),
    })?;
    json.peek().is_none().then_some(())
}

fn choice(json: &mut Walk<'_>) -> Option<Choice> {
    let (mut index, mut logprob_tokens) = (None, None);
    let mut logprobs_seen = false;
    json.object(|json, key| match key {
        b"index" => {
            if index.is_some() {
                return None;
            }
            index = Some(json.u64()?);
            Some(())
        }
        b"logprobs" => {
            once(&mut logprobs_seen)?;
            if !json.null() {
                logprob_tokens = Some(tokens(json)?);
            }
            Some(())
        }
        _ => json.skip(),
    })?;
    Some(Choice {
        index: index.unwrap_or(0),
        logprob_tokens,
    })
}

/// The length of a `logprobs` object's `tokens` (0 without one).
fn tokens(json: &mut Walk<'_>) -> Option<u64> {
    let mut count = None;
    json.object(|json, key| match key {
        b"tokens" => {
            if count.is_some() {
                return None;
            }
            let mut n = 0;
            json.array(|json| {
                n += 1;
                json.skip()
            })?;
            count = Some(n);
            Some(())
        }
        _ => json.skip(),
    })?;
    Some(count.unwrap_or(0))
}

fn counts(json: &mut Walk<'_>) -> Option<Counts> {
    let (mut prompt, mut completion) = (None, None);
    json.object(|json, key| {
        let slot = match key {
            b"prompt_tokens" => &mut prompt,
            b"completion_tokens" => &mut completion,
            _ => return json.skip(),
        };
        if slot.is_some() {
            return None;
        }
        *slot = Some(json.u64()?);
        Some(())
    })?;
    Some(Counts {
        prompt_tokens: prompt?,
        completion_tokens: completion?,
    })
}

/// Marks a key seen; `None` the second time (serde refuses a repeated field).
fn once(seen: &mut bool) -> Option<()> {
    (!std::mem::replace(seen, true)).then_some(())
}

/// A position in the frame's bytes.
struct Walk<'a> {
    bytes: &'a [u8],
    at: usize,
    /// The insides of the string values passed so far (see [`Reader`]).
    strings: Vec<Range<usize>>,
}

impl<'a> Walk<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            at: 0,
            strings: Vec::new(),
        }
    }

    /// The next byte that is not whitespace, not consumed.
    fn peek(&mut self) -> Option<u8> {
        while let Some(&byte) = self.bytes.get(self.at) {
            if !matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(byte);
            }
            self.at += 1;
        }
        None
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    fn null(&mut self) -> bool {
        let is_null = self.peek() == Some(b'n') && self.bytes[self.at..].starts_with(b"null");
        if is_null {
            self.at += 4;
        }
        is_null
    }

    /// Passes a string: where its inside (between the quotes) begins and ends.
    fn string(&mut self) -> Option<Range<usize>> {
        self.eat(b'"')?;
        let start = self.at;
        loop {
            let rest = self.bytes.get(self.at..)?;
            self.at += memchr::memchr2(b'"', b'\\', rest)?;
            if self.bytes[self.at] == b'"' {
                self.at += 1;
                return Some(start..self.at - 1);
            }
            // The backslash and the byte it escapes.
            self.at += 2;
        }
    }

    /// Passes a string value, noting where its inside is.
    fn string_value(&mut self) -> Option<()> {
        let inside = self.string()?;
        self.strings.push(inside);
        Some(())
    }

    /// An object's key: a string with no escape in it (`None` for one that has one, which
    /// is left to serde). Found in one search for its end, which stops at a backslash too.
    fn key(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.at;
        let len = memchr::memchr2(b'"', b'\\', self.bytes.get(start..)?)?;
        if self.bytes[start + len] != b'"' {
            return None;
        }
        self.at = start + len + 1;
        Some(&self.bytes[start..start + len])
    }

    /// An object's members, each key given to `member`, which must consume its value.
    /// An escaped key is left to serde.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            let key = self.key()?;
            self.eat(b':')?;
            member(self, key)?;
            if self.closes(b'}')? {
                return Some(());
            }
        }
    }

    /// An array's items, each given to `item`, which must consume it.
    fn array(&mut self, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'[')?;
        if self.eat(b']').is_some() {
            return Some(());
        }
        loop {
            item(self)?;
            if self.closes(b']')? {
                return Some(());
            }
        }
    }

    /// After an item: `Some(false)` past a `,`, `Some(true)` past `close`.
    fn closes(&mut self, close: u8) -> Option<bool> {
        let next = self.peek()?;
        if next != b',' && next != close {
            return None;
        }
        self.at += 1;
        Some(next == close)
    }

    /// A plain unsigned integer, as serde reads a `u64`: no sign, fraction, exponent or
    /// leading zero, and no overflow.
    fn u64(&mut self) -> Option<u64> {
        self.peek()?;
        let rest = &self.bytes[self.at..];
        let len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if len == 0
            || (len > 1 && rest[0] == b'0')
            || matches!(rest.get(len), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        let mut n: u64 = 0;
        for digit in &rest[..len] {
            n = n.checked_mul(10)?.checked_add(u64::from(digit - b'0'))?;
        }
        self.at += len;
        Some(n)
    }

    /// Any value, not validated: a string, a nested object or array (to its matching
    /// end), or a number or literal (to the next delimiter).
    fn skip(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string_value(),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match *self.bytes.get(self.at)? {
                        b'"' => {
                            self.string_value()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.at += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.at += 1;
                }
            }
            _ => {
                let rest = &self.bytes[self.at..];
                let len = rest
                    .iter()
                    .position(|&b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                    .unwrap_or(rest.len());
                self.at += len;
                (len > 0).then_some(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What serde alone makes of `data`.
    fn by_serde(data: &[u8]) -> Option<Frame> {
        let mut frame = Frame::default();
        parse(data, &mut frame).then_some(frame)
    }

    /// What a reader that has read nothing before makes of `data`.
    fn alone(data: &[u8]) -> Option<Frame> {
        Reader::default().read(data).cloned()
    }

    fn by_walk(data: &[u8]) -> Option<Frame> {
        let mut frame = Frame::default();
        walk(&mut Walk::new(data), &mut frame).map(|()| frame)
    }

    /// Well-formed frames of every shape the meter meets, and some it should not.
    const FRAMES: &[&str] = &[
        r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" can","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}],"usage":null}"#,
        r#"{"id":"c","choices":[],"usage":{"prompt_tokens":6,"total_tokens":9,"completion_tokens":3}}"#,
        r#"{"choices":[{"index":1,"text":"a","logprobs":{"text_offset":[0,2],"token_logprobs":[-0.5,-1e-3],"tokens":[" b"," c"],"top_logprobs":[{" b":-0.5,"}":-2.0},{"\"":-1.5}]}}]}"#,
        r#"{"choices":[{"index":2,"text":"x"},{"index":0,"text":"y","logprobs":{}}],"usage":{"prompt_tokens":1,"completion_tokens":18446744073709551615}}"#,
        r#" { "choices" : [ { "text" : "q\"}]\\" , "index" : 3 } ] , "usage" : null } "#,
        r#"{"choices":[{"text":"no index"}],"extra":{"nested":[1,{"a":[true,false,null]}]},"usage":{"completion_tokens":2,"prompt_tokens":5}}"#,
        r#"{"error":{"message":"x","code":400}}"#,
        r#"{}"#,
        // Left to serde, or refused by it:
        r#"{"choices":[{"index":-1}]}"#,
        r#"{"choices":[{"index":1.0}]}"#,
        r#"{"choices":[{"index":1e2}]}"#,
        r#"{"choices":[{"index":18446744073709551616}]}"#,
        r#"{"choices":[{"index":"1"}]}"#,
        r#"{"choices":null}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":1}}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"completion_tokens":3}}"#,
        r#"{"choices":[],"choices":[]}"#,
        r#"{"choices":[{"index":0,"index":1}]}"#,
        r#"{"choices":[{"logprobs":{"tokens":null}}]}"#,
        r#"{"\u0075sage":{"prompt_tokens":1,"completion_tokens":2},"choices":[]}"#,
        r#"{"choices":[]} trailing"#,
        r#"[1,2]"#,
    ];

    #[test]
    fn the_walk_reads_every_frame_it_accepts_as_serde_does() {
        for data in FRAMES {
            let serde = by_serde(data.as_bytes());
            if let Some(walked) = by_walk(data.as_bytes()) {
                assert_eq!(Some(walked), serde, "{data}");
            }
            assert_eq!(alone(data.as_bytes()), serde, "{data}");
        }
    }

    #[test]
    fn vllm_frames_are_read_by_the_walk_itself() {
        for data in &FRAMES[..6] {
            assert!(by_walk(data.as_bytes()).is_some(), "{data}");
        }
        let usage = by_walk(FRAMES[1].as_bytes()).unwrap();
        assert_eq!(
            usage,
            Frame {
                choices: vec![],
                usage: Some(Counts {
                    prompt_tokens: 6,
                    completion_tokens: 3
                })
            }
        );
        let logprobs = by_walk(FRAMES[2].as_bytes()).unwrap();
        assert_eq!(
            logprobs.choices,
            [Choice {
                index: 1,
                logprob_tokens: Some(2)
            }]
        );
    }

    /// A random JSON value built from the keys and values a frame has, `depth` deep.
    /// xorshift: a reproducible random number below `n`, without a dependency.
    fn next(seed: &mut u64, n: u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed % n
    }

    fn random_value(seed: &mut u64, depth: u32) -> serde_json::Value {
        use serde_json::{Value, json};
        const KEYS: &[&str] = &[
            "choices",
            "usage",
            "index",
            "logprobs",
            "tokens",
            "prompt_tokens",
            "completion_tokens",
            "text",
            "\"}]",
            "",
        ];
        match next(seed, if depth == 0 { 6 } else { 9 }) {
            0 => Value::Null,
            1 => json!(next(seed, 3) == 0),
            2 => json!(next(seed, u64::MAX)),
            3 => json!(-(next(seed, 100) as i64)),
            4 => json!(next(seed, 1000) as f64 / 8.0),
            5 => json!(["\"", "\\", "}", "é", "\u{1}"][next(seed, 5) as usize]),
            6 | 7 => {
                let len = next(seed, 4);
                Value::Object(
                    (0..len)
                        .map(|_| {
                            let key = KEYS[next(seed, KEYS.len() as u64) as usize].to_string();
                            (key, random_value(seed, depth - 1))
                        })
                        .collect(),
                )
            }
            _ => Value::Array(
                (0..next(seed, 4))
                    .map(|_| random_value(seed, depth - 1))
                    .collect(),
            ),
        }
    }

    #[test]
    fn random_json_reads_the_same_by_the_walk_and_by_serde() {
        let mut seed = 0x9E37_79B9_7F4A_7C15;
        let mut walked = 0;
        for _ in 0..20_000 {
            let data = random_value(&mut seed, 4).to_string();
            let serde = by_serde(data.as_bytes());
            if let Some(frame) = by_walk(data.as_bytes()) {
                walked += 1;
                assert_eq!(Some(frame), serde, "{data}");
            }
            assert_eq!(alone(data.as_bytes()), serde, "{data}");
        }
        assert!(
            walked > 1_000,
            "the walk read only {walked} of the frames itself"
        );
    }

    #[test]
    fn a_usage_object_reads_as_serde_reads_it() {
        let by_serde = |data: &str| {
            let mut values =
                serde_json::Deserializer::from_slice(data.as_bytes()).into_iter::<Counts>();
            values.next().and_then(Result::ok)
        };
        let usages = [
            r#"{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2,"prompt_tokens_details":null},"kv_transfer_params":null}"#,
            r#" { "completion_tokens" : 0 , "prompt_tokens" : 18446744073709551615 } }"#,
            r#"{"\u0070rompt_tokens":1,"completion_tokens":2}}"#,
            r#"{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens":3}"#,
            r#"{"prompt_tokens":1}"#,
            r#"{"prompt_tokens":1,"completion_tokens":-2}"#,
            r#"null,"x":1}"#,
            r#"[]"#,
        ];
        for data in usages {
            assert_eq!(usage(data.as_bytes()), by_serde(data), "{data}");
        }
        assert_eq!(
            usage(usages[0].as_bytes()),
            Some(Counts {
                prompt_tokens: 7,
                completion_tokens: 2
            })
        );
        // Objects of usage's keys and others, most values counts, some anything.
        const KEYS: &[&str] = &[
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "prompt_tokens_details",
        ];
        let (mut seed, mut read) = (0x2545_F491_4F6C_DD1D, 0);
        for _ in 0..20_000 {
            let object: serde_json::Map<_, _> = (0..next(&mut seed, 5))
                .map(|_| {
                    let key = KEYS[next(&mut seed, KEYS.len() as u64) as usize].to_string();
                    let value = if next(&mut seed, 4) == 0 {
                        random_value(&mut seed, 1)
                    } else {
                        serde_json::json!(next(&mut seed, u64::MAX))
                    };
                    (key, value)
                })
                .collect();
            let data = format!("{}, \"then\": 1}}", serde_json::Value::Object(object));
            let counts = usage(data.as_bytes());
            assert_eq!(counts, by_serde(&data), "{data}");
            read += usize::from(counts.is_some());
        }
        assert!(
            read > 2_000,
            "only {read} random objects were usage objects"
        );
    }

    #[test]
    fn every_cut_of_a_frame_reads_as_serde_reads_it_or_not_at_all() {
        for data in &FRAMES[..6] {
            for cut in 0..data.len() {
                let part = &data.as_bytes()[..cut];
                let read = alone(part);
                // A cut frame is not JSON; whatever the walk makes of it must not panic,
                // and where serde reads it the two agree.
                if let Some(serde) = by_serde(part) {
                    assert_eq!(read, Some(serde), "{data} cut at {cut}");
                }
            }
        }
    }

    /// Checks what a [`Reader`] that has read `before` makes of `data` against what a
    /// reader makes of it alone; true when the reader did not walk it.
    fn reader_agrees(before: &[u8], data: &[u8]) -> bool {
        let mut reader = Reader::default();
        reader.read(before);
        let unwalked = !reader.last.is_empty() && reader.differs_inside_one_string(data);
        let expected = alone(data);
        let got = reader.read(data).cloned();
        assert_eq!(
            got,
            expected,
            "{} after {}",
            String::from_utf8_lossy(data),
            String::from_utf8_lossy(before)
        );
        unwalked
    }

    /// `data` with the inside of its `n`th string value (as the walk notes them)
    /// replaced by `inside`.
    fn with_string(data: &[u8], n: usize, inside: &[u8]) -> Option<Vec<u8>> {
        let mut json = Walk::new(data);
        walk(&mut json, &mut Frame::default())?;
        let string = json.strings.get(n)?.clone();
        Some([&data[..string.start], inside, &data[string.end..]].concat())
    }

    #[test]
    fn a_frame_with_only_its_text_changed_is_read_without_a_walk() {
        let first = FRAMES[0].as_bytes();
        // The text is the fourth string value: id, object, model, then in the choice.
        let next = with_string(first, 3, br#"a \\\" }], \"usage\": {"#).unwrap();
        assert!(String::from_utf8_lossy(&next).contains(r#""text":"a \\\" }], \"usage\": {","#));
        assert!(reader_agrees(first, &next), "not read as the same frame");
        assert!(reader_agrees(first, first));
        // A change outside a string, a key's, or inside two strings is walked.
        for other in [
            FRAMES[0].replace("\"index\":0", "\"index\":1"),
            FRAMES[0].replace("\"usage\":null", "\"usagf\":null"),
            FRAMES[0]
                .replace("cmpl-1", "cmpl-2")
                .replace(" can", " could"),
            // The text and, after it, what the frame says, with the length kept.
            FRAMES[0]
                .replace(" can", " cat")
                .replace(r#""logprobs":null"#, r#""logprobs":{}  "#),
        ] {
            assert!(!reader_agrees(first, other.as_bytes()), "{other}");
        }
        // A new inside that ends early, or runs past the old closing quote, is walked.
        for inside in [
            &br#"a"}],"usage":{"prompt_tokens":1,"completion_tokens":2},"x":{"y":""#[..],
            br"b\",
        ] {
            let next = with_string(first, 3, inside).unwrap();
            assert!(
                !reader_agrees(first, &next),
                "{}",
                String::from_utf8_lossy(&next)
            );
        }
    }

    #[test]
    fn a_reader_reads_every_frame_as_the_frame_alone_reads() {
        const INSIDES: &[&[u8]] = &[
            b"",
            b"x",
            b"\"",
            b"\\\"",
            b"\\",
            b"\\\\",
            b"\\",
            b"\"}]",
            b"\",\"usage\":null",
            b"\xc3\xa9",
            b"\x01",
        ];
        let mut seed = 0x3C6E_F372_FE94_F82B;
        let mut same = 0;
        for round in 0..20_000 {
            let before = if round % 2 == 0 {
                FRAMES[next(&mut seed, FRAMES.len() as u64) as usize].to_string()
            } else {
                random_value(&mut seed, 4).to_string()
            };
            let before = before.as_bytes();
            // Another frame, or this one with a string's inside changed to pieces that
            // may end it early or escape its quote.
            let data = match next(&mut seed, 4) {
                0 => random_value(&mut seed, 4).to_string().into_bytes(),
                _ => {
                    let inside: Vec<u8> = (0..next(&mut seed, 4))
                        .flat_map(|_| INSIDES[next(&mut seed, INSIDES.len() as u64) as usize])
                        .copied()
                        .collect();
                    let n = next(&mut seed, 8) as usize;
                    with_string(before, n, &inside).unwrap_or_else(|| before.to_vec())
                }
            };
            same += usize::from(reader_agrees(before, &data));
        }
        assert!(same > 2_000, "only {same} frames were read without a walk");
    }
}
