//! The framed-XML wire format over TCP.
//!
//! Every frame is a `u32` big-endian length of the rest, one kind byte, and the kind's body.
//! Numbers are big-endian; a text field is a `u8` length and UTF-8 bytes.
//!
//! | kind | name | direction | body |
//! |---|---|---|---|
//! | `C` | challenge | engine → participant, on connect | 16 random bytes |
//! | `L` | logon | participant → engine | flags `u8` (bit 0: subscribe), participant BIC (text), HMAC-SHA256 over `STE-LOGON\0` ‖ challenge ‖ BIC with the participant's key (32 bytes) |
//! | `O` | logon accepted | engine → participant | participant BIC (text) |
//! | `M` | message | participant → engine | sequence `u64` (chosen by the participant, echoed), sender BIC (text), HMAC-SHA256 of the XML with the sender's key (32 bytes), the canonical XML bytes |
//! | `A` | ACK | engine → participant | sequence `u64`, status `u8` (0 accepted, 1 duplicate) |
//! | `N` | NAK | engine → participant | sequence `u64`, reason code (text), detail (the rest, UTF-8) |
//! | `P` | push | engine → subscriber | class `u8` (`C` CLS, `D` status advice), the XML bytes |
//! | `H` | heartbeat | either way | empty |
//! | `E` | error | engine → participant, then the engine closes | code (text), detail (the rest) |
//! | `B` | bye | participant → engine | empty: the engine answers what is in flight, then closes |
//!
//! A connection may log on as several participants (a service bureau does); it may only send
//! messages as one of them. ACKs and NAKs come after the commit that holds the message, in any
//! order; the sequence number pairs them with the messages. Logons are answered in their order;
//! a subscribed participant's pushes start right after its own answer, so they may come before
//! the answers to the connection's later logons (the client keeps them for its reader).

use ste_engine::reason::ReasonCode;
use ste_engine::sign::SIGNATURE_LEN;

/// Length of the length prefix.
pub const LENGTH_PREFIX_BYTES: usize = 4;
/// Length of a logon challenge.
pub const NONCE_LEN: usize = 16;
/// Longest text field (a BIC is 8 or 11 characters; the bound leaves room and stops abuse).
const TEXT_MAX_BYTES: usize = u8::MAX as usize;
/// Largest frame (kind and body) accepted. A message above the engine's 64 KiB limit in a frame
/// below this is answered with a NAK E_SIZE and kept as an exception like any rejected message;
/// a longer declared length is refused with an `E_SIZE` error frame before any of it is read,
/// and the connection closed.
pub const FRAME_MAX_BYTES: usize = 1024 * 1024;
/// What the logon MAC covers before the challenge.
const LOGON_CONTEXT: &[u8] = b"STE-LOGON\0";

