//! The JSON meter (`Meter::json`): a non-streaming body relayed as it arrives, its last
//! 16 KiB kept to read `usage` from when it ends.
//!
//! Input: byte 0 is a number of 128-byte runs of spaces to insert into the body (up to
//! 32 KiB, so bodies cross the kept tail's bound), byte 1 where to insert them as a
//! fraction of the body (0 = the front, 255 = the end), byte 2 how many chunk lengths
//! follow (two bytes each, little-endian); the rest is the body. So a seed is `\0\0\0`
//! followed by the body as vLLM sends it.
//!
//! Checked: nothing panics; every chunk is relayed as it came and nothing is held
//! back; the usage read does not depend on the chunking (the body whole, in 4 KiB
//! chunks and in the chunks the input chose).

#![no_main]

use bytes::Bytes;
use fleetgate::completion::meter::{Counts, Meter};
use libfuzzer_sys::fuzz_target;

const PAD_RUN: usize = 128;

fuzz_target!(|data: &[u8]| {
    let [runs, at, count, rest @ ..] = data else {
        return;
    };
    let (lengths, body) = rest.split_at((usize::from(*count) * 2).min(rest.len()));
    let at = body.len() * usize::from(*at) / 255;
    let body = [
        &body[..at],
        &vec![b' '; usize::from(*runs) * PAD_RUN],
        &body[at..],
    ]
    .concat();

    let whole = relay(&body, [body.as_slice()]);
    assert_eq!(
        whole,
        relay(&body, body.chunks(4096)),
        "whole vs 4 KiB chunks"
    );
    assert_eq!(
        whole,
        relay(&body, chunks(&body, lengths)),
        "whole vs {lengths:?}"
    );
});

/// Feeds `chunks` (which make up `body`); the usage the meter read.
fn relay<'a>(body: &[u8], chunks: impl IntoIterator<Item = &'a [u8]>) -> Option<Counts> {
    let mut meter = Meter::json();
    let mut relayed = Vec::with_capacity(body.len());
    for chunk in chunks {
        meter.push(Bytes::copy_from_slice(chunk));
        let out = meter.take();
        assert!(out == chunk, "a chunk not relayed as it came");
        relayed.extend_from_slice(&out);
    }
    assert!(meter.finish().is_empty());
    assert_eq!(relayed, body);
    assert_eq!(meter.generated(), 0);
    meter.reported()
}

/// `body` cut after each little-endian `u16` of `lengths` (as far as it goes), then the
/// rest.
fn chunks<'a>(mut body: &'a [u8], lengths: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(lengths.len() / 2 + 1);
    for length in lengths.chunks_exact(2) {
        let length = usize::from(u16::from_le_bytes([length[0], length[1]]));
        let (chunk, rest) = body.split_at(length.min(body.len()));
        out.push(chunk);
        body = rest;
    }
    out.push(body);
    out
}
