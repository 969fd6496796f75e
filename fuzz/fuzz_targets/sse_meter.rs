//! The SSE meter (`Meter::sse`): an upstream stream, arriving in chunks, relayed to the
//! client while its frames are counted.
//!
//! Input: byte 0 is how many chunk lengths follow (one byte each, 0 = an empty chunk);
//! the rest is the stream, and what the lengths leave of it is the last chunk. So a
//! seed is `\0` followed by the stream as vLLM sends it.
//!
//! Checked, for the client asking for the usage frame and not:
//! - nothing panics;
//! - what is relayed and counted does not depend on the chunking: the stream whole,
//!   byte by byte and in the chunks the input chose give the same, and so do those
//!   chunks gathered (three pushed before each take, as the relay gathers what the
//!   upstream has delivered, into a room smaller than most inputs);
//! - the counts do not depend on whether the client asked for the usage frame;
//! - asked for, the stream is relayed byte for byte;
//! - not asked for, bytes are only dropped (never added or reordered), and only once a
//!   usage frame was read; and what the client gets holds no usage frame the meter
//!   would drop.
//!
//! Inputs stay far below the meter's 1 MiB frame bound (libFuzzer's default `-max_len`
//! is 4 KiB): past it a frame is passed on unread, where the chunks happen to cut it.

#![no_main]

use bytes::Bytes;
use fleetgate::completion::meter::{Counts, Meter};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (lengths, stream) = match data.split_first() {
        Some((&count, rest)) => rest.split_at(usize::from(count).min(rest.len())),
        None => return,
    };

    let [dropping, forwarding] = [false, true].map(|forward_usage| {
        let whole = relay(forward_usage, [stream], 1);
        let chosen = relay(forward_usage, chunks(stream, lengths), 1);
        assert_eq!(whole, chosen, "whole vs chosen chunks {lengths:?}");
        let gathered = relay(forward_usage, chunks(stream, lengths), 3);
        assert_eq!(whole, gathered, "whole vs chosen chunks gathered {lengths:?}");
        whole
    });
    // The slowest split, once: whether the usage frame is forwarded changes what is
    // emitted, not where frames end.
    let bytewise = relay(false, stream.chunks(1), 1);
    assert_eq!(dropping, bytewise, "whole vs byte by byte");

    assert_eq!(
        (dropping.reported, dropping.generated),
        (forwarding.reported, forwarding.generated)
    );
    assert!(forwarding.relayed == stream, "not relayed byte for byte");
    assert!(
        is_subsequence(&dropping.relayed, stream),
        "bytes added or moved"
    );
    if dropping.reported.is_none() {
        assert!(
            dropping.relayed == stream,
            "dropped bytes without a usage frame"
        );
    }
    let again = relay(false, [dropping.relayed.as_slice()], 1);
    assert!(
        again.relayed == dropping.relayed,
        "a usage frame reached the client"
    );
});

#[derive(Debug, PartialEq)]
struct Outcome {
    relayed: Vec<u8>,
    reported: Option<Counts>,
    generated: u64,
}

/// The room a gather is given: less than most inputs, so that gathers outgrow it too.
const GATHER_ROOM: usize = 64;

/// `chunks` through a meter, taking what it gives after every `gathered` pushes.
fn relay<'a>(
    forward_usage: bool,
    chunks: impl IntoIterator<Item = &'a [u8]>,
    gathered: usize,
) -> Outcome {
    let mut meter = Meter::sse(forward_usage, GATHER_ROOM);
    let mut relayed = Vec::new();
    for (i, chunk) in chunks.into_iter().enumerate() {
        meter.push(Bytes::copy_from_slice(chunk));
        if (i + 1) % gathered == 0 {
            relayed.extend_from_slice(&meter.take());
        }
    }
    relayed.extend_from_slice(&meter.take());
    relayed.extend_from_slice(&meter.finish());
    Outcome {
        relayed,
        reported: meter.reported(),
        generated: meter.generated(),
    }
}

/// `stream` cut after each of `lengths` (as far as it goes), then the rest.
fn chunks<'a>(mut stream: &'a [u8], lengths: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(lengths.len() + 1);
    for &length in lengths {
        let (chunk, rest) = stream.split_at(usize::from(length).min(stream.len()));
        out.push(chunk);
        stream = rest;
    }
    out.push(stream);
    out
}

fn is_subsequence(small: &[u8], big: &[u8]) -> bool {
    let mut big = big.iter();
    small.iter().all(|b| big.any(|c| c == b))
}
