//! Metering a response while relaying it, without re-shaping it.
//!
//! - **SSE**: the upstream is always asked for `include_usage`, so its usage-only frame
//!   (`"choices":[]`) tells the real totals. The frame is dropped when the client did not
//!   ask for it; every other byte passes unchanged, frame by frame as each completes.
//!   Content frames are counted too, so a stream cut short (client gone, upstream died)
//!   is still charged what was generated.
//! - **JSON**: vLLM puts `usage` at the end of the body; the last few KiB are kept and
//!   read when the body ends. Memory stays bounded whatever the body size.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};

use crate::wire::sse_frame;
pub use crate::wire::sse_frame::Counts;

/// A frame longer than this without its terminator is passed through unread.
const MAX_FRAME: usize = 1 << 20;
/// How much of a JSON body's end is kept to find `usage` in.
const JSON_TAIL: usize = 16 * 1024;

pub enum Meter {
    Sse(SseMeter),
    Json(JsonMeter),
}

pub struct SseMeter {
    /// The one chunk pushed since the last take while nothing else was pending: a
    /// stream at a realistic pace arrives a frame per chunk, which then leaves as it
    /// came, without a copy.
    fresh: Option<Bytes>,
    /// Bytes taken from the upstream and not yet given to the client: whole frames
    /// first, then the start of an incomplete one.
    pending: BytesMut,
    /// Room made in `pending` at once when a second chunk comes before a take (the
    /// relay is gathering what the upstream has delivered): one allocation a gather,
    /// instead of a buffer that doubles as it fills, copying what it holds each time.
    gather_room: usize,
    reader: FrameReader,
}

/// Reads frames as they complete, each byte looked at once.
struct FrameReader {
    /// Whether the client asked for the usage-only frame.
    forward_usage: bool,
    /// Where the next frame ends, in the bytes after the last one read.
    frames: FrameEnds,
    tally: Tally,
}

/// What a stream's frames said about its tokens.
#[derive(Default)]
struct Tally {
    /// Reads each frame (and remembers the last, see [`sse_frame::Reader`]).
    reader: sse_frame::Reader,
    usage: Option<Counts>,
    /// Tokens seen per choice index (from logprobs, running usage, or one per frame);
    /// a B-tree, as a stream has a choice or a few and hashing the index per frame cost
    /// more than finding it.
    generated: BTreeMap<u64, u64>,
}

#[derive(Default)]
pub struct JsonMeter {
    tail: Vec<u8>,
    /// Chunks taken and not yet given to the client.
    held: Vec<Bytes>,
}

impl Meter {
    /// `gather_room`: how many bytes the relay gathers before it takes them.
    pub fn sse(forward_usage: bool, gather_room: usize) -> Self {
        Self::Sse(SseMeter {
            fresh: None,
            pending: BytesMut::new(),
            gather_room,
            reader: FrameReader {
                forward_usage,
                frames: FrameEnds::default(),
                tally: Tally::default(),
            },
        })
    }

    pub fn json() -> Self {
        Self::Json(JsonMeter::default())
    }

    /// Takes bytes from the upstream; [`Meter::take`] gives what the client may have.
    pub fn push(&mut self, chunk: Bytes) {
        match self {
            Self::Sse(sse) => sse.push(chunk),
            Self::Json(json) => {
                json.keep(&chunk);
                json.held.push(chunk);
            }
        }
    }

    /// The bytes pushed so far and not yet taken.
    pub fn held(&self) -> usize {
        match self {
            Self::Sse(sse) => sse.pending.len() + sse.fresh.as_ref().map_or(0, Bytes::len),
            Self::Json(json) => json.held.iter().map(Bytes::len).sum(),
        }
    }

    /// The bytes for the client, in one piece: every complete frame pushed so far
    /// (possibly none while a frame is incomplete), or every JSON chunk.
    pub fn take(&mut self) -> Bytes {
        match self {
            Self::Sse(sse) => sse.take(),
            Self::Json(json) => match json.held.len() {
                0 => Bytes::new(),
                1 => json.held.pop().unwrap_or_default(),
                _ => Bytes::from(json.held.drain(..).collect::<Vec<_>>().concat()),
            },
        }
    }

