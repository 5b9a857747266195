//! The tokio adapter of the frame codec: [`FrameReader`] over any `AsyncRead`, [`FrameWriter`] over any
//! `AsyncWrite`.
//!
//! Writes go through one task that owns the writer, so frames from many tasks never interleave, and a caller
//! cancelled mid-send can never leave half a frame on the pipe (the task writes whole frames only).

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::{Bytes, BytesMut};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use super::{EncodeError, Frame, FrameDecoder, FrameError, encode_frame};
use crate::limits::MAX_FRAME_BYTES;

/// Bytes requested from the reader per read call.
const READ_CHUNK: usize = 64 * 1024;

/// Frames queued to the writer task before `send` waits (backpressure).
pub const WRITE_QUEUE: usize = 256;

/// What reading a stream of frames can yield besides a frame.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// One bad frame; the stream goes on.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The underlying read failed; the stream is over.
    #[error("reading frames failed: {0}")]
    Io(#[from] io::Error),
}

/// Reads frames from an `AsyncRead`.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    buf: BytesMut,
    decoder: FrameDecoder,
    done: bool,
    bytes_read: u64,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader with the spec's 16 MiB limit.
    pub fn new(inner: R) -> Self {
        Self::with_max_frame_bytes(inner, MAX_FRAME_BYTES)
    }

    /// A reader with another frame limit.
    pub fn with_max_frame_bytes(inner: R, max_frame_bytes: usize) -> Self {
        FrameReader {
            inner,
            buf: BytesMut::with_capacity(READ_CHUNK),
            decoder: FrameDecoder::new(max_frame_bytes),
            done: false,
            bytes_read: 0,
        }
    }

    /// Total bytes read from the underlying reader so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// The next frame, or the next per-frame error. `None` once the stream has ended (after EOF or an I/O
    /// error, which is reported once).
    pub async fn next(&mut self) -> Option<Result<Frame, ReadError>> {
        loop {
            if self.done {
                return self
                    .decoder
                    .decode_eof(&mut self.buf)
                    .map(|r| r.map_err(ReadError::from));
            }
            if let Some(item) = self.decoder.decode(&mut self.buf) {
                return Some(item.map_err(ReadError::from));
            }
            if self.buf.capacity() - self.buf.len() < READ_CHUNK {
                self.buf.reserve(READ_CHUNK);
            }
            match self.inner.read_buf(&mut self.buf).await {
                Ok(0) => self.done = true,
                Ok(n) => self.bytes_read += n as u64,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.done = true;
                    self.buf.clear();
                    return Some(Err(ReadError::Io(e)));
                }
            }
        }
    }

    /// Gives back the underlying reader (buffered, unread bytes are dropped).
    pub fn into_inner(self) -> R {
        self.inner
    }
}

/// Why a frame was not sent.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The message could not be encoded (or is over the limit); nothing was sent.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The writer was closed, or its task has stopped (the pipe closed or a write failed).
    #[error("the frame writer is closed")]
    Closed,
    /// [`FrameWriter::try_send`] only: [`WRITE_QUEUE`] frames are already waiting (the reader is not keeping up).
    #[error("the frame writer's queue is full")]
    Full,
    /// A raw frame was not one LF-terminated line.
    #[error("a raw frame must be one line ending in LF")]
    NotOneLine,
}

/// A close asked of the writer task. Apart from the frame queue, so that asking never waits for queue space: a
/// reader that stopped reading (a plugin that never reads its stdin) fills the queue, and a close that waited
/// behind it would never be asked.
#[derive(Debug, Default)]
struct Closing {
    asked: AtomicBool,
    wake: Notify,
}

/// A cloneable handle that sends frames to the single writer task.
#[derive(Debug, Clone)]
pub struct FrameWriter {
    tx: mpsc::Sender<Bytes>,
    closing: Arc<Closing>,
    max_frame_bytes: usize,
}

impl FrameWriter {
    /// Starts the writer task on `writer` (spec's 16 MiB limit) and returns the handle and the task. The task
    /// ends when every handle is dropped or closed (returning `Ok`) or when a write fails (returning the error).
    pub fn spawn<W>(writer: W) -> (FrameWriter, JoinHandle<io::Result<()>>)
    where
        W: AsyncWrite + Unpin + Send + 'static,
    {
        Self::spawn_with_max_frame_bytes(writer, MAX_FRAME_BYTES)
    }

