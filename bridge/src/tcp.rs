//! The framed-XML listener (see [`crate::frame`] for the wire format).
//!
//! Each connection has a reader task and a writer task. The reader waits for a window permit
//! before it submits a message, so a participant has at most `window` messages in flight and a
//! fast sender is slowed by backpressure rather than buffered. The writer sends control frames,
//! ACK/NAKs (returning a permit each) and pushes; it flushes whenever nothing more is ready.

use std::sync::Arc;
use std::time::Duration;

use ahash::AHashSet;
use rand::Rng;
use ste_engine::pipeline::{AckResult, Envelope, EXCEPTION_RAW_PREFIX_BYTES};
use ste_engine::reason::{ReasonCode, Rejection};
use ste_engine::sign::SIGNATURE_LEN;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::warn;

use crate::frame::{check_length, Frame, FrameError, LENGTH_PREFIX_BYTES, NONCE_LEN};
use crate::gateway::{GatewayHandle, Pushed, Reply, Subscriber};
use crate::listener::{accept_loop, Accepting, Admission, Connection};

/// How long one write to a participant may take before its connection is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest frame before logon: a logon frame is under 300 bytes.
pub const PRE_LOGON_FRAME_MAX_BYTES: usize = 512;
/// Largest message frame read whole: the message limit and the frame's own fields. A longer one
/// is read as far as [`EXCEPTION_RAW_PREFIX_BYTES`] of its message, hashed and counted to its
/// end, answered E_SIZE and kept as an exception with that prefix: it costs no more memory
/// than a small one.
pub const MESSAGE_FRAME_MAX_BYTES: usize =
    1 + 8 + 1 + 255 + SIGNATURE_LEN + ste_engine::validate::MESSAGE_SIZE_MAX_BYTES;

/// Participants one connection may log on as: a service bureau (or the load driver) sends for
/// many, each proven by its own key; the bound keeps a connection's subscriptions finite.
pub const IDENTITIES_PER_CONNECTION_MAX: usize = 1024;

/// Limits of the framed-XML listener.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Connections served at once: in all, from one source, and not yet authenticated.
    pub connections: crate::listener::ConnectionLimits,
    /// TLS for every connection, when set.
    pub tls: Option<crate::tls::Tls>,
    /// Messages one connection may have in flight (submitted and not yet answered).
    pub window: usize,
    /// Time allowed from the first byte of a frame to its last (a slow-client bound).
    pub frame_timeout: Duration,
    /// Time a connection may stay silent between frames (heartbeats count).
    pub idle_timeout: Duration,
    /// Time from connecting to a logon: not extended by heartbeats, so a socket that never
    /// logs on holds its slot this long at most.
    pub logon_timeout: Duration,
    /// Bytes of messages one connection may have in flight.
    pub window_bytes: usize,
    /// Pushes that may wait for a subscriber before it is closed as too slow.
    pub push_capacity: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            connections: crate::listener::ConnectionLimits::default(),
            tls: None,
            window: 4096,
            frame_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            logon_timeout: Duration::from_secs(10),
            window_bytes: 4 * 1024 * 1024,
            push_capacity: 65_536,
        }
    }
}

impl TcpConfig {
    fn accepting(&self) -> Accepting {
        Accepting {
            tls: self.tls.as_ref().map(|tls| tls.0.clone()),
            handshake_timeout: self.frame_timeout,
            ..Accepting::plain(self.connections)
        }
    }
}

/// Why a connection is closed by the engine: the code and detail of its error frame.
struct Closing {
    code: &'static str,
    detail: String,
}

impl Closing {
    fn new(code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            code,
            detail: detail.into(),
        }
    }
}

/// Serves connections until `shutdown` turns true, then waits for every connection to answer
/// what it has in flight and close.
pub async fn serve(
    listener: TcpListener,
    gateway: GatewayHandle,
    config: TcpConfig,
    shutdown: watch::Receiver<bool>,
) {
    let refusal = |why: &str| {
        Frame::Error {
            code: "E_BUSY".into(),
            detail: why.to_owned(),
        }
        .encode()
    };
    let stop = shutdown.clone();
    accept_loop(
        listener,
        "framed XML",
        config.accepting(),
        shutdown,
        refusal,
        move |stream, admission| {
            connection(
                stream,
                admission,
                gateway.clone(),
                config.clone(),
                stop.clone(),
            )
        },
    )
    .await;
}

