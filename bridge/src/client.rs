//! A blocking framed-XML client: connect, log on, then send on one half and read on the other
//! (typically from two threads). Over TLS ([`connect_tls`]) the two halves talk to a tunnel
//! thread through a socket pair, and the tunnel carries the bytes over rustls: a TLS session
//! cannot be split between two threads, a socket can.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use ste_engine::sign::KeyedMac;

use crate::frame::{logon_mac, Frame};

/// A participant to log on as.
pub struct Logon<'a> {
    pub participant: &'a str,
    pub key: &'a KeyedMac,
    /// Receive the CLS and advices of this participant on this connection.
    pub subscribe: bool,
}

/// Why a connection could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("the engine refused: {code} {detail}")]
    Refused { code: String, detail: String },
    #[error("the engine sent {0:?} where {1} was expected")]
    Unexpected(Box<Frame>, &'static str),
    #[error("the engine closed the connection")]
    Closed,
}

/// The byte stream under a client: TCP to the engine, or one end of the socket pair whose
/// other end a TLS tunnel serves.
enum Stream {
    Tcp(TcpStream),
    Local(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(stream) => Stream::Tcp(stream.try_clone()?),
            Stream::Local(stream) => Stream::Local(stream.try_clone()?),
        })
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.set_read_timeout(timeout),
            Stream::Local(stream) => stream.set_read_timeout(timeout),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read(buf),
            Stream::Local(stream) => stream.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buf),
            Stream::Local(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.flush(),
            Stream::Local(stream) => stream.flush(),
        }
    }
}

/// The sending half.
pub struct FrameWriter {
    output: BufWriter<Stream>,
}

impl FrameWriter {
    /// Buffers one frame.
    pub fn send(&mut self, frame: &Frame) -> std::io::Result<()> {
        self.output.write_all(&frame.encode())
    }

    /// Sends what is buffered.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.output.flush()
    }

    /// Says bye: the engine answers what is in flight, then closes.
    pub fn bye(mut self) -> std::io::Result<()> {
        self.send(&Frame::Bye)?;
        self.flush()
    }
}

/// The receiving half.
pub struct FrameReader {
    input: BufReader<Stream>,
    /// Pushes that arrived while the logon answers were awaited, in order.
    early: VecDeque<Frame>,
}

/// How many bytes of pushes (their XML and the frames holding it) a client keeps while it
/// waits for its logon answers: a participant's CLS may be pushed as soon as that
/// participant's logon is accepted, before the answers to the connection's other logons.
pub const EARLY_PUSH_BYTES_MAX: usize = 16 << 20;

impl FrameReader {
    /// The next frame; `Ok(None)` when the engine has closed the connection.
    pub fn next_frame(&mut self) -> std::io::Result<Option<Frame>> {
        if let Some(frame) = self.early.pop_front() {
            return Ok(Some(frame));
        }
        Frame::read_from(&mut self.input)
    }

    /// How long a read may wait (`None`: for ever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        self.input.get_ref().set_read_timeout(timeout)
    }

    /// A handle that closes the connection from outside: a reader blocked waiting for frames
    /// that will not come then sees the end of the stream.
    pub fn closer(&self) -> std::io::Result<Closer> {
        Ok(Closer(self.input.get_ref().try_clone()?))
    }
}

/// Closes a connection from outside its reader ([`FrameReader::closer`]).
pub struct Closer(Stream);

impl Closer {
    /// Shuts the connection down both ways.
    pub fn close(&self) {
        let _ = match &self.0 {
            Stream::Tcp(stream) => stream.shutdown(std::net::Shutdown::Both),
            Stream::Local(stream) => stream.shutdown(std::net::Shutdown::Both),
        };
    }
}

/// Connects, answers the challenge with one logon per participant, and waits for each to be
/// accepted.
pub fn connect(
    address: impl ToSocketAddrs,
    logons: &[Logon<'_>],
) -> Result<(FrameWriter, FrameReader), ClientError> {
    let stream = TcpStream::connect(address)?;
    stream.set_nodelay(true)?;
    log_on(Stream::Tcp(stream), logons)
}

/// Connects over TLS to `address` (verifying the engine's certificate as `server_name`, with
/// the client certificate `tls` may carry) and logs on as each of `logons`. The tunnel thread
/// ends when the connection does.
pub fn connect_tls(
    address: &str,
    server_name: &str,
    tls: &crate::tls::ClientTls,
    logons: &[Logon<'_>],
) -> Result<(FrameWriter, FrameReader), ClientError> {
    let connector = crate::tls::connector(tls)
        .map_err(|error| ClientError::Io(std::io::Error::other(error.to_string())))?;
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())
        .map_err(|error| ClientError::Io(std::io::Error::other(error.to_string())))?;
    let (ours, theirs) = UnixStream::pair()?;
    theirs.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    // The TLS handshake first, so that a refused certificate is this call's error.
    let tls_stream = runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(address).await?;
        tcp.set_nodelay(true)?;
        connector.connect(name, tcp).await
    })?;
    std::thread::Builder::new()
        .name("tls-tunnel".into())
        .spawn(move || {
            runtime.block_on(async move {
                let Ok(mut local) = tokio::net::UnixStream::from_std(theirs) else {
                    return;
                };
                let mut tls_stream = tls_stream;
                let _ = tokio::io::copy_bidirectional(&mut local, &mut tls_stream).await;
            });
        })?;
    log_on(Stream::Local(ours), logons)
}

