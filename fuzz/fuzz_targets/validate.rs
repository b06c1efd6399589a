//! The validator end to end: the input is signed with the key of the participant its first
//! `<Sender>` names, so that the checks behind the signature (parse, fields, reference data,
//! entitlement, dates) see it. Nothing panics; the answer is a message or a reason code.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ste_engine::refdata::RefData;

fn refdata() -> &'static RefData {
    static REFDATA: OnceLock<RefData> = OnceLock::new();
    REFDATA.get_or_init(|| {
        RefData::embedded()
            .expect("reference data")
            .with_generated_keys()
    })
}

fuzz_target!(|data: &[u8]| {
    let refdata = refdata();
    let envelope = ste_engine::pipeline::sign_line(refdata, data.to_vec(), 0, 0);
    let result = ste_engine::validate::validate_message(
        refdata,
        &envelope.bytes,
        envelope.sender.as_deref(),
        envelope.signature.as_ref().map(|s| s.as_slice()),
    );
    // Whatever is remembered of a refusal is remembered under its signer.
    if let Err(refusal) = result {
        if let Some(identity) = refusal.identity {
            assert_eq!(Some(identity.sender.as_str()), envelope.sender.as_deref());
        }
    }
});
