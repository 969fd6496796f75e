//! HTTP/2 frames written by hand, for clients that must stop at a chosen point (a
//! connection preface and then nothing; a request head whose body never comes).

/// HTTP/2's connection preface, then an empty SETTINGS frame: all a client must send
/// before its first request.
pub fn h2_preface() -> Vec<u8> {
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    bytes.extend(h2_frame(0x4, 0, 0, &[]));
    bytes
}

/// One HTTP/2 frame (RFC 9113 4.1).
pub fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend(stream.to_be_bytes());
    frame.extend(payload);
    frame
}
