//! The loop both write-behind writers run (the request log, the usage ledger): rows
//! arrive on a channel, and a batch is handed to its [`Sink`] when it reaches
//! `batch_rows` rows, when its first row has waited `max_delay`, or when someone asks
//! for a flush; on `stop` (or when every sender is gone) the channel is closed, what is
//! queued is drained and written, and the loop ends. What a failed write does (retry,
//! give up, drop) is the sink's own policy.

use std::future::Future;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
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

/// Runs the writer until `stop` or until every sender is gone; see the module notes.
pub async fn run<R: Send + 'static, S: Sink<R>>(
    mut sink: S,
    mut rx: mpsc::Receiver<Message<R>>,
    stop: CancellationToken,
    batching: Batching,
) {
    let batch_rows = batching.batch_rows.max(1);
    let mut batch = Vec::with_capacity(batch_rows);
    // When the batch's first row arrived plus max_delay; reset with each new batch.
    let deadline = tokio::time::sleep(batching.max_delay);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            message = rx.recv() => match message {
                Some(message) => {
                    if batch.is_empty() {
                        deadline
                            .as_mut()
                            .reset(tokio::time::Instant::now() + batching.max_delay);
                    }
                    handle(&mut sink, &mut batch, batch_rows, message).await;
                }
                // Every sender is gone.
                None => break,
            },
            () = &mut deadline, if !batch.is_empty() => sink.write(&mut batch).await,
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