    /// At the end of the upstream body: whatever is still held back.
    pub fn finish(&mut self) -> Bytes {
        match self {
            Self::Sse(sse) => {
                if let Some(fresh) = sse.fresh.take() {
                    sse.pending.extend_from_slice(&fresh);
                }
                sse.pending.split().freeze()
            }
            Self::Json(_) => self.take(),
        }
    }

    /// The usage the upstream reported, if it got that far.
    pub fn reported(&self) -> Option<Counts> {
        match self {
            Self::Sse(sse) => sse.reader.tally.usage,
            Self::Json(json) => json.usage(),
        }
    }

    /// Completion tokens counted from the frames relayed (streams only): a lower bound
    /// where one frame carried several tokens and no logprobs.
    pub fn generated(&self) -> u64 {
        match self {
            Self::Sse(sse) => sse
                .reader
                .tally
                .generated
                .values()
                .fold(0, |sum, n| sum.saturating_add(*n)),
            Self::Json(_) => 0,
        }
    }
}

impl SseMeter {
    fn push(&mut self, chunk: Bytes) {
        if self.pending.is_empty() && self.fresh.is_none() {
            self.fresh = Some(chunk);
            return;
        }
        if let Some(fresh) = self.fresh.take() {
            self.pending.reserve(self.gather_room);
            self.pending.extend_from_slice(&fresh);
        }
        self.pending.extend_from_slice(&chunk);
    }

    /// Splits the complete frames off what was pushed. They leave as one slice of it,
    /// without a copy, unless the usage-only frame has to be cut out from between them.
    fn take(&mut self) -> Bytes {
        let Some(fresh) = self.fresh.take() else {
            return self.take_pending(BytesMut::new());
        };
        match self.reader.read(&fresh) {
            (passed, None) => {
                if fresh.len() - passed > MAX_FRAME {
                    self.reader.frames = FrameEnds::default();
                    return fresh;
                }
                self.pending.extend_from_slice(&fresh[passed..]);
                fresh.slice(..passed)
            }
            (passed, Some(dropped_end)) => {
                self.pending.extend_from_slice(&fresh[dropped_end..]);
                self.take_pending(BytesMut::from(&fresh[..passed]))
            }
        }
    }

    /// [`SseMeter::take`] from `pending`, after `spliced`: the frames already passed.
    fn take_pending(&mut self, mut spliced: BytesMut) -> Bytes {
        loop {
            let (mut passed, dropped) = self.reader.read(&self.pending);
            if let Some(dropped_end) = dropped {
                spliced.extend_from_slice(&self.pending[..passed]);
                let _dropped = self.pending.split_to(dropped_end);
                continue;
            }
            if self.pending.len() - passed > MAX_FRAME {
                passed = self.pending.len();
                self.reader.frames = FrameEnds::default();
            }
            // Taken whole, the buffer goes with the bytes instead of staying with the
            // meter: a stream gathers rarely or not at all between its gathers.
            let passed = if passed == self.pending.len() {
                std::mem::take(&mut self.pending)
            } else {
                self.pending.split_to(passed)
            };
            if spliced.is_empty() {
                return passed.freeze();
            }
            spliced.extend_from_slice(&passed);
            return spliced.freeze();
        }
    }
}

impl FrameReader {
    /// Reads the complete frames at the start of `bytes` up to the first one the client
    /// does not get (the usage-only frame, unless asked for): how many bytes pass
    /// before it, and where it ends.
    fn read(&mut self, bytes: &[u8]) -> (usize, Option<usize>) {
        let mut passed = 0;
        while let Some(len) = self.frames.next_end(&bytes[passed..]) {
            let end = passed + len;
            if !self.tally.observe(&bytes[passed..end]) && !self.forward_usage {
                return (passed, Some(end));
            }
            passed = end;
        }
        (passed, None)
    }
}