/// Reads the challenge on `stream` and logs on as each of `logons`.
fn log_on(stream: Stream, logons: &[Logon<'_>]) -> Result<(FrameWriter, FrameReader), ClientError> {
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = FrameReader {
        input: BufReader::with_capacity(64 * 1024, stream.try_clone()?),
        early: VecDeque::new(),
    };
    let mut writer = FrameWriter {
        output: BufWriter::with_capacity(64 * 1024, stream.try_clone()?),
    };
    let nonce = match reader.next_frame()? {
        Some(Frame::Challenge { nonce }) => nonce,
        Some(Frame::Error { code, detail }) => return Err(ClientError::Refused { code, detail }),
        Some(other) => return Err(ClientError::Unexpected(Box::new(other), "a challenge")),
        None => return Err(ClientError::Closed),
    };
    for logon in logons {
        writer.send(&Frame::Logon {
            subscribe: logon.subscribe,
            participant: logon.participant.to_owned(),
            mac: logon_mac(logon.key, &nonce, logon.participant),
        })?;
    }
    writer.flush()?;
    // The answers come in the order of the logons; a participant's pushes may follow its own
    // answer before the others' and are kept for the reader.
    let (mut answered, mut early_bytes) = (0, 0);
    while answered < logons.len() {
        match Frame::read_from(&mut reader.input)? {
            Some(Frame::LogonOk { .. }) => answered += 1,
            Some(Frame::Error { code, detail }) => {
                return Err(ClientError::Refused { code, detail })
            }
            // A push before the first answer would be for nobody this connection is yet.
            Some(Frame::Push { class, xml }) if answered > 0 => {
                early_bytes += std::mem::size_of::<Frame>() + xml.len();
                let push = Frame::Push { class, xml };
                if early_bytes > EARLY_PUSH_BYTES_MAX {
                    return Err(ClientError::Unexpected(
                        Box::new(push),
                        "a logon answer within the pushes a client keeps",
                    ));
                }
                reader.early.push_back(push);
            }
            Some(Frame::Heartbeat) => {}
            Some(other) => return Err(ClientError::Unexpected(Box::new(other), "a logon answer")),
            None => return Err(ClientError::Closed),
        }
    }
    // From here on the reader waits as long as the run lasts.
    stream.set_read_timeout(None)?;
    Ok((writer, reader))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;
    use crate::frame::{PushClass, NONCE_LEN};

    /// Plays the engine's side of a logon for two participants, sending `between` after the
    /// first answer; returns the client's result and the frames the client read after it.
    fn log_on_against(between: Vec<Frame>) -> Result<Vec<Frame>, ClientError> {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
        let address = listener.local_addr().expect("its address");
        let engine = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("the client");
            let mut input = BufReader::new(stream.try_clone().expect("a handle"));
            // The client may have hung up already: what it did is what the test asserts.
            let mut send = |frame: &Frame| {
                let _ = stream.write_all(&frame.encode());
            };
            send(&Frame::Challenge {
                nonce: [7; NONCE_LEN],
            });
            for participant in ["AAAAGB22XXX", "BBBBGB22XXX"] {
                assert!(matches!(
                    Frame::read_from(&mut input),
                    Ok(Some(Frame::Logon { .. }))
                ));
                send(&Frame::LogonOk {
                    participant: participant.into(),
                });
                if participant.starts_with('A') {
                    between.iter().for_each(&mut send);
                }
            }
            send(&Frame::Bye);
        });
        let key = ste_engine::sign::keyed(b"a key");
        let logons = ["AAAAGB22XXX", "BBBBGB22XXX"].map(|participant| Logon {
            participant,
            key: &key,
            subscribe: true,
        });
        let connected = connect(address, &logons);
        let result = connected.map(|(_writer, mut reader)| {
            let mut read = Vec::new();
            while let Ok(Some(frame)) = reader.next_frame() {
                read.push(frame);
            }
            read
        });
        engine.join().expect("the engine's side ran");
        result
    }

    #[test]
    fn a_push_between_two_logon_answers_is_kept_for_the_reader_in_order() {
        let push = |text: &str| Frame::Push {
            class: PushClass::Cls,
            xml: text.as_bytes().to_vec(),
        };
        let read = log_on_against(vec![
            push("<Cls>1</Cls>"),
            Frame::Heartbeat,
            push("<Cls>2</Cls>"),
        ])
        .expect("the logons are accepted");
        assert_eq!(
            read,
            vec![push("<Cls>1</Cls>"), push("<Cls>2</Cls>"), Frame::Bye]
        );
    }

    #[test]
    fn an_answer_other_than_a_push_between_logon_answers_is_still_refused() {
        let error = log_on_against(vec![Frame::Ack {
            seq: 1,
            duplicate: false,
        }])
        .expect_err("an ACK before the logons are answered");
        assert!(
            matches!(&error, ClientError::Unexpected(frame, _) if matches!(**frame, Frame::Ack { .. })),
            "{error}"
        );
    }

    #[test]
    fn pushes_kept_during_logon_are_bounded_in_bytes() {
        let big = Frame::Push {
            class: PushClass::Cls,
            xml: vec![b'x'; 900 * 1024],
        };
        let count = EARLY_PUSH_BYTES_MAX / (900 * 1024) + 1;
        let error = log_on_against(vec![big; count]).expect_err("more pushes than a client keeps");
        assert!(matches!(error, ClientError::Unexpected(..)), "{error}");
    }
}
