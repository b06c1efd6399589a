//! The queue network with real stores: what is acknowledged has been committed, and a store
//! failure stops the pipeline with its cause.

mod common;

use std::sync::Arc;

use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::pipeline::{AckResult, Pipeline, PipelineConfig, PipelineError, StoreConfig};
use ste_engine::profile::Tolerances;
use ste_engine::queue::drain;
use ste_engine::refdata::RefData;
use ste_engine::store::{SqliteStore, Store};

fn refdata() -> Arc<RefData> {
    Arc::new(
        RefData::embedded()
            .expect("reference data loads")
            .with_generated_keys(),
    )
}

fn embedded(dir: &std::path::Path, shards: u32) -> PipelineConfig {
    PipelineConfig {
        shards,
        store: StoreConfig::Embedded {
            dir: dir.to_path_buf(),
        },
        ..PipelineConfig::default()
    }
}

#[test]
fn every_ack_is_for_a_committed_row() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let refdata = refdata();
    let pipeline = Pipeline::start(
        &embedded(dir.path(), 2),
        refdata.clone(),
        Tolerances::default(),
    )
    .expect("starts");
    let acks = pipeline.acks();
    let mut submitter = pipeline.submitter();
    let lines: Vec<Vec<u8>> = Generator::new(&refdata, GeneratorConfig::clean(300)).collect();
    for (index, line) in lines.iter().enumerate() {
        submitter
            .submit_line(&refdata, line.clone(), index as u64)
            .expect("submits");
    }
    submitter.flush().expect("flushes");
    drop(submitter);
    let report = pipeline.finish().expect("finishes");
    let mut correlations: Vec<u64> = drain(&acks)
        .expect("drains")
        .into_iter()
        .map(|ack| {
            assert_eq!(ack.result, AckResult::Accepted);
            ack.correlation
        })
        .collect();
    correlations.sort_unstable();
    assert_eq!(correlations, (0..lines.len() as u64).collect::<Vec<_>>());
    let stored: u64 = report.shard_rows.iter().map(|rows| rows.messages).sum();
    assert_eq!(stored, lines.len() as u64);
    // Reading the files back finds the same rows.
    let mut reread = 0;
    for shard in 0..2 {
        let mut store =
            SqliteStore::open(&dir.path().join(format!("shard-{shard}.sqlite"))).expect("reopens");
        let rows = store.row_counts().expect("counts");
        assert_eq!(rows.cls, report.shards[shard].matched);
        reread += rows.messages;
    }
    assert_eq!(reread, lines.len() as u64);
}

#[test]
fn a_failing_store_acknowledges_nothing_and_reports_its_error() {
    let dir = tempfile::tempdir().expect("temporary folder");
    {
        let mut store = SqliteStore::open(&dir.path().join("shard-0.sqlite")).expect("creates");
        store
            .execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON messages \
                 BEGIN SELECT RAISE(ABORT, 'disk says no'); END",
            )
            .expect("trigger");
    }
    let refdata = refdata();
    let pipeline = Pipeline::start(
        &embedded(dir.path(), 1),
        refdata.clone(),
        Tolerances::default(),
    )
    .expect("starts");
    let acks = pipeline.acks();
    let outbound = pipeline.outbound();
    let mut submitter = pipeline.submitter();
    for (index, line) in Generator::new(&refdata, GeneratorConfig::clean(20)).enumerate() {
        // Once the writer has failed, the queues close and submitting may fail too.
        if submitter.submit_line(&refdata, line, index as u64).is_err() {
            break;
        }
    }
    let _ = submitter.flush();
    drop(submitter);
    let error = pipeline
        .finish()
        .expect_err("the store failure stops the pipeline");
    assert!(matches!(error, PipelineError::Shard { .. }), "{error}");
    assert_eq!(drain(&acks).expect("drains").len(), 0);
    assert_eq!(drain(&outbound).expect("drains").len(), 0);
}

/// Runs `lines` through a pipeline on `config`; returns the acks by result and the CLS emitted
/// as (ClsId, emitted again after a restart).
fn run_lines(
    config: &PipelineConfig,
    refdata: &Arc<RefData>,
    lines: &[Vec<u8>],
) -> (Vec<AckResult>, Vec<(String, bool)>) {
    let pipeline = Pipeline::start(config, refdata.clone(), Tolerances::default()).expect("starts");
    let acks = pipeline.acks();
    let outbound = pipeline.outbound();
    common::submit_all(&pipeline, refdata, lines.iter().cloned());
    pipeline.finish().expect("finishes");
    let results = drain(&acks)
        .expect("drains")
        .into_iter()
        .map(|ack| ack.result)
        .collect();
    let cls = drain(&outbound)
        .expect("drains")
        .into_iter()
        .filter_map(|event| match event {
            ste_engine::pipeline::OutboundEvent::Cls {
                cls_id,
                redelivered,
                ..
            } => Some((cls_id, redelivered)),
            _ => None,
        })
        .collect();
    (results, cls)
}