impl Tally {
    /// Reads one frame; returns false for the usage-only frame.
    fn observe(&mut self, frame: &[u8]) -> bool {
        let Some(data) = frame_data(frame) else {
            return true;
        };
        let Some(chunk) = self.reader.read(data) else {
            return true;
        };
        if chunk.choices.is_empty()
            && let Some(usage) = chunk.usage
        {
            self.usage = Some(usage);
            return false;
        }
        // Saturating: the counts are the upstream's, and any u64 parses.
        for choice in &chunk.choices {
            let seen = self.generated.entry(choice.index).or_default();
            *seen = match (&chunk.usage, choice.logprob_tokens) {
                // Running usage (continuous_usage_stats) is cumulative per choice.
                (Some(usage), _) => (*seen).max(usage.completion_tokens),
                (None, Some(tokens)) => seen.saturating_add(tokens),
                (None, None) => seen.saturating_add(1),
            };
        }
        true
    }
}

impl JsonMeter {
    fn keep(&mut self, chunk: &[u8]) {
        if chunk.len() >= JSON_TAIL {
            self.tail.clear();
            self.tail
                .extend_from_slice(&chunk[chunk.len() - JSON_TAIL..]);
            return;
        }
        let overflow = (self.tail.len() + chunk.len()).saturating_sub(JSON_TAIL);
        self.tail.drain(..overflow);
        self.tail.extend_from_slice(chunk);
    }

    /// The last `"usage":{…}` object of the body.
    fn usage(&self) -> Option<Counts> {
        const KEY: &[u8] = b"\"usage\":";
        let at = memchr::memmem::rfind(&self.tail, KEY)?;
        sse_frame::usage(&self.tail[at + KEY.len()..])
    }
}

/// The JSON payload of a `data: …` frame, `None` for `[DONE]`, comments and others.
fn frame_data(frame: &[u8]) -> Option<&[u8]> {
    let text = frame.strip_prefix(b"data:")?;
    let text = text.strip_prefix(b" ").unwrap_or(text);
    let end = text.iter().rposition(|b| !b.is_ascii_whitespace())? + 1;
    let data = &text[..end];
    (data.first() == Some(&b'{')).then_some(data)
}

/// Finds where SSE events end: at a blank line, lines being ended by `\n`, `\r\n` or
/// `\r` (so `\n\n`, `\r\n\r\n` and `\r\r` all end one). It resumes where it stopped,
/// so each byte of a frame is looked at once however many chunks the frame arrives in.
#[derive(Default)]
struct FrameEnds {
    /// Bytes of the pending frame already looked at.
    scanned: usize,
    state: LineState,
}

#[derive(Default, Clone, Copy)]
enum LineState {
    #[default]
    InLine,
    /// A line just ended.
    LineEnded,
    /// A line just ended with `\r`; a `\n` next belongs to the same line end.
    CrEnded,
    /// A blank line just ended with `\r`: the frame is over, and a `\n` next is still
    /// part of it.
    BlankCr,
}

