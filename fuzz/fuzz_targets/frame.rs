//! The framed-XML decoder: any frame body decodes or is refused, and what decodes encodes back
//! to a frame that decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ste_bridge::frame::{Frame, LENGTH_PREFIX_BYTES};

fuzz_target!(|data: &[u8]| {
    let Ok(frame) = Frame::decode(data) else {
        return;
    };
    let encoded = frame.encode();
    let again = Frame::decode(&encoded[LENGTH_PREFIX_BYTES..]).expect("an encoded frame decodes");
    assert_eq!(frame, again);
    let _ = Frame::read_from(&mut &data[..]);
});