#[test]
fn confirmed_cls_are_not_emitted_again() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let refdata = refdata();
    let lines: Vec<Vec<u8>> = Generator::new(&refdata, GeneratorConfig::clean(100)).collect();
    let config = PipelineConfig {
        recover: true,
        ..embedded(dir.path(), 2)
    };
    // First run: a consumer confirms every CLS as it arrives.
    let pipeline =
        Pipeline::start(&config, refdata.clone(), Tolerances::default()).expect("starts");
    let outbound = pipeline.outbound();
    let delivery = pipeline.delivery();
    let consumer = std::thread::spawn(move || {
        let mut confirmed = 0;
        while let Ok(Some(received)) = outbound.recv_until(None) {
            for event in received.items {
                if let ste_engine::pipeline::OutboundEvent::Cls {
                    shard, outbox_id, ..
                } = event
                {
                    delivery.confirm(shard, outbox_id).expect("confirms");
                    confirmed += 1;
                }
            }
        }
        confirmed
    });
    let mut submitter = pipeline.submitter();
    for (index, line) in lines.iter().enumerate() {
        submitter
            .submit_line(&refdata, line.clone(), index as u64)
            .expect("submits");
    }
    submitter.flush().expect("flushes");
    drop(submitter);
    pipeline.finish().expect("finishes");
    assert_eq!(consumer.join().expect("consumer"), 100);
    // Second run on the same shards: nothing to emit again.
    let (_, cls) = run_lines(&config, &refdata, &[]);
    assert!(cls.is_empty(), "{} CLS emitted again", cls.len());
}

#[test]
fn a_restarted_pipeline_rebuilds_its_matchers_from_the_shards() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let refdata = refdata();
    let trades = 300;
    let lines: Vec<Vec<u8>> = Generator::new(&refdata, GeneratorConfig::clean(trades)).collect();
    let half = lines.len() / 2 + 3;
    let first = embedded(dir.path(), 2);
    let (results, cls_first) = run_lines(&first, &refdata, &lines[..half]);
    assert!(results.iter().all(|r| *r == AckResult::Accepted));

    // Without recovery, a shard with history is refused.
    let refused = Pipeline::start(&first, refdata.clone(), Tolerances::default());
    assert!(matches!(refused, Err(PipelineError::Config(_))));

    // With recovery, the whole set again: the first part is recognised as duplicates, the rest
    // completes the trades, and no trade matches twice. Nobody confirmed the first run's CLS, so
    // they are emitted again, marked as such.
    let second = PipelineConfig {
        recover: true,
        ..embedded(dir.path(), 2)
    };
    let (results, cls_second) = run_lines(&second, &refdata, &lines);
    let duplicates = results
        .iter()
        .filter(|r| **r == AckResult::Duplicate)
        .count();
    let accepted = results
        .iter()
        .filter(|r| **r == AckResult::Accepted)
        .count();
    assert_eq!(duplicates, half);
    assert_eq!(accepted, lines.len() - half);
    assert!(cls_first.iter().all(|(_, again)| !again));
    let mut emitted_again: Vec<String> = cls_second
        .iter()
        .filter(|(_, again)| *again)
        .map(|(cls_id, _)| cls_id.clone())
        .collect();
    let mut first_ids: Vec<String> = cls_first.iter().map(|(cls_id, _)| cls_id.clone()).collect();
    emitted_again.sort();
    first_ids.sort();
    assert_eq!(emitted_again, first_ids);
    let mut matched: Vec<String> = cls_first
        .into_iter()
        .chain(cls_second.into_iter().filter(|(_, again)| !again))
        .map(|(cls_id, _)| cls_id)
        .collect();
    matched.sort();
    let before = matched.len();
    matched.dedup();
    assert_eq!(before, matched.len(), "a trade matched twice");
    assert_eq!(matched.len() as u64, trades);
}