async fn connection(
    stream: Connection,
    admission: Admission,
    gateway: GatewayHandle,
    config: TcpConfig,
    shutdown: watch::Receiver<bool>,
) {
    let (read, write) = tokio::io::split(stream);
    let id = gateway.connection_id();
    let (reply_tx, reply_rx) = mpsc::channel::<Reply>(config.window + 1);
    let (push_tx, push_rx) = mpsc::channel::<Pushed>(config.push_capacity.max(1));
    let (control_tx, control_rx) = mpsc::channel::<Frame>(16);
    let (kick_tx, kick_rx) = watch::channel(false);
    let window = Arc::new(Semaphore::new(config.window.max(1)));
    let window_bytes = Arc::new(Semaphore::new(
        config.window_bytes.max(MESSAGE_FRAME_MAX_BYTES),
    ));

    let mut nonce = [0_u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut nonce);
    let _ = control_tx.send(Frame::Challenge { nonce }).await;

    let writer = tokio::spawn(write_loop(
        write,
        reply_rx,
        push_rx,
        control_rx,
        (window.clone(), window_bytes.clone()),
        (kick_tx.clone(), kick_rx.clone()),
    ));
    let mut reader = Reader {
        input: BufReader::with_capacity(64 * 1024, read),
        gateway: gateway.clone(),
        config: &config,
        connection: id,
        nonce,
        identities: AHashSet::new(),
        reply: reply_tx,
        push: push_tx,
        control: control_tx.clone(),
        kick: kick_tx,
        window,
        window_bytes,
        logon_deadline: tokio::time::Instant::now() + config.logon_timeout,
        admission,
    };
    let closing = reader.run(shutdown, kick_rx).await;
    // The reader has stopped: no new messages. Subscriptions end; answers in flight still go.
    gateway.unsubscribe(id);
    drop(reader);
    if let Some(closing) = closing {
        if closing.code != "E_SHUTDOWN" {
            // The detail may quote what an unauthenticated peer sent: Debug-escaped, it cannot forge
            // log lines.
            warn!(connection = id, code = closing.code, detail = ?closing.detail, "closing the connection");
        }
        let _ = control_tx
            .send(Frame::Error {
                code: closing.code.into(),
                detail: closing.detail,
            })
            .await;
    }
    drop(control_tx);
    drop(gateway);
    let _ = writer.await;
}

struct Reader<'a> {
    input: BufReader<ReadHalf<Connection>>,
    gateway: GatewayHandle,
    config: &'a TcpConfig,
    connection: u64,
    nonce: [u8; NONCE_LEN],
    /// The participants this connection logged on as.
    identities: AHashSet<String>,
    reply: mpsc::Sender<Reply>,
    push: mpsc::Sender<Pushed>,
    control: mpsc::Sender<Frame>,
    kick: watch::Sender<bool>,
    window: Arc<Semaphore>,
    window_bytes: Arc<Semaphore>,
    logon_deadline: tokio::time::Instant,
    /// The connection's standing with the listener: authenticated at its first logon.
    admission: Admission,
}