/// What a pushed XML document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushClass {
    Cls,
    Advice,
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Challenge {
        nonce: [u8; NONCE_LEN],
    },
    Logon {
        subscribe: bool,
        participant: String,
        mac: [u8; SIGNATURE_LEN],
    },
    LogonOk {
        participant: String,
    },
    Message {
        seq: u64,
        sender: String,
        signature: [u8; SIGNATURE_LEN],
        xml: Vec<u8>,
    },
    Ack {
        seq: u64,
        duplicate: bool,
    },
    Nak {
        seq: u64,
        code: ReasonCode,
        detail: String,
    },
    Push {
        class: PushClass,
        xml: Vec<u8>,
    },
    Heartbeat,
    Error {
        code: String,
        detail: String,
    },
    Bye,
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes is larger than {FRAME_MAX_BYTES}")]
    TooLarge(usize),
    #[error("empty frame")]
    Empty,
    #[error("unknown frame kind {0:#04x}")]
    UnknownKind(u8),
    #[error("{0} frame is shorter than its fields")]
    Truncated(&'static str),
    #[error("{0} frame has a text field that is not UTF-8")]
    BadText(&'static str),
    #[error("NAK with unknown reason code {0}")]
    BadCode(String),
    #[error("push of unknown class {0:#04x}")]
    BadClass(u8),
}

/// The bytes a logon MAC covers: the context, the challenge and the BIC.
pub fn logon_covered(nonce: &[u8; NONCE_LEN], participant: &str) -> Vec<u8> {
    let mut covered = Vec::with_capacity(LOGON_CONTEXT.len() + NONCE_LEN + participant.len());
    covered.extend_from_slice(LOGON_CONTEXT);
    covered.extend_from_slice(nonce);
    covered.extend_from_slice(participant.as_bytes());
    covered
}

/// The MAC a logon carries: HMAC-SHA256 with the participant's key over [`logon_covered`].
pub fn logon_mac(
    mac: &ste_engine::sign::KeyedMac,
    nonce: &[u8; NONCE_LEN],
    participant: &str,
) -> [u8; SIGNATURE_LEN] {
    ste_engine::sign::sign_keyed(mac, &logon_covered(nonce, participant))
}

/// Checks the declared length of a frame (the `u32` prefix) before its body is read.
pub fn check_length(declared: u32) -> Result<usize, FrameError> {
    let length = declared as usize;
    match length {
        0 => Err(FrameError::Empty),
        n if n > FRAME_MAX_BYTES => Err(FrameError::TooLarge(n)),
        n => Ok(n),
    }
}

fn push_text(out: &mut Vec<u8>, text: &str) {
    let bytes = &text.as_bytes()[..text.len().min(TEXT_MAX_BYTES)];
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

/// Reads fields off the front of a frame body.
struct Fields<'a> {
    rest: &'a [u8],
    kind: &'static str,
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.rest.len() < n {
            return Err(FrameError::Truncated(self.kind));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, FrameError> {
        let bytes = self.take(8)?;
        Ok(u64::from_be_bytes(bytes.try_into().expect("8 bytes")))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    fn text(&mut self) -> Result<String, FrameError> {
        let len = usize::from(self.u8()?);
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| FrameError::BadText(self.kind))
    }

    fn rest_text(&mut self) -> Result<String, FrameError> {
        let bytes = std::mem::take(&mut self.rest);
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| FrameError::BadText(self.kind))
    }
}

impl Frame {
    /// The frame with its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0; LENGTH_PREFIX_BYTES];
        match self {
            Frame::Challenge { nonce } => {
                out.push(b'C');
                out.extend_from_slice(nonce);
            }
            Frame::Logon {
                subscribe,
                participant,
                mac,
            } => {
                out.push(b'L');
                out.push(u8::from(*subscribe));
                push_text(&mut out, participant);
                out.extend_from_slice(mac);
            }
            Frame::LogonOk { participant } => {
                out.push(b'O');
                push_text(&mut out, participant);
            }
            Frame::Message {
                seq,
                sender,
                signature,
                xml,
            } => {
                out.reserve(8 + 1 + sender.len() + SIGNATURE_LEN + xml.len());
                out.push(b'M');
                out.extend_from_slice(&seq.to_be_bytes());
                push_text(&mut out, sender);
                out.extend_from_slice(signature);
                out.extend_from_slice(xml);
            }
            Frame::Ack { seq, duplicate } => {
                out.push(b'A');
                out.extend_from_slice(&seq.to_be_bytes());
                out.push(u8::from(*duplicate));
            }
            Frame::Nak { seq, code, detail } => {
                out.push(b'N');
                out.extend_from_slice(&seq.to_be_bytes());
                push_text(&mut out, code.as_str());
                out.extend_from_slice(detail.as_bytes());
            }
            Frame::Push { class, xml } => {
                out.push(b'P');
                out.push(match class {
                    PushClass::Cls => b'C',
                    PushClass::Advice => b'D',
                });
                out.extend_from_slice(xml);
            }
            Frame::Heartbeat => out.push(b'H'),
            Frame::Error { code, detail } => {
                out.push(b'E');
                push_text(&mut out, code);
                out.extend_from_slice(detail.as_bytes());
            }
            Frame::Bye => out.push(b'B'),
        }
        let length = (out.len() - LENGTH_PREFIX_BYTES) as u32;
        out[..LENGTH_PREFIX_BYTES].copy_from_slice(&length.to_be_bytes());
        out
    }

    /// Decodes a frame from its kind byte and body (the bytes after the length prefix).
    pub fn decode(frame: &[u8]) -> Result<Frame, FrameError> {
        let (&kind, body) = frame.split_first().ok_or(FrameError::Empty)?;
        let name = match kind {
            b'C' => "challenge",
            b'L' => "logon",
            b'O' => "logon-accepted",
            b'M' => "message",
            b'A' => "ack",
            b'N' => "nak",
            b'P' => "push",
            b'H' => "heartbeat",
            b'E' => "error",
            b'B' => "bye",
            other => return Err(FrameError::UnknownKind(other)),
        };
        let mut fields = Fields {
            rest: body,
            kind: name,
        };
        let frame = match kind {
            b'C' => Frame::Challenge {
                nonce: fields.array()?,
            },
            b'L' => Frame::Logon {
                subscribe: fields.u8()? & 1 == 1,
                participant: fields.text()?,
                mac: fields.array()?,
            },
            b'O' => Frame::LogonOk {
                participant: fields.text()?,
            },
            b'M' => Frame::Message {
                seq: fields.u64()?,
                sender: fields.text()?,
                signature: fields.array()?,
                xml: std::mem::take(&mut fields.rest).to_vec(),
            },
            b'A' => Frame::Ack {
                seq: fields.u64()?,
                duplicate: fields.u8()? == 1,
            },
            b'N' => {
                let seq = fields.u64()?;
                let code = fields.text()?;
                let code = ReasonCode::parse(&code).ok_or(FrameError::BadCode(code))?;
                Frame::Nak {
                    seq,
                    code,
                    detail: fields.rest_text()?,
                }
            }
            b'P' => {
                let class = match fields.u8()? {
                    b'C' => PushClass::Cls,
                    b'D' => PushClass::Advice,
                    other => return Err(FrameError::BadClass(other)),
                };
                Frame::Push {
                    class,
                    xml: std::mem::take(&mut fields.rest).to_vec(),
                }
            }
            b'H' => Frame::Heartbeat,
            b'E' => Frame::Error {
                code: fields.text()?,
                detail: fields.rest_text()?,
            },
            _ => Frame::Bye,
        };
        Ok(frame)
    }

    /// Reads one frame from a blocking reader: `Ok(None)` at a clean end of stream.
    pub fn read_from(reader: &mut impl std::io::Read) -> std::io::Result<Option<Frame>> {
        let mut prefix = [0_u8; LENGTH_PREFIX_BYTES];
        match reader.read_exact(&mut prefix) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(error) => return Err(error),
        }
        let length = check_length(u32::from_be_bytes(prefix)).map_err(invalid)?;
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        Frame::decode(&body).map(Some).map_err(invalid)
    }
}