#[test]
fn runs_with_run_ids_of_their_own_follow_each_other_on_one_store_and_a_repeated_one_meets_the_first(
) {
    let dir = tempfile::tempdir().expect("temporary folder");
    let refdata = refdata();
    let trades = 120;
    let set = |run: &str| -> Vec<Vec<u8>> {
        let config = GeneratorConfig {
            run: run.to_owned(),
            fault_rate: 0.3,
            shuffle: true,
            ..GeneratorConfig::clean(trades)
        };
        Generator::new(&refdata, config).collect()
    };
    let (first, second) = (set("RUN01"), set("RUN02"));
    let text = String::from_utf8_lossy(&first[0]).into_owned();
    assert!(
        text.contains("<TradeRef>TRUN0100000000001</TradeRef>"),
        "{text}"
    );
    assert!(text.contains("-RUN01000000000001-01</MsgId>"), "{text}");
    let accepted = |results: &[AckResult]| {
        results
            .iter()
            .filter(|r| **r == AckResult::Accepted)
            .count()
    };
    let config = embedded(dir.path(), 2);
    let (results_first, cls_first) = run_lines(&config, &refdata, &first);
    // The same seed's trades under another run id: nothing of the first run is met again.
    let again = PipelineConfig {
        recover: true,
        ..embedded(dir.path(), 2)
    };
    let (results_second, cls_second) = run_lines(&again, &refdata, &second);
    let tally = |results: &[AckResult]| {
        let mut answers: Vec<String> = results.iter().map(|r| format!("{r:?}")).collect();
        answers.sort();
        answers
    };
    assert_eq!(tally(&results_second), tally(&results_first));
    assert!(accepted(&results_second) > 500);
    assert_eq!(
        cls_second.iter().filter(|(_, again)| !again).count(),
        cls_first.len()
    );
    assert!(cls_first.len() > 50);
    // The first run's set once more: every message meets its first sending.
    let (results_third, cls_third) = run_lines(&again, &refdata, &first);
    assert_eq!(accepted(&results_third), 0);
    assert!(cls_third.iter().all(|(_, again)| *again));
}

#[test]
fn a_run_id_is_five_of_0_to_9_and_a_to_z() {
    use ste_engine::generator::{is_run_id, random_run_id};
    assert!(is_run_id("K7Q2M"));
    assert!(!is_run_id("k7q2m"));
    assert!(!is_run_id("K7Q2"));
    assert!(!is_run_id("K7Q2M1"));
    assert!(!is_run_id("K7-2M"));
    let drawn: Vec<String> = (0..20).map(|_| random_run_id()).collect();
    assert!(drawn.iter().all(|run| is_run_id(run)), "{drawn:?}");
    let mut distinct = drawn.clone();
    distinct.sort();
    distinct.dedup();
    assert!(distinct.len() > 15, "{drawn:?}");
}

/// `line` with the text of its first `<tag>` element replaced.
fn with_element(line: &[u8], tag: &str, value: &str) -> Vec<u8> {
    let text = std::str::from_utf8(line).expect("UTF-8");
    let open = format!("<{tag}>");
    let start = text.find(&open).expect("the element") + open.len();
    let end = start + text[start..].find('<').expect("its end");
    format!("{}{value}{}", &text[..start], &text[end..]).into_bytes()
}

/// The embedded store's bounded matcher: generations of 32 entries and a filter of 1 KiB
/// (saturated after a few hundred keys, so that nearly every message looks its facts up in the
/// files of retired facts) answer a shuffled fault-mix load exactly as the generator expects.
/// Restarted on the same shards — the matchers rebuilt by taking the history back through the
/// same generations into new files — they answer the same load sent again with every accepted
/// message a duplicate and every rejection the same again.
#[test]
fn a_bounded_matcher_on_the_embedded_store_reads_back_what_it_retired_to_its_files() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let refdata = refdata();
    let (lines, expected) = common::fault_mix(&refdata, 1_500, 29);
    let config = PipelineConfig {
        recover: true,
        matcher_memory: common::tiny_matcher_memory(),
        ..embedded(dir.path(), 2)
    };
    let (results, cls) = run_lines(&config, &refdata, &lines);
    let first = common::outcome_of(&results);
    assert_eq!(first.messages_in, expected.messages_in);
    assert_eq!(first.accepted, expected.accepted);
    assert_eq!(first.duplicates, expected.duplicates);
    assert_eq!(first.exceptions, expected.exceptions);
    assert_eq!(cls.len() as u64, expected.cls);
    assert!(expected.duplicates > 0 && expected.exceptions.contains_key("E_CLOSED"));
    for shard in 0..2 {
        let runs = std::fs::read_dir(dir.path().join(format!("shard-{shard}.retired")))
            .expect("the shard's retired facts")
            .count();
        assert!(runs > 0, "shard {shard} retired facts to its files");
    }

    let (results, cls) = run_lines(&config, &refdata, &lines);
    let again = common::outcome_of(&results);
    assert_eq!(again.messages_in, expected.messages_in);
    assert_eq!(again.accepted, 0, "nothing is accepted twice");
    assert_eq!(again.duplicates, expected.accepted + expected.duplicates);
    assert_eq!(again.exceptions, expected.exceptions);
    assert!(
        cls.iter().all(|(_, again)| *again),
        "no trade matches twice"
    );
}

