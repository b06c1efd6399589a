//! The canonical XML codec: any bytes parse or are refused with a code, and what parses
//! encodes to a message that parses to the same fields.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ste_engine::codec::{encode_fields, parse_fields, Field};

fuzz_target!(|data: &[u8]| {
    let Ok(fields) = parse_fields(data) else {
        return;
    };
    let encoded = encode_fields(&fields);
    let again = parse_fields(encoded.as_bytes()).expect("an encoded message parses");
    for field in Field::ALL {
        assert_eq!(fields.get(field), again.get(field), "{field:?}");
    }
    let _ = ste_engine::validate::typed_fields(&fields);
});