fn invalid(error: FrameError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<Frame> {
        vec![
            Frame::Challenge { nonce: [3; 16] },
            Frame::Logon {
                subscribe: true,
                participant: "BRKAAU21XXX".into(),
                mac: [9; 32],
            },
            Frame::LogonOk {
                participant: "BRKAAU21XXX".into(),
            },
            Frame::Message {
                seq: u64::MAX - 1,
                sender: "BRKAAU21XXX".into(),
                signature: [7; 32],
                xml: b"<Msg xmlns=\"urn:ste:trade:1\"/>".to_vec(),
            },
            Frame::Ack {
                seq: 5,
                duplicate: true,
            },
            Frame::Nak {
                seq: 6,
                code: ReasonCode::Auth,
                detail: "not entitled".into(),
            },
            Frame::Push {
                class: PushClass::Cls,
                xml: b"<Cls/>".to_vec(),
            },
            Frame::Heartbeat,
            Frame::Error {
                code: "E_SIZE".into(),
                detail: "too large".into(),
            },
            Frame::Bye,
        ]
    }

    #[test]
    fn every_kind_round_trips_through_a_stream() {
        let bytes: Vec<u8> = every_kind().iter().flat_map(Frame::encode).collect();
        let mut reader = bytes.as_slice();
        for frame in every_kind() {
            assert_eq!(Frame::read_from(&mut reader).expect("reads"), Some(frame));
        }
        assert_eq!(Frame::read_from(&mut reader).expect("end"), None);
    }

    #[test]
    fn oversized_frames_are_refused_from_the_prefix() {
        let declared = 10 * 1024 * 1024_u32;
        assert_eq!(
            check_length(declared),
            Err(FrameError::TooLarge(10 * 1024 * 1024))
        );
        let mut reader = &declared.to_be_bytes()[..];
        let error = Frame::read_from(&mut reader).expect_err("refused");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert_eq!(Frame::decode(b""), Err(FrameError::Empty));
        assert_eq!(Frame::decode(b"Z"), Err(FrameError::UnknownKind(b'Z')));
        assert_eq!(
            Frame::decode(b"M\0\0\0"),
            Err(FrameError::Truncated("message"))
        );
        // A sender length that runs past the end.
        let mut message = vec![b'M'];
        message.extend_from_slice(&1_u64.to_be_bytes());
        message.extend_from_slice(&[200, b'A']);
        assert_eq!(
            Frame::decode(&message),
            Err(FrameError::Truncated("message"))
        );
        let mut nak = vec![b'N'];
        nak.extend_from_slice(&1_u64.to_be_bytes());
        nak.extend_from_slice(&[5, b'E', b'_', b'X', b'Y', b'Z']);
        assert_eq!(
            Frame::decode(&nak),
            Err(FrameError::BadCode("E_XYZ".into()))
        );
        assert_eq!(
            Frame::decode(b"L\x01\x02\xff\xfe"),
            Err(FrameError::BadText("logon"))
        );
    }
}