#[test]
fn a_rejected_msgid_stays_spent_across_a_restart() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let refdata = refdata();
    let lines: Vec<Vec<u8>> = Generator::new(&refdata, GeneratorConfig::clean(1)).collect();
    let competing_noe = with_element(&lines[0], "MsgId", "COMPETING-NOE-1");
    let bad_ccy_alc = with_element(
        &with_element(&lines[1], "MsgId", "BAD-CCY-ALC-1"),
        "Ccy",
        "ZZZ",
    );
    let fixed_alc = with_element(&lines[1], "MsgId", "BAD-CCY-ALC-1");
    let config = PipelineConfig {
        recover: true,
        ..embedded(dir.path(), 2)
    };
    let (first, _) = run_lines(
        &config,
        &refdata,
        &[lines[0].clone(), competing_noe.clone(), bad_ccy_alc.clone()],
    );
    use ste_engine::reason::ReasonCode::{Ccy, Conflict, DupId};
    let mut first_sorted = first.clone();
    first_sorted.sort_by_key(|r| format!("{r:?}"));
    assert_eq!(
        first_sorted,
        vec![
            AckResult::Accepted,
            AckResult::Rejected(Ccy),
            AckResult::Rejected(Conflict)
        ]
    );
    // After a restart: the exact re-sends get their first answers again, and the corrected
    // allocation under the spent MsgId is E_DUPID (it would otherwise be accepted).
    for (line, expected) in [
        (competing_noe, AckResult::Rejected(Conflict)),
        (bad_ccy_alc, AckResult::Rejected(Ccy)),
        (fixed_alc, AckResult::Rejected(DupId)),
    ] {
        let (results, _) = run_lines(&config, &refdata, &[line]);
        assert_eq!(results, vec![expected]);
    }
}

#[test]
fn embedded_retention_deletes_what_expired_and_keeps_undelivered_cls() {
    let dir = tempfile::tempdir().expect("temporary folder");
    let refdata = refdata();
    let config = PipelineConfig {
        recover: true,
        ..embedded(dir.path(), 1)
    };
    // 50 trades whose CLS nobody confirms, and a message that is refused (an exception).
    let mut lines: Vec<Vec<u8>> = Generator::new(&refdata, GeneratorConfig::clean(50)).collect();
    lines.push(b"<Msg>not signed</Msg>".to_vec());
    run_lines(&config, &refdata, &lines);
    let path = dir.path().join("shard-0.sqlite");
    let far_future = time::macros::date!(2040 - 01 - 01);
    {
        let mut store = SqliteStore::open(&path).expect("reopens");
        let before = store.row_counts().expect("counts");
        assert_eq!((before.messages, before.cls), (350, 50));
        // Every trade has expired by 2040, but none of its CLS was confirmed: all kept.
        store.purge(far_future, 30).expect("purges");
        assert_eq!(store.row_counts().expect("counts"), before);
        // Once the sink has confirmed them, they go.
        store
            .execute("INSERT INTO cls_delivery (id, delivered_through) VALUES (1, 1000000) ON CONFLICT (id) DO UPDATE SET delivered_through = excluded.delivered_through")
            .expect("confirmed");
        // Kept ten years, nothing has expired today.
        let today = time::OffsetDateTime::now_utc().date();
        assert!(store.purge(today, 3650).expect("purges").dropped.is_empty());
        assert_eq!(store.row_counts().expect("counts"), before);
        let report = store.purge(far_future, 30).expect("purges");
        assert!(!report.dropped.is_empty());
        let after = store.row_counts().expect("counts");
        assert_eq!((after.messages, after.cls, after.trades), (0, 0, 0));
    }
    // The exception store has its own file, and its own retention; the exceptions of
    // unchecked input have theirs besides, on by default.
    let mut exceptions = SqliteStore::open(&dir.path().join("exceptions.sqlite")).expect("reopens");
    assert_eq!(exceptions.row_counts().expect("counts").exceptions, 1);
    let today = time::OffsetDateTime::now_utc().date();
    assert_eq!(
        exceptions
            .purge_unchecked_exceptions(today)
            .expect("purges"),
        0
    );
    assert_eq!(exceptions.row_counts().expect("counts").exceptions, 1);
    let tomorrow = today + time::Duration::days(1);
    assert_eq!(
        exceptions
            .purge_unchecked_exceptions(tomorrow)
            .expect("purges"),
        1
    );
    assert_eq!(exceptions.row_counts().expect("counts").exceptions, 0);
    exceptions.purge(far_future, 30).expect("purges");
    assert_eq!(exceptions.row_counts().expect("counts").exceptions, 0);
}
