//! The bridge between participants and the engine. This crate holds the framed-XML wire
//! format: the frame a participant's connection carries, decoded into the engine's
//! [`Envelope`]. The TCP, SOAP/HTTP and FIX listeners build on it.
//!
//! A frame is `u32` big-endian length of the rest, then `u8` sender length, the sender's BIC,
//! the 32-byte HMAC-SHA256 signature, and the canonical XML bytes of one message.

use ste_engine::pipeline::Envelope;
use ste_engine::sign::SIGNATURE_LEN;
use ste_engine::validate::MESSAGE_SIZE_MAX_BYTES;

/// Length of the length prefix.
const LENGTH_PREFIX_BYTES: usize = 4;
/// Largest sender field (a BIC is 8 or 11 characters; the bound leaves room and stops abuse).
const SENDER_LEN_MAX_BYTES: usize = 32;
/// Largest frame body accepted: one maximal message and its header. A longer declared length is
/// refused before any of it is buffered.
pub const FRAME_BODY_MAX_BYTES: usize =
    1 + SENDER_LEN_MAX_BYTES + SIGNATURE_LEN + MESSAGE_SIZE_MAX_BYTES;

/// One message as a participant sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub sender: String,
    pub signature: [u8; SIGNATURE_LEN],
    pub message: Vec<u8>,
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes is larger than {FRAME_BODY_MAX_BYTES}")]
    TooLarge(usize),
    #[error("frame is shorter than its header")]
    Truncated,
    #[error("sender is not UTF-8 or longer than {SENDER_LEN_MAX_BYTES} bytes")]
    BadSender,
}

impl Frame {
    /// Encodes the frame with its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let body_len = 1 + self.sender.len() + SIGNATURE_LEN + self.message.len();
        let mut out = Vec::with_capacity(LENGTH_PREFIX_BYTES + body_len);
        out.extend_from_slice(&(body_len as u32).to_be_bytes());
        out.push(self.sender.len() as u8);
        out.extend_from_slice(self.sender.as_bytes());
        out.extend_from_slice(&self.signature);
        out.extend_from_slice(&self.message);
        out
    }

    /// Decodes the first frame of `buffer`: `Ok(None)` while more bytes are needed, otherwise the
    /// frame and the number of bytes it used.
    pub fn decode(buffer: &[u8]) -> Result<Option<(Frame, usize)>, FrameError> {
        let Some(prefix) = buffer.get(..LENGTH_PREFIX_BYTES) else {
            return Ok(None);
        };
        let body_len = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
        if body_len > FRAME_BODY_MAX_BYTES {
            return Err(FrameError::TooLarge(body_len));
        }
        let Some(body) = buffer.get(LENGTH_PREFIX_BYTES..LENGTH_PREFIX_BYTES + body_len) else {
            return Ok(None);
        };
        let sender_len = usize::from(*body.first().ok_or(FrameError::Truncated)?);
        if sender_len > SENDER_LEN_MAX_BYTES {
            return Err(FrameError::BadSender);
        }
        let signature_start = 1 + sender_len;
        let message_start = signature_start + SIGNATURE_LEN;
        if body.len() < message_start {
            return Err(FrameError::Truncated);
        }
        let sender = std::str::from_utf8(&body[1..signature_start])
            .map_err(|_| FrameError::BadSender)?
            .to_owned();
        let mut signature = [0_u8; SIGNATURE_LEN];
        signature.copy_from_slice(&body[signature_start..message_start]);
        let frame = Frame {
            sender,
            signature,
            message: body[message_start..].to_vec(),
        };
        Ok(Some((frame, LENGTH_PREFIX_BYTES + body_len)))
    }

    /// The envelope the engine validates: the signature is checked there, with the sender's key.
    pub fn into_envelope(self, correlation: u64, injected_ns: u64) -> Envelope {
        Envelope {
            bytes: self.message,
            sender: Some(self.sender),
            signature: Some(self.signature),
            correlation,
            injected_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame() -> Frame {
        Frame {
            sender: "BRKAAU21XXX".to_owned(),
            signature: [7; SIGNATURE_LEN],
            message: b"<Msg xmlns=\"urn:ste:trade:1\"/>".to_vec(),
        }
    }

    #[test]
    fn round_trip_in_pieces() {
        let bytes = [frame().encode(), frame().encode()].concat();
        for cut in 0..bytes.len() / 2 {
            assert_eq!(Frame::decode(&bytes[..cut]), Ok(None), "cut at {cut}");
        }
        let (first, used) = Frame::decode(&bytes).expect("valid").expect("complete");
        assert_eq!(first, frame());
        let (second, _) = Frame::decode(&bytes[used..])
            .expect("valid")
            .expect("complete");
        assert_eq!(second, frame());
    }

    #[test]
    fn oversized_frames_are_refused_from_the_prefix() {
        let declared = (10 * 1024 * 1024_u32).to_be_bytes();
        assert_eq!(
            Frame::decode(&declared),
            Err(FrameError::TooLarge(10 * 1024 * 1024))
        );
    }

    #[test]
    fn malformed_headers_are_errors() {
        let mut bytes = 3_u32.to_be_bytes().to_vec();
        bytes.extend_from_slice(&[2, b'A', b'B']);
        assert_eq!(Frame::decode(&bytes), Err(FrameError::Truncated));
        let mut bytes = 40_u32.to_be_bytes().to_vec();
        bytes.push(200);
        bytes.extend_from_slice(&[0; 39]);
        assert_eq!(Frame::decode(&bytes), Err(FrameError::BadSender));
    }

    #[test]
    fn a_frame_becomes_a_signed_envelope() {
        let envelope = frame().into_envelope(9, 100);
        assert_eq!(envelope.sender.as_deref(), Some("BRKAAU21XXX"));
        assert_eq!(envelope.signature, Some([7; SIGNATURE_LEN]));
        assert_eq!(envelope.correlation, 9);
    }
}
