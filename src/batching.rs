//! The loop both write-behind writers run (the request log, the usage ledger): rows
//! arrive on a channel, and the rows waiting are handed to the [`Sink`] (in writes of
//! at most `batch_rows` rows) once the first of them has waited `max_delay`, or as soon
//! as `batch_rows` of them wait, or when someone asks for a flush; on `stop` (or when
//! every sender is gone) the channel is closed, what is queued is drained and written,
//! and the loop ends. What a failed write does (retry, give up, drop) is the sink's own
//! policy.
//!
//! Only the first row of a batch wakes the writer: the rest wait in the channel until
//! the batch is due and are taken then, so a request hands its row over without waking
//! a task (a wake-up per row was a thread hop on every request's path). A full batch
//! ([`row_queued`]) or a flush makes it due through [`Batching::due`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

pub enum Message<R> {
    Row(R),
    /// Write everything queued before this, then answer.
    Flush(oneshot::Sender<()>),
}

/// Where batches go.
pub trait Sink<R>: Send + 'static {
    /// Writes `batch` and leaves it empty (whatever became of the rows).
    fn write(&mut self, batch: &mut Vec<R>) -> impl Future<Output = ()> + Send;
}

/// When a batch is written.
#[derive(Debug, Clone)]
pub struct Batching {
    pub batch_rows: usize,
    pub max_delay: Duration,
    /// Notified when the batch is due at once: a full batch waits ([`row_queued`]), or
    /// a [`Message::Flush`] was sent.
    pub due: Arc<Notify>,
}

/// To be called after a row was queued on `queue`: makes the batch due once a full one
/// waits. (The channel must hold at least `batch_rows`; both writers' hold far more.)
pub fn row_queued<R>(queue: &mpsc::Sender<Message<R>>, batch_rows: usize, due: &Notify) {
    if queue.max_capacity() - queue.capacity() >= batch_rows {
        due.notify_one();
    }
}

/// Runs the writer until `stop` or until every sender is gone; see the module notes.
pub async fn run<R: Send + 'static, S: Sink<R>>(
    mut sink: S,
    mut rx: mpsc::Receiver<Message<R>>,
    stop: CancellationToken,
    batching: Batching,
) {
    let batch_rows = batching.batch_rows.max(1);
    let mut batch = Vec::with_capacity(batch_rows);
    loop {
        // Idle: the first message wakes the writer.
        let first = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            message = rx.recv() => message,
        };
        let Some(first) = first else {
            break; // every sender is gone
        };
        handle(&mut sink, &mut batch, batch_rows, first).await;
        if batch.is_empty() {
            continue; // a flush, answered (or a one-row batch, written)
        }
        // Collecting: the rows that follow wait in the channel until the batch is due.
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            () = batching.due.notified() => {}
            () = tokio::time::sleep(batching.max_delay) => {}
        }
        while let Ok(message) = rx.try_recv() {
            handle(&mut sink, &mut batch, batch_rows, message).await;
        }
        if !batch.is_empty() {
            sink.write(&mut batch).await;
        }
    }
    // Take no more, then write what is already queued.
    rx.close();
    while let Some(message) = rx.recv().await {
        handle(&mut sink, &mut batch, batch_rows, message).await;
    }
    if !batch.is_empty() {
        sink.write(&mut batch).await;
    }
}

async fn handle<R, S: Sink<R>>(
    sink: &mut S,
    batch: &mut Vec<R>,
    batch_rows: usize,
    message: Message<R>,
) {
    match message {
        Message::Row(row) => {
            batch.push(row);
            if batch.len() >= batch_rows {
                sink.write(batch).await;
            }
        }
        Message::Flush(done) => {
            if !batch.is_empty() {
                sink.write(batch).await;
            }
            let _ = done.send(());
        }
    }
}
