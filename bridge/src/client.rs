//! A blocking framed-XML client: connect, log on, then send on one half and read on the other
//! (typically from two threads).

use std::io::{BufReader, BufWriter, Write};
use std::net::{TcpStream, ToSocketAddrs};
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

/// The sending half.
pub struct FrameWriter {
    output: BufWriter<TcpStream>,
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
    input: BufReader<TcpStream>,
}

impl FrameReader {
    /// The next frame; `Ok(None)` when the engine has closed the connection.
    pub fn next_frame(&mut self) -> std::io::Result<Option<Frame>> {
        Frame::read_from(&mut self.input)
    }

    /// How long a read may wait (`None`: for ever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        self.input.get_ref().set_read_timeout(timeout)
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
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = FrameReader {
        input: BufReader::with_capacity(64 * 1024, stream.try_clone()?),
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
    for _ in logons {
        match reader.next_frame()? {
            Some(Frame::LogonOk { .. }) => {}
            Some(Frame::Error { code, detail }) => {
                return Err(ClientError::Refused { code, detail })
            }
            Some(other) => return Err(ClientError::Unexpected(Box::new(other), "a logon answer")),
            None => return Err(ClientError::Closed),
        }
    }
    // From here on the reader waits as long as the run lasts.
    stream.set_read_timeout(None)?;
    Ok((writer, reader))
}
