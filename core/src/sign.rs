//! HMAC-SHA256 message signatures with each participant's key.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// An HMAC-SHA256 state with a participant's key already absorbed: cloning it is cheaper than
/// hashing the key again for every message.
pub type KeyedMac = HmacSha256;

/// Prepares the keyed state of `key`.
pub fn keyed(key: &[u8]) -> KeyedMac {
    HmacSha256::new_from_slice(key).expect("hmac takes keys of any length")
}

/// Signs `bytes` with a prepared key.
pub fn sign_keyed(mac: &KeyedMac, bytes: &[u8]) -> [u8; SIGNATURE_LEN] {
    let mut mac = mac.clone();
    mac.update(bytes);
    mac.finalize().into_bytes().into()
}

/// Checks `signature` over `bytes` with a prepared key, in constant time.
pub fn verify_keyed(mac: &KeyedMac, bytes: &[u8], signature: &[u8]) -> bool {
    let mut mac = mac.clone();
    mac.update(bytes);
    mac.verify_slice(signature).is_ok()
}

/// Length of a signature in bytes.
pub const SIGNATURE_LEN: usize = 32;

/// Signs `bytes` with `key`.
pub fn sign(key: &[u8], bytes: &[u8]) -> [u8; SIGNATURE_LEN] {
    sign_keyed(&keyed(key), bytes)
}

/// An element whose text is read by scanning, not parsing: the bytes between the first
/// `<Name>` and the `</Name>` after it. The searchers are built once (building one costs more
/// than a search through a message).
pub struct Element {
    open: memchr::memmem::Finder<'static>,
    close: memchr::memmem::Finder<'static>,
}

impl Element {
    /// The element `name`.
    pub fn new(name: &str) -> Self {
        Self {
            open: memchr::memmem::Finder::new(format!("<{name}>").as_bytes()).into_owned(),
            close: memchr::memmem::Finder::new(format!("</{name}>").as_bytes()).into_owned(),
        }
    }

    /// The text of the element's first occurrence in `bytes`.
    pub fn text<'a>(&self, bytes: &'a [u8]) -> Option<&'a [u8]> {
        let start = self.open.find(bytes)? + self.open.needle().len();
        let end = start + self.close.find(&bytes[start..])?;
        Some(&bytes[start..end])
    }
}

/// The text of the first `<Sender>…</Sender>` in a line, which names the key that signs it.
pub fn claimed_sender(bytes: &[u8]) -> Option<&str> {
    static SENDER: std::sync::LazyLock<Element> =
        std::sync::LazyLock::new(|| Element::new("Sender"));
    std::str::from_utf8(SENDER.text(bytes)?).ok()
}

/// Position of the first occurrence of `needle` in `haystack`.
pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_element_is_read_from_its_first_occurrence() {
        let broker = Element::new("Broker");
        assert_eq!(
            broker.text(b"<Msg><Broker>A</Broker><Broker>B</Broker></Msg>"),
            Some(&b"A"[..])
        );
        assert_eq!(broker.text(b"<Msg><Broker>A</Msg>"), None);
        assert_eq!(broker.text(b"</Broker><Broker>"), None);
        assert_eq!(
            claimed_sender(b"<Sender>BANKGB2L</Sender>"),
            Some("BANKGB2L")
        );
    }

    #[test]
    fn keyed_states_agree_with_plain_hmac() {
        let mac = keyed(b"key");
        assert_eq!(sign_keyed(&mac, b"message"), sign(b"key", b"message"));
        assert!(verify_keyed(&mac, b"message", &sign(b"key", b"message")));
        assert!(!verify_keyed(&mac, b"other", &sign(b"key", b"message")));
    }

    #[test]
    fn sign_and_verify() {
        let signature = sign(b"key", b"message");
        assert!(verify_keyed(&keyed(b"key"), b"message", &signature));
        assert!(!verify_keyed(&keyed(b"other"), b"message", &signature));
        assert!(!verify_keyed(&keyed(b"key"), b"messagE", &signature));
        assert!(!verify_keyed(&keyed(b"key"), b"message", &signature[..31]));
    }

    #[test]
    fn finds_the_first_sender() {
        let line = b"<Msg><Sender>AAA</Sender><Sender>BBB</Sender></Msg>";
        assert_eq!(claimed_sender(line), Some("AAA"));
        assert_eq!(claimed_sender(b"<Msg></Msg>"), None);
        assert_eq!(claimed_sender(b"<Sender>unterminated"), None);
    }
}