impl FrameEnds {
    /// The length of the first complete frame in `pending` (which the caller then
    /// splits off), if there is one yet.
    fn next_end(&mut self, pending: &[u8]) -> Option<usize> {
        while self.scanned < pending.len() {
            if matches!(self.state, LineState::InLine) {
                // Inside a line only its end matters: skip to it.
                match memchr::memchr2(b'\n', b'\r', &pending[self.scanned..]) {
                    Some(at) => self.scanned += at,
                    None => {
                        self.scanned = pending.len();
                        return None;
                    }
                }
            }
            let (state, end) = match (self.state, pending[self.scanned]) {
                (LineState::BlankCr, b'\n') => (LineState::InLine, Some(self.scanned + 1)),
                (LineState::BlankCr, _) => (LineState::InLine, Some(self.scanned)),
                (LineState::LineEnded, b'\n') => (LineState::InLine, Some(self.scanned + 1)),
                (LineState::LineEnded | LineState::CrEnded, b'\r') => (LineState::BlankCr, None),
                (LineState::CrEnded, b'\n') => (LineState::LineEnded, None),
                (_, b'\n') => (LineState::LineEnded, None),
                (_, b'\r') => (LineState::CrEnded, None),
                _ => (LineState::InLine, None),
            };
            self.state = state;
            if let Some(end) = end {
                self.scanned = 0;
                return Some(end);
            }
            self.scanned += 1;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTENT: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\" a\",\"logprobs\":null}],\"usage\":null}\n\n";
    const CONTENT_1: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"text\":\" b\",\"logprobs\":{\"tokens\":[\" b\",\" c\"]}}],\"usage\":null}\n\n";
    const USAGE: &str = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"total_tokens\":6,\"completion_tokens\":3}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn feed(meter: &mut Meter, piece: impl Into<Bytes>) -> Bytes {
        meter.push(piece.into());
        meter.take()
    }

    fn run(meter: &mut Meter, pieces: &[&str]) -> String {
        let mut out = Vec::new();
        for piece in pieces {
            out.extend_from_slice(&feed(meter, piece.to_string()));
        }
        out.extend_from_slice(&meter.finish());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn usage_frame_is_read_and_kept_when_asked_for() {
        let mut meter = Meter::sse(true, 0);
        let out = run(&mut meter, &[CONTENT, CONTENT_1, USAGE, DONE]);
        assert_eq!(out, [CONTENT, CONTENT_1, USAGE, DONE].concat());
        assert_eq!(
            meter.reported(),
            Some(Counts {
                prompt_tokens: 3,
                completion_tokens: 3
            })
        );
        assert_eq!(meter.generated(), 3);
    }

    #[test]
    fn frames_pushed_before_a_take_leave_in_one_piece_without_the_usage_frame() {
        let mut meter = Meter::sse(false, 0);
        let partial = &CONTENT[..20];
        for piece in [CONTENT, CONTENT_1, USAGE, DONE, partial] {
            meter.push(Bytes::from(piece));
        }
        let out = meter.take();
        assert_eq!(out, [CONTENT, CONTENT_1, DONE].concat());
        assert_eq!(meter.held(), partial.len(), "the incomplete frame waits");
        assert_eq!(meter.reported().map(|u| u.completion_tokens), Some(3));
        assert_eq!(meter.generated(), 3);
    }

    #[test]
    fn a_chunk_of_whole_frames_leaves_as_a_slice_of_itself() {
        let mut meter = Meter::sse(false, 0);
        let chunk = Bytes::from([CONTENT, CONTENT_1, &CONTENT[..20]].concat());
        meter.push(chunk.clone());
        let out = meter.take();
        assert_eq!(out, [CONTENT, CONTENT_1].concat());
        assert_eq!(out.as_ptr(), chunk.as_ptr(), "not copied");
        assert_eq!(meter.held(), 20, "the incomplete frame waits");
        assert_eq!(feed(&mut meter, &CONTENT.as_bytes()[20..]), CONTENT);
        assert_eq!(meter.generated(), 4);
    }

    #[test]
    fn json_chunks_pushed_before_a_take_leave_in_one_piece() {
        let mut meter = Meter::json();
        meter.push(Bytes::from_static(b"{\"usage\":"));
        meter.push(Bytes::from_static(
            b"{\"prompt_tokens\":1,\"completion_tokens\":2}}",
        ));
        assert_eq!(meter.held(), 51);
        assert_eq!(
            meter.take(),
            "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}"
        );
        assert_eq!((meter.held(), meter.take().len()), (0, 0));
        assert_eq!(meter.reported().map(|u| u.completion_tokens), Some(2));
    }

    #[test]
    fn usage_frame_is_dropped_when_not_asked_for_even_split_across_chunks() {
        let mut meter = Meter::sse(false, 0);
        let all = [CONTENT, USAGE, DONE].concat();
        let (a, b) = all.split_at(CONTENT.len() + 10);
        let (b, c) = b.split_at(30);
        let out = run(&mut meter, &[a, b, c]);
        assert_eq!(out, [CONTENT, DONE].concat());
        assert_eq!(meter.reported().unwrap().completion_tokens, 3);
    }

    #[test]
    fn a_cut_stream_is_counted_from_its_frames() {
        let mut meter = Meter::sse(false, 0);
        run(&mut meter, &[CONTENT, CONTENT, CONTENT_1]);
        assert_eq!(meter.reported(), None);
        assert_eq!(meter.generated(), 4);
    }

    #[test]
    fn absurd_running_usage_saturates_the_count() {
        let huge = |index: u64| {
            format!(
                "data: {{\"choices\":[{{\"index\":{index}}}],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{}}}}}\n\n",
                u64::MAX
            )
        };
        let mut meter = Meter::sse(false, 0);
        // One more token on a choice at u64::MAX, and two choices at u64::MAX.
        run(&mut meter, &[&huge(0), CONTENT, &huge(1)]);
        assert_eq!(meter.generated(), u64::MAX);
    }

    #[test]
    fn error_events_and_comments_pass_unchanged() {
        let error = "data: {\"error\": {\"message\": \"x\", \"code\": 400}}\n\n";
        let mut meter = Meter::sse(false, 0);
        let out = run(&mut meter, &[": keep-alive\n\n", error, DONE]);
        assert_eq!(out, [": keep-alive\n\n", error, DONE].concat());
    }

    /// The stream with every `\n\n` frame end replaced by `end`.
    fn with_frame_ends(frames: &[&str], end: &str) -> Vec<String> {
        frames.iter().map(|f| f.replace("\n\n", end)).collect()
    }

    #[test]
    fn frames_end_at_any_blank_line_sse_allows_split_anywhere() {
        for end in ["\n\n", "\r\n\r\n", "\r\r", "\n\r\n", "\r\n\n"] {
            let frames = with_frame_ends(&[CONTENT, USAGE, DONE], end);
            let all = frames.concat();
            let wanted = [frames[0].as_str(), frames[2].as_str()].concat();
            // Whole, then cut at every byte: the usage frame is found and dropped each time.
            for cut in 0..=all.len() {
                let mut meter = Meter::sse(false, 0);
                let out = run(&mut meter, &[&all[..cut], &all[cut..]]);
                assert_eq!(out, wanted, "frame end {end:?}, cut at {cut}");
                assert_eq!(meter.reported().map(|u| u.completion_tokens), Some(3));
                assert_eq!(meter.generated(), 1);
            }
        }
    }

    #[test]
    fn a_frame_arriving_byte_by_byte_is_relayed_whole_once_complete() {
        let mut meter = Meter::sse(true, 0);
        let frame = CONTENT.replace("\n\n", "\r\n\r\n");
        let mut out = Vec::new();
        for (i, byte) in frame.bytes().enumerate() {
            let relayed = feed(&mut meter, vec![byte]);
            if i + 1 < frame.len() {
                assert!(relayed.is_empty(), "nothing before the frame is complete");
            }
            out.extend_from_slice(&relayed);
        }
        assert_eq!(String::from_utf8(out).unwrap(), frame);
        assert_eq!(meter.generated(), 1);
    }

    #[test]
    fn json_usage_is_read_from_the_end_of_a_large_body() {
        let mut meter = Meter::json();
        let filler = "x".repeat(100_000);
        let body = format!(
            "{{\"id\":\"c\",\"choices\":[{{\"text\":\"{filler}\"}}],\"usage\":{{\"prompt_tokens\":7,\"total_tokens\":9,\"completion_tokens\":2,\"prompt_tokens_details\":null}},\"kv_transfer_params\":null}}"
        );
        let (a, b) = body.split_at(body.len() - 40);
        let out = run(&mut meter, &[a, b]);
        assert_eq!(out, body);
        assert_eq!(
            meter.reported(),
            Some(Counts {
                prompt_tokens: 7,
                completion_tokens: 2
            })
        );
    }
}
