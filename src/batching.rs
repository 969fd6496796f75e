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
//! a task (a wake-up per row was a thread hop on every request's path). A full batch or
//! a flush makes it due at once: the sending side ([`Queue`]) says so.

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
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub batch_rows: usize,
    pub max_delay: Duration,
}

/// The sending side: rows in, flushes asked for. Cheap to clone.
pub struct Queue<R> {
    tx: mpsc::Sender<Message<R>>,
    /// Notified when the batch is due at once: a full batch waits, or a flush was sent.
    due: Arc<Notify>,
    batch_rows: usize,
}

impl<R> Clone for Queue<R> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            due: Arc::clone(&self.due),
            batch_rows: self.batch_rows,
        }
    }
}

/// The writer's side, for [`run`].
pub struct Inbox<R> {
    rx: mpsc::Receiver<Message<R>>,
    due: Arc<Notify>,
    batching: Batching,
}

/// A queue of at most `capacity` rows (at least 1) and the writer's side of it.
pub fn channel<R>(capacity: usize, batching: Batching) -> (Queue<R>, Inbox<R>) {
    let capacity = capacity.max(1);
    let (tx, rx) = mpsc::channel(capacity);
    let due = Arc::new(Notify::new());
    let queue = Queue {
        tx,
        due: Arc::clone(&due),
        // A full queue is due too, when it holds less than a batch.
        batch_rows: batching.batch_rows.clamp(1, capacity),
    };
    (queue, Inbox { rx, due, batching })
}

impl<R> Queue<R> {
    /// Queues a row without waiting; it comes back in the error when the queue is full
    /// or closed.
    pub fn try_row(&self, row: R) -> Result<(), mpsc::error::TrySendError<Message<R>>> {
        self.tx.try_send(Message::Row(row))?;
        if self.tx.max_capacity() - self.tx.capacity() >= self.batch_rows {
            self.due.notify_one();
        }
        Ok(())
    }

    /// Resolves once every row queued before the call has been handed to the sink, or
    /// at once when the writer has stopped. Waits for room in the queue.
    pub async fn flush(&self) {
        let (done, written) = oneshot::channel();
        if self.tx.send(Message::Flush(done)).await.is_ok() {
            self.due.notify_one();
            // An error means the writer stopped (it answers every flush it takes).
            let _ = written.await;
        }
    }
}

/// Runs the writer until `stop` or until every sender is gone; see the module notes.
pub async fn run<R: Send + 'static, S: Sink<R>>(
    mut sink: S,
    inbox: Inbox<R>,
    stop: CancellationToken,
) {
    let Inbox {
        mut rx,
        due,
        batching,
    } = inbox;
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
            () = due.notified() => {}
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
