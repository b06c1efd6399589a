//! The FIX codec and the STE mapping: any bytes parse or are garbled; what parses has its
//! signed part checked (every byte with meaning covered) and maps to a canonical message or
//! a refusal; a mapped message parses.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ste_bridge::fix;

fuzz_target!(|data: &[u8]| {
    let Ok(message) = fix::parse(data) else {
        return;
    };
    let _ = fix::signed_part(data);
    if let Ok(xml) = fix::from_fix(&message, "BRKAAU21XXX") {
        if let Ok(fields) = ste_engine::codec::parse_fields(&xml) {
            let _ = ste_engine::codec::encode_fields(&fields);
        }
        let _ = fix::to_fix(&xml);
    }
});