impl Reader<'_> {
    /// Reads frames until the participant leaves, breaks the protocol, or the engine stops.
    /// Returns why the engine closes the connection, if it does.
    async fn run(
        &mut self,
        mut shutdown: watch::Receiver<bool>,
        mut kicked: watch::Receiver<bool>,
    ) -> Option<Closing> {
        loop {
            let frame = tokio::select! {
                frame = self.next_frame() => frame,
                _ = shutdown.changed() => {
                    return Some(Closing::new("E_SHUTDOWN", "the engine is shutting down"));
                }
                Ok(()) = kicked.changed() => return None,
            };
            let (frame, oversized) = match frame {
                Ok(Some(read)) => read,
                Ok(None) => return None,
                Err(closing) => return Some(closing),
            };
            match frame {
                Frame::Logon {
                    subscribe,
                    participant,
                    mac,
                } => {
                    if let Err(rejection) =
                        self.gateway.authenticate(&participant, &self.nonce, &mac)
                    {
                        return Some(Closing::new(rejection.code.as_str(), rejection.detail));
                    }
                    if let Err(why) = self.admission.authenticated_as(&participant) {
                        return Some(Closing::new("E_BUSY", why));
                    }
                    let again = self.identities.contains(&participant);
                    if !again && self.identities.len() >= IDENTITIES_PER_CONNECTION_MAX {
                        return Some(Closing::new(
                            "E_AUTH",
                            format!("a connection logs on as at most {IDENTITIES_PER_CONNECTION_MAX} participants"),
                        ));
                    }
                    // The answer is queued before the subscription exists, and the writer
                    // takes control frames first: no push of this participant can go out
                    // before its logon answer.
                    let _ = self
                        .control
                        .send(Frame::LogonOk {
                            participant: participant.clone(),
                        })
                        .await;
                    // A repeated logon is answered again and changes nothing.
                    if subscribe && !again {
                        self.gateway.subscribe(
                            &participant,
                            Subscriber {
                                connection: self.connection,
                                push: self.push.clone(),
                                kick: self.kick.clone(),
                            },
                        );
                    }
                    self.identities.insert(participant);
                }
                Frame::Message {
                    seq,
                    sender,
                    signature,
                    xml,
                } => {
                    if self.identities.is_empty() {
                        return Some(Closing::new("E_AUTH", "log on before sending messages"));
                    }
                    // The window: at most `window` messages of this connection in flight.
                    let permit = tokio::select! {
                        permit = self.window.clone().acquire_owned() => permit,
                        _ = shutdown.changed() => {
                            return Some(Closing::new("E_SHUTDOWN", "the engine is shutting down"));
                        }
                        Ok(()) = kicked.changed() => return None,
                    };
                    let Ok(permit) = permit else { return None };
                    permit.forget();
                    // And the bytes: at most `window_bytes` of this connection's messages
                    // in flight.
                    let cost = u32::try_from(xml.len()).unwrap_or(u32::MAX);
                    let bytes = tokio::select! {
                        permit = self.window_bytes.clone().acquire_many_owned(cost) => permit,
                        _ = shutdown.changed() => {
                            return Some(Closing::new("E_SHUTDOWN", "the engine is shutting down"));
                        }
                        Ok(()) = kicked.changed() => return None,
                    };
                    let Ok(bytes) = bytes else { return None };
                    bytes.forget();
                    // A message signed with the key of a participant this connection did not
                    // log on as, or signed by one that names another as its Sender, is refused
                    // E_AUTH; a bad signature is left to the validator, whose E_SIG comes
                    // first in the order of checks.
                    let refusal = if let Some(oversized) = oversized {
                        Some(Rejection::new(
                            ReasonCode::Size,
                            format!(
                                "message of {} bytes is larger than {} (the first {} bytes are kept, xxh3 {:016x})",
                                oversized.length,
                                ste_engine::validate::MESSAGE_SIZE_MAX_BYTES,
                                xml.len(),
                                oversized.xxh3
                            ),
                        ))
                    } else if !self.identities.contains(&sender)
                        && self.gateway.signed_by(&sender, &xml, &signature)
                    {
                        Some(Rejection::new(
                            ReasonCode::Auth,
                            format!("this connection has not logged on as {sender}"),
                        ))
                    } else {
                        self.gateway.impersonation(&sender, &xml, &signature)
                    };
                    // A participant this connection logged on as goes at its rate.
                    if self.identities.contains(&sender) {
                        self.gateway.pace(&sender).await;
                    }
                    let envelope = Envelope {
                        bytes: xml,
                        sender: Some(sender.into()),
                        signature: Some(signature),
                        correlation: 0,
                        origin: 0,
                        injected_ns: 0,
                        refusal,
                    };
                    if self
                        .gateway
                        .submit(envelope, seq, &self.reply)
                        .await
                        .is_err()
                    {
                        return Some(Closing::new("E_SHUTDOWN", "the engine is shutting down"));
                    }
                }
                Frame::Heartbeat => {
                    let _ = self.control.send(Frame::Heartbeat).await;
                }
                Frame::Bye => return None,
                other => {
                    return Some(Closing::new(
                        "E_FRAME",
                        format!("a participant does not send {}", kind_name(&other)),
                    ));
                }
            }
        }
    }

    /// The next frame: `Ok(None)` when the participant closed cleanly between frames.
    async fn next_frame(&mut self) -> Result<Option<(Frame, Option<Oversized>)>, Closing> {
        let logged_on = !self.identities.is_empty();
        // Before a logon the connection waits no longer than its logon deadline, however many
        // heartbeats it sends.
        let wait = if logged_on {
            self.config.idle_timeout
        } else {
            self.logon_deadline
                .saturating_duration_since(tokio::time::Instant::now())
        };
        let first = match tokio::time::timeout(wait, self.input.read_u8()).await {
            Err(_) if !logged_on => {
                return Err(Closing::new(
                    "E_TIMEOUT",
                    format!("no logon within {:?}", self.config.logon_timeout),
                ))
            }
            Err(_) => {
                return Err(Closing::new(
                    "E_TIMEOUT",
                    format!("no frame for {:?}", self.config.idle_timeout),
                ))
            }
            Ok(Err(error)) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Ok(Err(error)) => return Err(Closing::new("E_IO", error.to_string())),
            Ok(Ok(byte)) => byte,
        };
        type Read = Result<(Frame, Option<Oversized>), Closing>;
        let too_large = |length: usize| {
            Closing::new(
                "E_SIZE",
                format!(
                    "frame of {length} bytes is larger than {}",
                    if logged_on {
                        crate::frame::FRAME_MAX_BYTES
                    } else {
                        PRE_LOGON_FRAME_MAX_BYTES
                    }
                ),
            )
        };
        let malformed = |error: FrameError| match error {
            FrameError::TooLarge(length) => too_large(length),
            error => Closing::new("E_FRAME", error.to_string()),
        };
        let rest = async {
            let mut prefix = [first, 0, 0, 0];
            self.input.read_exact(&mut prefix[1..]).await?;
            let length = match check_length(u32::from_be_bytes(prefix)) {
                Ok(length) => length,
                Err(error) => return Ok::<Read, std::io::Error>(Err(malformed(error))),
            };
            if !logged_on && length > PRE_LOGON_FRAME_MAX_BYTES {
                // Only a logon, a heartbeat or a bye is due: a message is refused unread.
                let kind = self.input.read_u8().await?;
                return Ok(Err(if kind == b'M' {
                    Closing::new("E_AUTH", "log on before sending messages")
                } else {
                    too_large(length)
                }));
            }
            if length <= MESSAGE_FRAME_MAX_BYTES {
                let mut body = vec![0_u8; length];
                self.input.read_exact(&mut body).await?;
                return Ok(Frame::decode(&body)
                    .map(|frame| (frame, None))
                    .map_err(malformed));
            }
            // Larger than any message may be: only a message frame, read as far as the prefix
            // kept of it, the rest counted and hashed on its way past.
            let mut kind = [0_u8; 1];
            self.input.read_exact(&mut kind).await?;
            if kind[0] != b'M' {
                return Ok(Err(too_large(length)));
            }
            let head_length = 8 + 1 + 255 + SIGNATURE_LEN + EXCEPTION_RAW_PREFIX_BYTES;
            let mut head = vec![0_u8; head_length.min(length)];
            head[0] = b'M';
            self.input.read_exact(&mut head[1..]).await?;
            let frame = match Frame::decode(&head) {
                Ok(frame) => frame,
                Err(error) => return Ok(Err(malformed(error))),
            };
            let Frame::Message {
                seq,
                sender,
                signature,
                xml,
            } = frame
            else {
                return Ok(Err(too_large(length)));
            };
            let mut hasher = xxhash_rust::xxh3::Xxh3::new();
            hasher.update(&xml);
            let mut remaining = length - head.len();
            let mut chunk = vec![0_u8; 16 * 1024];
            while remaining > 0 {
                let take = remaining.min(chunk.len());
                self.input.read_exact(&mut chunk[..take]).await?;
                hasher.update(&chunk[..take]);
                remaining -= take;
            }
            let message_length = xml.len() + (length - head.len());
            let kept = xml[..xml.len().min(EXCEPTION_RAW_PREFIX_BYTES)].to_vec();
            Ok(Ok((
                Frame::Message {
                    seq,
                    sender,
                    signature,
                    xml: kept,
                },
                Some(Oversized {
                    length: message_length,
                    xxh3: hasher.digest(),
                }),
            )))
        };
        match tokio::time::timeout(self.config.frame_timeout, rest).await {
            Err(_) => Err(Closing::new(
                "E_TIMEOUT",
                format!(
                    "a frame took longer than {:?} to arrive",
                    self.config.frame_timeout
                ),
            )),
            Ok(Err(error)) => Err(Closing::new("E_IO", error.to_string())),
            Ok(Ok(Err(closing))) => Err(closing),
            Ok(Ok(Ok(read))) => Ok(Some(read)),
        }
    }
}

