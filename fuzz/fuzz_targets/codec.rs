//! The canonical XML codec: any bytes parse or are refused with a code, the one-pass reader of
//! the canonical layout reads them exactly as the general parser does, and what parses encodes
//! to a message that parses to the same fields.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ste_engine::codec::{encode_fields, parse_fields, parse_fields_general, Field};

fuzz_target!(|data: &[u8]| {
    let general = parse_fields_general(data);
    let fields = match (parse_fields(data), general) {
        (Ok(fields), Ok(general)) => {
            for field in Field::ALL {
                assert_eq!(fields.get(field), general.get(field), "{field:?}");
            }
            fields
        }
        (Err(refused), Err(general)) => {
            assert_eq!(refused.code, general.code);
            return;
        }
        (fast, general) => panic!("the readers disagree: {fast:?} against {general:?}"),
    };
    let encoded = encode_fields(&fields);
    let again = parse_fields(encoded.as_bytes()).expect("an encoded message parses");
    for field in Field::ALL {
        assert_eq!(fields.get(field), again.get(field), "{field:?}");
    }
    let _ = ste_engine::validate::typed_fields(&fields);
});
