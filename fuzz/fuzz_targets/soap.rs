//! The SOAP envelope parser and the MTOM (multipart/related) splitter: any body is a request
//! or a refusal, within the parser's caps.
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    })
}

const CONTENT_TYPE: &str = "multipart/related; type=\"application/xop+xml\"; start=\"<root@ste>\"; start-info=\"application/soap+xml\"; boundary=\"b\"";

fuzz_target!(|data: &[u8]| {
    let _ = ste_bridge::soap::parse_envelope(data, &HashMap::new());
    let body = bytes::Bytes::copy_from_slice(data);
    let split = runtime().block_on(ste_bridge::soap::split_multipart(CONTENT_TYPE, body));
    if let Ok((root, parts)) = split {
        let _ = ste_bridge::soap::parse_envelope(&root, &parts);
    }
});