/// A message frame longer than any message may be: read as far as its kept prefix.
struct Oversized {
    /// Length of the whole message.
    length: usize,
    /// xxh3 of the whole message.
    xxh3: u64,
}

fn kind_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Challenge { .. } => "challenge frames",
        Frame::LogonOk { .. } => "logon-accepted frames",
        Frame::Ack { .. } => "ACK frames",
        Frame::Nak { .. } => "NAK frames",
        Frame::Push { .. } => "push frames",
        Frame::Error { .. } => "error frames",
        _ => "this frame",
    }
}

fn reply_frame(reply: Reply) -> Frame {
    match reply.result {
        AckResult::Accepted => Frame::Ack {
            seq: reply.seq,
            duplicate: false,
        },
        AckResult::Duplicate => Frame::Ack {
            seq: reply.seq,
            duplicate: true,
        },
        AckResult::Rejected(code) => Frame::Nak {
            seq: reply.seq,
            code,
            detail: String::new(),
        },
    }
}

/// Writes control frames, answers and pushes until every source has closed (or the subscriber
/// is kicked for falling behind).
async fn write_loop(
    write: WriteHalf<Connection>,
    mut replies: mpsc::Receiver<Reply>,
    mut pushes: mpsc::Receiver<Pushed>,
    mut control: mpsc::Receiver<Frame>,
    (window, window_bytes): (Arc<Semaphore>, Arc<Semaphore>),
    (kick, mut kicked): (watch::Sender<bool>, watch::Receiver<bool>),
) {
    let mut output = BufWriter::with_capacity(64 * 1024, write);
    // A participant that stops reading cannot hold the connection (and its reader, waiting
    // for window permits) for ever: a write that does not finish in time closes it.
    let failed = |kick: &watch::Sender<bool>| {
        let _ = kick.send(true);
    };
    let mut buffer = Vec::with_capacity(LENGTH_PREFIX_BYTES + 64);
    let (mut replies_open, mut control_open) = (true, true);
    // The error that closes the connection goes last, after the answers still due.
    let mut closing: Option<Frame> = None;
    while replies_open || control_open {
        let frame = tokio::select! {
            biased;
            // Only a kick, not the kicker going away (the connection closing).
            Ok(()) = kicked.changed() => {
                closing = Some(Frame::Error {
                    code: "E_SLOW".into(),
                    detail: "the subscriber did not read its pushes".into(),
                });
                break;
            }
            frame = control.recv(), if control_open => match frame {
                Some(frame @ Frame::Error { .. }) => {
                    closing = Some(frame);
                    continue;
                }
                Some(frame) => frame,
                None => { control_open = false; continue; }
            },
            reply = replies.recv(), if replies_open => match reply {
                Some(reply) => {
                    window.add_permits(1);
                    window_bytes.add_permits(reply.bytes as usize);
                    reply_frame(reply)
                }
                None => { replies_open = false; continue; }
            },
            Some(pushed) = pushes.recv() => Frame::Push {
                class: pushed.class,
                xml: pushed.xml.to_vec(),
            },
        };
        buffer.clear();
        buffer.extend_from_slice(&frame.encode());
        if !matches!(
            tokio::time::timeout(WRITE_TIMEOUT, output.write_all(&buffer)).await,
            Ok(Ok(()))
        ) {
            failed(&kick);
            return;
        }
        // Flush only when nothing else is ready: answers of one commit go out together.
        if replies.is_empty()
            && control.is_empty()
            && pushes.is_empty()
            && !matches!(
                tokio::time::timeout(WRITE_TIMEOUT, output.flush()).await,
                Ok(Ok(()))
            )
        {
            failed(&kick);
            return;
        }
    }
    if let Some(frame) = closing {
        let _ = output.write_all(&frame.encode()).await;
    }
    let _ = output.flush().await;
    let _ = output.shutdown().await;
}