    /// Like [`spawn`](Self::spawn), with another frame limit.
    pub fn spawn_with_max_frame_bytes<W>(
        writer: W,
        max_frame_bytes: usize,
    ) -> (FrameWriter, JoinHandle<io::Result<()>>)
    where
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(WRITE_QUEUE);
        let closing = Arc::new(Closing::default());
        let task = tokio::spawn(write_loop(writer, rx, closing.clone()));
        let handle = FrameWriter {
            tx,
            closing,
            max_frame_bytes,
        };
        (handle, task)
    }

    /// Encodes and sends one message. Returns once the frame is queued (the task writes and flushes it); waits
    /// while [`WRITE_QUEUE`] frames are queued (backpressure).
    pub async fn send<T: Serialize + ?Sized>(&self, message: &T) -> Result<(), WriteError> {
        let frame = encode_frame(message, self.max_frame_bytes)?;
        self.queue(frame).await
    }

    /// Like [`send`](Self::send), but never waits: a full queue is [`WriteError::Full`] and nothing is sent
    /// (for best-effort messages that must not hold their caller behind a reader that stopped reading).
    pub fn try_send<T: Serialize + ?Sized>(&self, message: &T) -> Result<(), WriteError> {
        let frame = encode_frame(message, self.max_frame_bytes)?;
        if self.is_closing() {
            return Err(WriteError::Closed);
        }
        self.tx.try_send(frame).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => WriteError::Full,
            mpsc::error::TrySendError::Closed(_) => WriteError::Closed,
        })
    }

    /// Closes the stream after the frames already queued: the task writes them, then shuts the writer down
    /// (for a child's stdin: the plugin sees EOF), even while other handles are still alive. Later sends fail
    /// with [`WriteError::Closed`]. Never waits, whatever the queue holds (a task blocked on a reader that stopped
    /// reading stays blocked until the write fails, e.g. when that reader dies). Closing twice is harmless.
    pub fn close(&self) {
        self.closing.asked.store(true, Ordering::SeqCst);
        self.closing.wake.notify_one();
    }

    /// Sends an already-encoded frame: exactly one line, ending in LF, within the limit.
    pub async fn send_raw(&self, frame: Bytes) -> Result<(), WriteError> {
        match memchr::memchr(b'\n', &frame) {
            Some(i) if i + 1 == frame.len() => {}
            _ => return Err(WriteError::NotOneLine),
        }
        if frame.len() - 1 > self.max_frame_bytes {
            return Err(EncodeError::TooLarge {
                frame_bytes: (frame.len() - 1) as u64,
                max_frame_bytes: self.max_frame_bytes as u64,
            }
            .into());
        }
        self.queue(frame).await
    }

    /// Whether the writer task has stopped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    fn is_closing(&self) -> bool {
        self.closing.asked.load(Ordering::SeqCst)
    }

    async fn queue(&self, frame: Bytes) -> Result<(), WriteError> {
        if self.is_closing() {
            return Err(WriteError::Closed);
        }
        self.tx.send(frame).await.map_err(|_| WriteError::Closed)
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<Bytes>,
    closing: Arc<Closing>,
) -> io::Result<()> {
    loop {
        // Queued frames go before a close (biased), so a close asked after a send never overtakes its frame.
        let frame = tokio::select! {
            biased;
            frame = rx.recv() => frame,
            () = closing.wake.notified() => None,
        };
        let Some(frame) = frame else { break };
        writer.write_all(&frame).await?;
        // Write whatever else is already queued, then flush once: every frame is flushed before the task waits.
        while let Ok(frame) = rx.try_recv() {
            writer.write_all(&frame).await?;
        }
        writer.flush().await?;
    }
    // Frames queued by a send that raced the close are still written; nothing can be queued after `rx.close()`.
    rx.close();
    while let Ok(frame) = rx.try_recv() {
        writer.write_all(&frame).await?;
    }
    writer.flush().await?;
    writer.shutdown().await
}
