//! The framed-XML listener (see [`crate::frame`] for the wire format).
//!
//! Each connection has a reader task and a writer task. The reader waits for a window permit
//! before it submits a message, so a participant has at most `window` messages in flight and a
//! fast sender is slowed by backpressure rather than buffered. The writer sends control frames,
//! ACK/NAKs (returning a permit each) and pushes; it flushes whenever nothing more is ready.

use std::sync::Arc;
use std::time::Duration;

use ahash::AHashSet;
use rand::RngCore;
use ste_engine::pipeline::{AckResult, Envelope};
use ste_engine::reason::{ReasonCode, Rejection};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::warn;

use crate::frame::{check_length, Frame, FrameError, LENGTH_PREFIX_BYTES, NONCE_LEN};
use crate::gateway::{GatewayHandle, Pushed, Reply, Subscriber};
use crate::listener::accept_loop;

/// How long one write to a participant may take before its connection is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Participants one connection may log on as: a service bureau (or the load driver) sends for
/// many, each proven by its own key; the bound keeps a connection's subscriptions finite.
pub const IDENTITIES_PER_CONNECTION_MAX: usize = 1024;

/// Limits of the framed-XML listener.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Connections served at once; more are refused with an `E_BUSY` error frame.
    pub max_connections: usize,
    /// Messages one connection may have in flight (submitted and not yet answered).
    pub window: usize,
    /// Time allowed from the first byte of a frame to its last (a slow-client bound).
    pub frame_timeout: Duration,
    /// Time a connection may stay silent between frames (heartbeats count).
    pub idle_timeout: Duration,
    /// Pushes that may wait for a subscriber before it is closed as too slow.
    pub push_capacity: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            window: 4096,
            frame_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            push_capacity: 65_536,
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
    let max = config.max_connections;
    let refusal = || {
        Frame::Error {
            code: "E_BUSY".into(),
            detail: format!("the engine serves at most {max} connections"),
        }
        .encode()
    };
    let stop = shutdown.clone();
    accept_loop(listener, "framed XML", max, shutdown, refusal, |stream| {
        connection(stream, gateway.clone(), config.clone(), stop.clone())
    })
    .await;
}

async fn connection(
    stream: TcpStream,
    gateway: GatewayHandle,
    config: TcpConfig,
    shutdown: watch::Receiver<bool>,
) {
    let (read, write) = stream.into_split();
    let id = gateway.connection_id();
    let (reply_tx, reply_rx) = mpsc::channel::<Reply>(config.window + 1);
    let (push_tx, push_rx) = mpsc::channel::<Pushed>(config.push_capacity.max(1));
    let (control_tx, control_rx) = mpsc::channel::<Frame>(16);
    let (kick_tx, kick_rx) = watch::channel(false);
    let window = Arc::new(Semaphore::new(config.window.max(1)));

    let mut nonce = [0_u8; NONCE_LEN];
    rand::thread_rng().fill_bytes(&mut nonce);
    let _ = control_tx.send(Frame::Challenge { nonce }).await;

    let writer = tokio::spawn(write_loop(
        write,
        reply_rx,
        push_rx,
        control_rx,
        window.clone(),
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
    };
    let closing = reader.run(shutdown, kick_rx).await;
    // The reader has stopped: no new messages. Subscriptions end; answers in flight still go.
    gateway.unsubscribe(id);
    drop(reader);
    if let Some(closing) = closing {
        if closing.code != "E_SHUTDOWN" {
            warn!(connection = id, code = closing.code, detail = %closing.detail, "closing the connection");
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
    input: BufReader<OwnedReadHalf>,
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
            let frame = match frame {
                Ok(Some(frame)) => frame,
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
                    let again = self.identities.contains(&participant);
                    if !again && self.identities.len() >= IDENTITIES_PER_CONNECTION_MAX {
                        return Some(Closing::new(
                            "E_AUTH",
                            format!("a connection logs on as at most {IDENTITIES_PER_CONNECTION_MAX} participants"),
                        ));
                    }
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
                    let _ = self
                        .control
                        .send(Frame::LogonOk {
                            participant: participant.clone(),
                        })
                        .await;
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
                    // A message signed with the key of a participant this connection did not
                    // log on as, or signed by one that names another as its Sender, is refused
                    // E_AUTH; a bad signature is left to the validator, whose E_SIG comes
                    // first in the order of checks.
                    let refusal = if !self.identities.contains(&sender)
                        && self.gateway.signed_by(&sender, &xml, &signature)
                    {
                        Some(Rejection::new(
                            ReasonCode::Auth,
                            format!("this connection has not logged on as {sender}"),
                        ))
                    } else {
                        self.gateway.impersonation(&sender, &xml, &signature)
                    };
                    let envelope = Envelope {
                        bytes: xml,
                        sender: Some(sender),
                        signature: Some(signature),
                        correlation: 0,
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
    async fn next_frame(&mut self) -> Result<Option<Frame>, Closing> {
        let first = match tokio::time::timeout(self.config.idle_timeout, self.input.read_u8()).await
        {
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
        let rest = async {
            let mut prefix = [first, 0, 0, 0];
            self.input.read_exact(&mut prefix[1..]).await?;
            let length = match check_length(u32::from_be_bytes(prefix)) {
                Ok(length) => length,
                Err(error) => return Ok(Err(error)),
            };
            let mut body = vec![0_u8; length];
            self.input.read_exact(&mut body).await?;
            Ok::<_, std::io::Error>(Frame::decode(&body))
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
            Ok(Ok(Err(FrameError::TooLarge(length)))) => Err(Closing::new(
                "E_SIZE",
                format!(
                    "frame of {length} bytes is larger than {}",
                    crate::frame::FRAME_MAX_BYTES
                ),
            )),
            Ok(Ok(Err(error))) => Err(Closing::new("E_FRAME", error.to_string())),
            Ok(Ok(Ok(frame))) => Ok(Some(frame)),
        }
    }
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
    write: OwnedWriteHalf,
    mut replies: mpsc::Receiver<Reply>,
    mut pushes: mpsc::Receiver<Pushed>,
    mut control: mpsc::Receiver<Frame>,
    window: Arc<Semaphore>,
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
