//! Where log lines go: a buffer in memory that a thread of its own writes to stderr,
//! so that a request never waits for the write and never wakes that thread either.
//!
//! A line is appended to the buffer under a short lock. The writer thread sleeps until
//! the first line after a quiet spell, then writes what has gathered every
//! [`FLUSH_EVERY`] for as long as lines keep coming: under steady traffic it is woken
//! by its own timer, not once per line (with a channel to the thread, every request's
//! line was a thread wake-up on its path). Nothing is dropped: past [`BUFFER_MAX`]
//! bytes not yet written, the line's own writer writes the buffer itself.
//! [`LogWriterGuard`] writes what is left when it is dropped.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

/// How long lines gather before they are written, while they keep coming.
pub const FLUSH_EVERY: Duration = Duration::from_millis(10);
/// Unwritten bytes beyond which a line's writer writes them itself.
pub const BUFFER_MAX: usize = 1 << 20;

/// The handle the log layer writes its lines through.
#[derive(Clone)]
pub struct LogWriter(Arc<Shared>);

struct Shared {
    state: Mutex<State>,
    /// Wakes the writer thread: the first line after a quiet spell, or the end.
    wake: Condvar,
    /// Where the lines go. Taken while `state` is held, so lines go out in the order
    /// they were taken from the buffer, whoever writes them.
    out: Mutex<Box<dyn Write + Send>>,
}

struct State {
    lines: Vec<u8>,
    closing: bool,
}

/// Writes out what is left, and stops the writer thread, when dropped.
#[must_use = "dropping the guard stops the log writer"]
pub struct LogWriterGuard {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// A writer to stderr and the guard of its thread.
pub fn stderr() -> io::Result<(LogWriter, LogWriterGuard)> {
    start(Box::new(io::stderr()))
}

/// A writer to `out` and the guard of its thread.
pub fn start(out: Box<dyn Write + Send>) -> io::Result<(LogWriter, LogWriterGuard)> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            lines: Vec::new(),
            closing: false,
        }),
        wake: Condvar::new(),
        out: Mutex::new(out),
    });
    let thread = {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || shared.run())?
    };
    let guard = LogWriterGuard {
        shared: Arc::clone(&shared),
        thread: Some(thread),
    };
    Ok((LogWriter(shared), guard))
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves whole lines behind (appends are single
        // calls): the buffer is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The writer thread: sleep until lines come, let them gather, write them.
    fn run(&self) {
        loop {
            let mut state = self.lock();
            while state.lines.is_empty() && !state.closing {
                state = self.wake.wait(state).unwrap_or_else(|p| p.into_inner());
            }
            if state.closing {
                self.write_out(state);
                return;
            }
            drop(state);
            std::thread::sleep(FLUSH_EVERY);
            self.write_out(self.lock());
        }
    }

    fn append(&self, line: &[u8]) {
        let mut state = self.lock();
        let was_empty = state.lines.is_empty();
        state.lines.extend_from_slice(line);
        if state.closing || state.lines.len() >= BUFFER_MAX {
            // No thread to write it any more, or the thread is behind (stderr is slow
            // to take the lines): write here rather than hold more, or drop any.
            self.write_out(state);
        } else if was_empty {
            self.wake.notify_one();
        }
    }

    /// Takes the buffered lines and writes them; a log that cannot be written has
    /// nowhere to say so.
    fn write_out(&self, mut state: MutexGuard<'_, State>) {
        if state.lines.is_empty() {
            return;
        }
        let lines = std::mem::take(&mut state.lines);
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        drop(state);
        let _ = out.write_all(&lines).and_then(|()| out.flush());
    }
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.append(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Drop for LogWriterGuard {
    fn drop(&mut self) {
        self.shared.lock().closing = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the writer thread wrote, shared with the test.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_line_is_written_whole_and_in_order_by_the_time_the_guard_is_dropped() {
        let sink = Sink::default();
        let (writer, guard) = start(Box::new(sink.clone())).unwrap_or_else(|e| panic!("{e}"));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let mut writer = writer.clone();
                std::thread::spawn(move || {
                    for i in 0..5_000 {
                        // Long enough that the buffer overflows now and then too.
                        let line = format!("thread {t} line {i} {}\n", "x".repeat(200));
                        writer
                            .write_all(line.as_bytes())
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                })
            })
            .collect();
        for thread in threads {
            thread
                .join()
                .unwrap_or_else(|_| panic!("a writing thread panicked"));
        }
        drop(guard);
        let written = String::from_utf8(sink.0.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_else(|e| panic!("{e}"));
        let mut next = [0usize; 4];
        for line in written.lines() {
            let mut words = line.split(' ');
            let (Some("thread"), Some(t), Some("line"), Some(i)) =
                (words.next(), words.next(), words.next(), words.next())
            else {
                panic!("a torn line: {line:?}");
            };
            let (t, i): (usize, usize) = (t.parse().unwrap_or(99), i.parse().unwrap_or(0));
            assert_eq!(i, next[t], "thread {t}'s lines out of order");
            next[t] += 1;
        }
        assert_eq!(next, [5_000; 4], "every line written");
    }

    #[test]
    fn a_line_after_the_guard_is_gone_is_written_at_once() {
        let sink = Sink::default();
        let (mut writer, guard) = start(Box::new(sink.clone())).unwrap_or_else(|e| panic!("{e}"));
        drop(guard);
        writer
            .write_all(b"late\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(*sink.0.lock().unwrap_or_else(|p| p.into_inner()), b"late\n");
    }
}
