//! The limit probe: how many messages per second this machine could take in if the engine did
//! nothing but the work no engine can skip — check each message's signature and parse it — on
//! every core. A run's throughput is quoted as a fraction of it, measured in the same run, so
//! that figures from a noisy shared machine compare with one another.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use ste_engine::codec::parse_fields;
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::network::{sign_line, Envelope};
use ste_engine::refdata::RefData;
use ste_engine::validate::validate_message;

use crate::MessageSetReader;

/// Messages the probe signs up front and then goes over again and again: enough that each
/// thread's pass reads past the caches, as the engine does.
pub const PROBE_MESSAGES_MAX: usize = 70_000;
/// Messages a probe thread checks between two looks at the clock.
const PROBE_STRIDE: usize = 512;

/// What the limit probe measured.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct LimitProbe {
    /// Messages checked per second, all threads together.
    pub msgs_per_s: f64,
    /// Threads (one per core the process may use).
    pub threads: usize,
    /// Messages checked.
    pub messages: u64,
    /// Of those, how many failed (bad signature or unparsable): the set's faults.
    pub refused: u64,
    pub seconds: f64,
    /// Distinct messages gone over.
    pub distinct: usize,
}

impl LimitProbe {
    /// `msgs_per_s` as a fraction of the probe.
    pub fn fraction(&self, msgs_per_s: f64) -> f64 {
        msgs_per_s / self.msgs_per_s.max(f64::MIN_POSITIVE)
    }
}

/// The first [`PROBE_MESSAGES_MAX`] messages of a generated set, signed as the driver signs them.
pub fn generated_sample(refdata: &RefData, config: &GeneratorConfig) -> Vec<Envelope> {
    Generator::new(refdata, config.clone())
        .take(PROBE_MESSAGES_MAX)
        .map(|line| sign_line(refdata, line, 0, 0))
        .collect()
}

/// The first [`PROBE_MESSAGES_MAX`] messages of a message-set file, signed as the driver signs
/// them.
pub fn file_sample(refdata: &RefData, path: &Path) -> anyhow::Result<Vec<Envelope>> {
    MessageSetReader::open(path)?
        .take(PROBE_MESSAGES_MAX)
        .map(|line| {
            let line = line.context("reading the message set")?;
            Ok(sign_line(refdata, line, 0, 0))
        })
        .collect()
}

/// What a probe thread does to each message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeWork {
    /// Checks its signature and parses it: the limit.
    Limit,
    /// Validates it as a validator does: signature, parse, fields, reference data,
    /// entitlement and dates, into a typed message. Against [`ProbeWork::Limit`] on the same
    /// sample, what the validator adds to the work no engine can skip.
    Validate,
}

/// Checks the signature of every message of `sample` and parses it, over and over, on one
/// thread per core, for `duration`.
pub fn run(refdata: &RefData, sample: &[Envelope], duration: Duration) -> LimitProbe {
    run_work(refdata, sample, duration, ProbeWork::Limit)
}

/// [`run`], doing `work` to each message.
pub fn run_work(
    refdata: &RefData,
    sample: &[Envelope],
    duration: Duration,
    work: ProbeWork,
) -> LimitProbe {
    let threads = std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1);
    let checked = AtomicU64::new(0);
    let refused = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    if !sample.is_empty() {
        std::thread::scope(|scope| {
            for thread in 0..threads {
                let (checked, refused, stop) = (&checked, &refused, &stop);
                scope.spawn(move || {
                    // Each thread starts at its own place, so that they do not read the same
                    // lines at the same moment.
                    let mut position = thread * sample.len() / threads;
                    let (mut done, mut failed) = (0_u64, 0_u64);
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..PROBE_STRIDE {
                            let passed = match work {
                                ProbeWork::Limit => check(refdata, &sample[position]),
                                ProbeWork::Validate => validate(refdata, &sample[position]),
                            };
                            if !passed {
                                failed += 1;
                            }
                            position = (position + 1) % sample.len();
                        }
                        done += PROBE_STRIDE as u64;
                        if thread == 0 && started.elapsed() >= duration {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    checked.fetch_add(done, Ordering::Relaxed);
                    refused.fetch_add(failed, Ordering::Relaxed);
                });
            }
        });
    }
    let seconds = started.elapsed().as_secs_f64();
    let messages = checked.into_inner();
    LimitProbe {
        msgs_per_s: messages as f64 / seconds.max(f64::MIN_POSITIVE),
        threads,
        messages,
        refused: refused.into_inner(),
        seconds,
        distinct: sample.len(),
    }
}

/// The work no engine can skip for one message: its signature against its sender's key, then
/// one parse of its fields. Whether both passed.
fn check(refdata: &RefData, envelope: &Envelope) -> bool {
    let signed = match (&envelope.sender, &envelope.signature) {
        (Some(sender), Some(signature)) => {
            refdata.verify_signature(sender, &envelope.bytes, signature) == Some(true)
        }
        _ => false,
    };
    let parsed = parse_fields(std::hint::black_box(&envelope.bytes)).is_ok();
    signed && parsed
}

/// The validator's whole work for one message, its result dropped. Whether it passed.
fn validate(refdata: &RefData, envelope: &Envelope) -> bool {
    validate_message(
        refdata,
        std::hint::black_box(&envelope.bytes),
        envelope.sender.as_deref(),
        envelope.signature.as_ref().map(|s| s.as_slice()),
    )
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ste_engine::keys::KeyRing;

    #[test]
    fn the_probe_checks_every_message_and_refuses_the_tampered() {
        let refdata = RefData::embedded().expect("reference data");
        let ring = KeyRing::generate_for(&refdata);
        let refdata = refdata.with_keys(&ring).expect("keys");
        let mut sample = generated_sample(&refdata, &GeneratorConfig::clean(10));
        assert_eq!(sample.len(), 70);
        // One message altered after it was signed: the probe must find it every time round.
        let tampered = sample[3].bytes.len() - 10;
        sample[3].bytes[tampered] ^= 1;
        let probe = run(&refdata, &sample, Duration::from_millis(50));
        assert!(probe.messages >= (probe.threads * PROBE_STRIDE) as u64);
        assert_eq!(probe.distinct, 70);
        // Every pass over the 70 messages refuses exactly the tampered one.
        let passes = probe.messages / 70;
        assert!(probe.refused >= passes.saturating_sub(probe.threads as u64));
        assert!(probe.refused <= passes + probe.threads as u64);
        assert!(probe.msgs_per_s > 0.0);
        // The validator alone refuses the same message, and only it, every time round.
        let validated = run_work(
            &refdata,
            &sample,
            Duration::from_millis(50),
            ProbeWork::Validate,
        );
        let passes = validated.messages / 70;
        assert!(validated.messages >= (validated.threads * PROBE_STRIDE) as u64);
        assert!(validated.refused >= passes.saturating_sub(validated.threads as u64));
        assert!(validated.refused <= passes + validated.threads as u64);
    }
}
