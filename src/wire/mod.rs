//! The hand-written wire code: where a general-purpose library was measured to cost
//! too much on the request path, fleetgate reads or writes the format itself. Each
//! module imports nothing of fleetgate's outside `wire`, and says why it exists:
//!
//! - `h1`: the HTTP/1.1 client that forwards completions to `http://` nodes;
//! - `resp`: the RESP client the Redis limiter's scripts run on, on
//! - `redis_stream`: the stream every Redis connection runs on (plain TCP, a Unix
//!   socket, TLS);
//! - `sse_frame`: one SSE frame of a completion stream, its token fields read in one
//!   pass (the stream meter's);
//! - `log_line`: a text log line and its fields, byte for byte what tracing-subscriber's
//!   default format writes.
//!
//! The coverage-guided fuzz targets (`fuzz/`) drive the SSE frame reader through the
//! stream meter.

pub(crate) mod h1;
pub(crate) mod log_line;
pub(crate) mod redis_stream;
pub(crate) mod resp;
pub mod sse_frame;
