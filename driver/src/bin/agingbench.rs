//! `agingbench`: what unmatched trades cost a matcher, and what aging gives back.
//!
//! Loads `--trades N` standard trades with their last message missing into one matcher, as a
//! participant that never completes its trades would, then ages them out and prints the bytes
//! the process holds (counted by the allocator itself) and its resident set before and after.
//!
//! `cargo run --release -p ste-driver --bin agingbench -- --trades 200000`

use std::sync::Arc;

use cap::Cap;
use ste_bridge::bench::{arg, rss_bytes as rss_of};
use ste_engine::codec::parse_fields;
use ste_engine::generator::{Generator, GeneratorConfig, MESSAGES_PER_TRADE};
use ste_engine::matcher::{Content, Matcher, TradeStatus};
use ste_engine::profile::Tolerances;
use ste_engine::refdata::RefData;
use ste_engine::validate::typed_fields;

#[global_allocator]
static ALLOCATOR: Cap<mimalloc::MiMalloc> = Cap::new(mimalloc::MiMalloc, usize::MAX);

/// The resident set of this process.
fn rss_bytes() -> u64 {
    rss_of("self")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> anyhow::Result<()> {
    let trades = arg("--trades", 200_000);
    let business_days = arg("--business-days", 20) as u32;
    let refdata = Arc::new(RefData::embedded()?.with_generated_keys());
    let mut matcher = Matcher::new(refdata.clone(), Tolerances::default());
    let day = time::OffsetDateTime::now_utc().date();
    let baseline = ALLOCATOR.allocated() as u64;
    let started = std::time::Instant::now();
    let held = load(&mut matcher, &refdata, trades, 1, day)?;
    let loaded = ALLOCATOR.allocated() as u64;
    let rss_loaded = rss_bytes();
    let counts = matcher.counts();
    eprintln!(
        "loaded {held} messages of {trades} incomplete trades in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Sixty calendar days later every one of them has waited more than the aging period.
    let later = day + time::Duration::days(60);
    let started = std::time::Instant::now();
    let aged = matcher.age_out(later, business_days);
    let aging_s = started.elapsed().as_secs_f64();
    let after = ALLOCATOR.allocated() as u64;
    let rss_after = rss_bytes();
    let sample = aged.first().map(|trade| trade.trade_key.clone());
    drop(aged);
    let after_advices = ALLOCATOR.allocated() as u64;
    println!("agingbench: {trades} trades left without their last message, aged after {business_days} business days");
    println!("  pending trades before aging   {:>12}", counts.pending);
    println!(
        "  heap held by the matcher      {:>9.1} MiB  ({:.0} bytes a trade)",
        mib(loaded - baseline),
        (loaded - baseline) as f64 / trades as f64
    );
    println!(
        "  resident set                  {:>9.1} MiB",
        mib(rss_loaded)
    );
    println!(
        "  aged out                      {:>12}  in {aging_s:.2} s",
        matcher.counts().aged
    );
    println!(
        "  heap held after aging         {:>9.1} MiB  ({:.0} bytes a trade: MsgId memory and the closed trade)",
        mib(after_advices - baseline),
        (after_advices - baseline) as f64 / trades as f64
    );
    println!(
        "  heap with the aged list       {:>9.1} MiB",
        mib(after - baseline)
    );
    println!(
        "  resident set after aging      {:>9.1} MiB",
        mib(rss_after)
    );
    if let Some(key) = sample {
        assert_eq!(matcher.status_of(&key), Some(TradeStatus::Aged));
    }
    // As many again, later: the memory aging gave back is used again instead of grown.
    load(&mut matcher, &refdata, trades, 2, later)?;
    println!(
        "  heap after as many again      {:>9.1} MiB",
        mib(ALLOCATOR.allocated() as u64 - baseline)
    );
    println!(
        "  resident set after that       {:>9.1} MiB",
        mib(rss_bytes())
    );
    Ok(())
}

/// Feeds `trades` standard trades of generator seed `seed`, each without its last message.
fn load(
    matcher: &mut Matcher,
    refdata: &RefData,
    trades: u64,
    seed: u64,
    day: time::Date,
) -> anyhow::Result<u64> {
    let config = GeneratorConfig {
        seed,
        ..GeneratorConfig::clean(trades)
    };
    let mut held = 0;
    for (index, line) in Generator::new(refdata, config).enumerate() {
        // The last message of every trade never comes.
        if index % MESSAGES_PER_TRADE == MESSAGES_PER_TRADE - 1 {
            continue;
        }
        let msg = typed_fields(&parse_fields(&line).map_err(|r| anyhow::anyhow!(r.detail))?)
            .map_err(|r| anyhow::anyhow!(r.detail))?;
        matcher.process(
            Box::new(msg),
            Content::of(&line),
            0,
            "2026-12-01T00:00:00.000Z",
            day,
        );
        held += 1;
    }
    Ok(held)
}
