//! The JetStream carrier of the queue seam and the shard leases against a real `nats-server`
//! (2.9.10 here) that each test starts on a port and store folder of its own.

mod common;

use std::time::{Duration, Instant};

use common::NatsServer;
use futures_util::StreamExt;

use ste_engine::lease::{Leased, Leases};
use ste_engine::matcher::MatcherMemory;
use ste_engine::queue::jetstream::{JetStream, QueueLimits};
use ste_engine::queue::{BatchReceiver, BatchSender, QueueError};
use ste_engine::refdata::RefData;

/// A cluster of `shards` whose queues are all [`ROOMY`], made on `jetstream`.
fn roomy_layout(jetstream: &JetStream, shards: u32) -> ste_engine::cluster::ClusterLayout {
    let layout = ste_engine::cluster::ClusterLayout {
        shards,
        inbound: ROOMY,
        cls: ROOMY,
        ..Default::default()
    };
    layout.ensure(jetstream).expect("streams");
    layout
}

const ROOMY: QueueLimits = QueueLimits {
    batches_max: 1_000,
    bytes_max: 64 * 1024 * 1024,
};

/// Waits (5 s at most, else fails saying `what`) until the stream of `queue` holds at most
/// `batches`: acknowledgements travel on their own, and the server removes a batch once it has
/// its acknowledgement.
fn wait_until_it_holds(jetstream: &JetStream, queue: &str, batches: u64, what: &str) {
    let started = Instant::now();
    while jetstream.queue_len(queue).expect("stream state") > batches {
        assert!(started.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn next(receiver: &impl BatchReceiver<u64>) -> ste_engine::queue::Received<u64> {
    receiver
        .recv_until(Some(Instant::now() + Duration::from_secs(5)))
        .expect("receives")
        .expect("a batch within 5 s")
}

#[test]
fn batches_cross_in_order_with_their_enqueue_time_and_leave_once_acknowledged() {
    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    jetstream.ensure_queue("match.0", ROOMY).expect("stream");
    let sender = jetstream.sender::<u64>("match.0");
    let receiver = jetstream
        .receiver::<u64>("match.0", "owner", false)
        .expect("consumer");
    let before_ns = receiver.now_ns();
    sender.send(vec![1, 2, 3]).expect("sends");
    sender.send(Vec::new()).expect("an empty batch is not sent");
    sender.send(vec![4]).expect("sends");
    assert_eq!(sender.station().read().arrivals, 4);
    assert_eq!(jetstream.queue_len("match.0").expect("info"), 2);

    let first = next(&receiver);
    let second = next(&receiver);
    assert_eq!(
        (first.items.clone(), second.items.clone()),
        (vec![1, 2, 3], vec![4])
    );
    assert!(first.enqueued_ns >= before_ns && first.enqueued_ns <= receiver.now_ns());
    assert_eq!(receiver.station().read().arrivals, 4);
    first.receipt.ack().expect("acks");
    second.receipt.ack().expect("acks");
    // Work-queue retention: acknowledged batches are gone from the stream.
    wait_until_it_holds(&jetstream, "match.0", 0, "acked batches stay");
    assert!(receiver
        .recv_until(Some(Instant::now() + Duration::from_millis(200)))
        .expect("waits")
        .is_none());
}

/// A connection to `server` and the queue `queue` on it, holding `batches` batches: 0, 1, ...
fn queue_holding(server: &NatsServer, queue: &str, batches: u64) -> JetStream {
    let jetstream = JetStream::connect(&server.url).expect("connects");
    jetstream.ensure_queue(queue, ROOMY).expect("stream");
    let sender = jetstream.sender::<u64>(queue);
    for batch in 0..batches {
        sender.send(vec![batch]).expect("sends");
    }
    jetstream
}

#[test]
fn a_batch_not_acknowledged_comes_back_in_order_to_a_fresh_consumer() {
    let server = NatsServer::start();
    let jetstream = queue_holding(&server, "match.1", 3);
    {
        let owner = jetstream
            .receiver::<u64>("match.1", "owner", false)
            .expect("consumer");
        let first = next(&owner);
        assert_eq!(first.items, vec![0]);
        first.receipt.ack().expect("acks");
        // The acknowledgement is on its way; the server removes the batch once it has it (a
        // consumer re-created before that would see the batch again, which owners allow for).
        wait_until_it_holds(
            &jetstream,
            "match.1",
            2,
            "the acknowledgement never arrived",
        );
        // Taken but never acknowledged: the owner dies with it.
        let lost = next(&owner);
        assert_eq!(lost.items, vec![1]);
        drop(lost);
    }
    let successor = jetstream
        .receiver::<u64>("match.1", "owner", true)
        .expect("a fresh consumer");
    assert_eq!(next(&successor).items, vec![1]);
    assert_eq!(next(&successor).items, vec![2]);
}

#[test]
fn a_full_queue_makes_its_sender_wait_and_nothing_is_dropped() {
    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    jetstream
        .ensure_queue(
            "store.0",
            QueueLimits {
                batches_max: 2,
                bytes_max: 1024 * 1024,
            },
        )
        .expect("stream");
    let sender = jetstream.sender::<u64>("store.0");
    sender.send(vec![1]).expect("sends");
    sender.send(vec![2]).expect("sends");
    let waiting = std::thread::spawn(move || sender.send(vec![3]));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished(), "a third batch waits for room");
    let receiver = jetstream
        .receiver::<u64>("store.0", "owner", false)
        .expect("consumer");
    let first = next(&receiver);
    first
        .receipt
        .ack()
        .expect("acks: the batch leaves the stream");
    waiting
        .join()
        .expect("the sender returns")
        .expect("the third batch is sent once there is room");
    let rest: Vec<u64> = (0..2).flat_map(|_| next(&receiver).items).collect();
    assert_eq!((first.items, rest), (vec![1], vec![2, 3]));
}

#[test]
fn a_forwarded_batch_acknowledges_its_source_once_the_server_holds_it() {
    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    jetstream.ensure_queue("inbound.0", ROOMY).expect("stream");
    jetstream.ensure_queue("match.0", ROOMY).expect("stream");
    jetstream
        .sender::<u64>("inbound.0")
        .send(vec![7, 8])
        .expect("sends");
    let inbound = jetstream
        .receiver::<u64>("inbound.0", "validators", false)
        .expect("consumer");
    let received = next(&inbound);
    let doubled: Vec<u64> = received.items.iter().map(|item| item * 2).collect();
    jetstream
        .sender::<u64>("match.0")
        .forward(doubled, received.receipt)
        .expect("forwards");
    wait_until_it_holds(
        &jetstream,
        "inbound.0",
        0,
        "the inbound batch was not acknowledged",
    );
    let matched = jetstream
        .receiver::<u64>("match.0", "owner", false)
        .expect("consumer");
    assert_eq!(next(&matched).items, vec![14, 16]);
}

#[test]
fn a_stopped_receiver_ends_its_wait_as_closed() {
    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    jetstream.ensure_queue("acks.g1", ROOMY).expect("stream");
    let receiver = jetstream
        .receiver::<u64>("acks.g1", "gateway", false)
        .expect("consumer");
    receiver.stopper().stop();
    assert!(matches!(
        receiver.recv_until(None),
        Err(QueueError::Closed { .. })
    ));
}

#[test]
fn a_batch_over_the_payload_limit_is_split_and_arrives_whole() {
    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    jetstream.ensure_queue("match.3", ROOMY).expect("stream");
    let items: Vec<Vec<u8>> = (0..3_u8).map(|i| vec![i; 400 * 1024]).collect();
    jetstream
        .sender::<Vec<u8>>("match.3")
        .send(items.clone())
        .expect("sends 1.2 MB past a 1 MiB payload limit");
    let receiver = jetstream
        .receiver::<Vec<u8>>("match.3", "owner", false)
        .expect("consumer");
    let mut arrived = Vec::new();
    let mut batches = 0;
    while arrived.len() < items.len() {
        let received = receiver
            .recv_until(Some(Instant::now() + Duration::from_secs(5)))
            .expect("receives")
            .expect("a batch");
        batches += 1;
        arrived.extend(received.items);
        received.receipt.ack().expect("acks");
    }
    assert!(batches >= 2, "split into {batches} batches");
    assert_eq!(arrived, items);
}

#[test]
fn a_shard_lease_is_held_by_one_node_renewed_and_won_by_another_once_it_expires() {
    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    let ttl = Duration::from_secs(1);
    let leases = Leases::open(&jetstream, ttl).expect("the lease bucket");
    let mut first = leases
        .try_acquire(Leased::Shard(2), "node-a")
        .expect("asks")
        .expect("a free shard is won");
    assert_eq!(
        leases
            .try_acquire(Leased::Shard(2), "node-b")
            .expect("asks"),
        None,
        "a held shard is refused"
    );
    assert_eq!(
        leases.holder(Leased::Shard(2)).expect("asks").as_deref(),
        Some("node-a")
    );
    // Renewing within the time to live keeps it past the first time to live.
    for _ in 0..3 {
        std::thread::sleep(ttl / 2);
        assert!(leases.renew(&mut first, "node-a").expect("renews"));
        assert!(leases.holds(&first));
        assert_eq!(
            leases
                .try_acquire(Leased::Shard(2), "node-b")
                .expect("asks"),
            None
        );
    }
    // node-a stalls: its entry expires and node-b wins the shard with a larger token.
    let started = Instant::now();
    let second = loop {
        if let Some(lease) = leases
            .try_acquire(Leased::Shard(2), "node-b")
            .expect("asks")
        {
            break lease;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the expired lease was never won"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        started.elapsed() >= ttl / 2,
        "won while node-a's lease lived"
    );
    assert!(second.token > first.token, "{second:?} after {first:?}");
    assert!(!leases.holds(&first), "node-a knows by its own clock");
    assert!(
        !leases.renew(&mut first, "node-a").expect("asks"),
        "a lost lease is not renewed"
    );
    assert_eq!(
        leases.holder(Leased::Shard(2)).expect("asks").as_deref(),
        Some("node-b")
    );
    // Another shard is independent.
    assert!(leases
        .try_acquire(Leased::Shard(3), "node-a")
        .expect("asks")
        .is_some());
}

/// The configuration of `node`'s ownership of `shard` of `shards`, on `database_url`.
fn owner_config(
    node: &str,
    shard: u32,
    shards: u32,
    database_url: &str,
) -> ste_engine::cluster::ShardOwnerConfig {
    ste_engine::cluster::ShardOwnerConfig {
        node_id: node.to_owned(),
        shard,
        shards,
        database_url: database_url.to_owned(),
        tolerances: ste_engine::profile::Tolerances::default(),
        aging: None,
        batch_max: ste_engine::pipeline::BatchBound {
            messages: 64,
            ..Default::default()
        },
        retry: ste_engine::pipeline::RetryPolicy::default(),
        // Small generations: what the shard commits is soon only in the filter and the store.
        matcher_memory: MatcherMemory {
            generation_entries: 16,
            filter_bytes: 4096,
            ..MatcherMemory::default()
        },
    }
}

/// Every answer on `acks` until `count` messages are answered (30 s at most), by correlation.
fn answers_of(
    acks: &impl BatchReceiver<ste_engine::pipeline::Ack>,
    count: usize,
) -> std::collections::BTreeMap<u64, Vec<ste_engine::pipeline::AckResult>> {
    let mut results: std::collections::BTreeMap<u64, Vec<_>> = Default::default();
    let started = Instant::now();
    while results.len() < count {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{} of {count} answered: {results:?}",
            results.len()
        );
        if let Some(received) = acks
            .recv_until(Some(Instant::now() + Duration::from_millis(50)))
            .expect("answers")
        {
            for ack in received.items {
                results.entry(ack.correlation).or_default().push(ack.result);
            }
        }
    }
    results
}

#[test]
fn a_shard_owner_checks_every_signature_itself_and_refuses_another_shards_trade() {
    use std::sync::Arc;
    use ste_engine::cluster::{ClusterLayout, ShardOwner};
    use ste_engine::generator::{Generator, GeneratorConfig};
    use ste_engine::pipeline::{inbound_index, sign_line, Ack, AckResult, Envelope};
    use ste_engine::reason::ReasonCode;
    use ste_engine::store::{PgStore, Store};

    let server = NatsServer::start();
    let databases = common::TempDatabases::create("owner_checks", 2);
    let urls = databases.urls();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    roomy_layout(&jetstream, 2);
    let leases = Arc::new(Leases::open(&jetstream, Duration::from_secs(5)).expect("leases"));
    let refdata = Arc::new(
        RefData::embedded()
            .expect("reference data")
            .with_generated_keys(),
    );
    let lines: Vec<Vec<u8>> = Generator::new(&refdata, GeneratorConfig::clean(40)).collect();
    let of_shard = |shard: usize| {
        lines
            .iter()
            .filter(move |line| inbound_index(line, 2) == shard)
            .cloned()
    };
    let mut own = of_shard(0);
    let signed = |line: Vec<u8>, correlation: u64| sign_line(&refdata, line, correlation, 0);
    // 0: shard 0's own; 1: shard 1's trade, put on shard 0's queue (as a gateway whose scan of
    // the bytes saw another key would); 2: a forged signature; 3: no signature at all.
    let mut forged = signed(own.next().expect("a line"), 2);
    if let Some(signature) = forged.signature.as_mut() {
        signature[0] ^= 1;
    }
    let mut unsigned = signed(own.next().expect("a line"), 3);
    unsigned.signature = None;
    let batch: Vec<Envelope> = vec![
        signed(own.next().expect("a line"), 0),
        signed(of_shard(1).next().expect("a line"), 1),
        forged,
        unsigned,
    ];
    // Answers to gateway number 0 (the envelopes' origin), heard before anything is sent.
    let acks = jetstream
        .plain_receiver::<Ack>(&ClusterLayout::ack_topic(0), "acks")
        .expect("subscribes");
    jetstream
        .sender::<Envelope>(&ClusterLayout::inbound_queue(0))
        .send(batch)
        .expect("publishes straight onto shard 0's inbound queue");
    let owners: Vec<ShardOwner> = (0..2)
        .map(|shard| {
            ShardOwner::take_over(
                &jetstream,
                leases.clone(),
                &owner_config("node-a", shard, 2, &urls[shard as usize]),
                refdata.clone(),
                Duration::from_secs(10),
            )
            .expect("takes over")
            .expect("wins the shard")
        })
        .collect();
    let answers = answers_of(&acks, 4);
    assert_eq!(answers[&0], vec![AckResult::Accepted]);
    assert_eq!(
        answers[&1],
        vec![AckResult::Rejected(ReasonCode::Parse)],
        "another shard's trade is refused: an owner puts nothing onto inbound queues"
    );
    assert_eq!(answers[&2], vec![AckResult::Rejected(ReasonCode::Sig)]);
    assert_eq!(answers[&3], vec![AckResult::Rejected(ReasonCode::Sig)]);
    for owner in owners {
        owner.stop().writer.expect("the owner stops cleanly");
    }
    let rows = |shard: usize| {
        PgStore::open(&urls[shard])
            .expect("opens")
            .row_counts()
            .expect("counts")
    };
    let (zero, one) = (rows(0), rows(1));
    assert_eq!(
        (zero.messages, zero.exceptions),
        (1, 3),
        "shard 0 keeps its own message and its three rejections"
    );
    assert_eq!(
        (one.messages, one.exceptions),
        (0, 0),
        "nothing reaches shard 1 through shard 0's queue"
    );
    for shard in 0..2 {
        assert_eq!(
            jetstream
                .queue_len(&ClusterLayout::inbound_queue(shard))
                .expect("info"),
            0,
            "every batch acknowledged once committed"
        );
    }
}

#[test]
fn a_shard_taken_over_after_its_owner_stopped_ends_with_one_cls_per_trade_and_nothing_twice() {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Arc;
    use ste_engine::cluster::{ClusterLayout, ShardOwner};
    use ste_engine::generator::{Generator, GeneratorConfig};
    use ste_engine::pipeline::{sign_line, Ack, AckResult, Envelope, OutboundEvent};
    use ste_engine::store::{PgStore, Store};

    let server = NatsServer::start();
    let databases = common::TempDatabases::create("takeover", 1);
    let database_url = databases.urls()[0].clone();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    roomy_layout(&jetstream, 1);
    let leases = Arc::new(Leases::open(&jetstream, Duration::from_secs(1)).expect("leases"));
    let refdata = Arc::new(
        RefData::embedded()
            .expect("reference data")
            .with_generated_keys(),
    );
    let trades = 300_u64;
    let envelopes: Vec<Envelope> = Generator::new(&refdata, GeneratorConfig::clean(trades))
        .enumerate()
        .map(|(index, line)| sign_line(&refdata, line, index as u64, 0))
        .collect();
    // Envelopes published here carry gateway number 0: their answers come back on ack.0.
    let ack_rx = jetstream
        .plain_receiver::<Ack>(&ClusterLayout::ack_topic(0), "acks")
        .expect("subscribes");
    let inbound = jetstream.sender::<Envelope>(&ClusterLayout::inbound_queue(0));
    for batch in envelopes.chunks(64) {
        inbound.send(batch.to_vec()).expect("publishes");
    }
    let out_rx = jetstream
        .receiver::<OutboundEvent>(ClusterLayout::CLS_QUEUE, "test", false)
        .expect("consumer");
    let config = |node: &str| owner_config(node, 0, 1, &database_url);
    let mut cls: BTreeSet<String> = BTreeSet::new();
    let mut results: BTreeMap<u64, Vec<AckResult>> = BTreeMap::new();
    let collect = |cls: &mut BTreeSet<String>, results: &mut BTreeMap<u64, Vec<AckResult>>| {
        while let Some(received) = ack_rx
            .recv_until(Some(Instant::now() + Duration::from_millis(5)))
            .expect("answers")
        {
            for ack in received.items {
                results.entry(ack.correlation).or_default().push(ack.result);
            }
        }
        while let Some(received) = out_rx
            .recv_until(Some(Instant::now() + Duration::from_millis(20)))
            .expect("outbound")
        {
            for event in received.items {
                if let OutboundEvent::Cls { cls_id, .. } = event {
                    cls.insert(cls_id);
                }
            }
        }
    };
    let take_over = |node: &str| {
        ShardOwner::take_over(
            &jetstream,
            leases.clone(),
            &config(node),
            refdata.clone(),
            Duration::from_secs(10),
        )
        .expect("takes over")
        .expect("wins the shard within 10 s")
    };

    let first = take_over("node-a");
    let started = Instant::now();
    while cls.len() < 50 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "node-a made no progress"
        );
        collect(&mut cls, &mut results);
    }
    // node-a stops mid-run without giving the lease back, as a node that died would.
    let first_report = first.stop();
    first_report
        .writer
        .expect("node-a's writer stopped cleanly");
    let second = take_over("node-b");
    assert!(second.token() > first_report.token);
    let started = Instant::now();
    while (cls.len() as u64) < trades {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} CLS of {trades}",
            cls.len()
        );
        collect(&mut cls, &mut results);
    }
    let second_report = second.stop();
    second_report
        .writer
        .expect("node-b's writer stopped cleanly");
    let started = Instant::now();
    while results.len() < envelopes.len() && started.elapsed() < Duration::from_secs(10) {
        collect(&mut cls, &mut results);
    }
    assert_eq!(cls.len() as u64, trades, "one CLS per trade");

    // Every message answered, accepted exactly once (a batch node-a committed and did not
    // acknowledge came back to node-b, which knew it from the shard: duplicate).
    assert_eq!(results.len(), envelopes.len(), "every message answered");
    let accepted = results
        .values()
        .filter(|answers| answers.contains(&AckResult::Accepted))
        .count();
    assert_eq!(accepted, envelopes.len());
    assert!(results.values().all(|answers| answers
        .iter()
        .all(|result| matches!(result, AckResult::Accepted | AckResult::Duplicate))
        && answers
            .iter()
            .filter(|r| **r == AckResult::Accepted)
            .count()
            == 1));
    let rows = PgStore::open(&database_url)
        .expect("opens")
        .row_counts()
        .expect("counts");
    assert_eq!(
        rows.messages,
        envelopes.len() as u64,
        "every message stored once"
    );
    assert_eq!(rows.cls, trades, "one outbox row per trade");
}

#[test]
fn nodes_that_make_the_same_queues_at_once_all_succeed() {
    let nats = NatsServer::start();
    // Eight nodes starting together each make the cluster's queues, as `engine` does: connected
    // first, then let go at once on each of many fresh queues.
    const NODES: usize = 8;
    let start = std::sync::Arc::new(std::sync::Barrier::new(NODES));
    let makers: Vec<_> = (0..NODES)
        .map(|_| {
            let jetstream = JetStream::connect(&nats.url).expect("connects");
            let start = start.clone();
            std::thread::spawn(move || {
                // Every round, whatever the one before gave: a node that stopped early would
                // leave the others waiting at the barrier.
                let results: Vec<_> = (0..200)
                    .map(|round| {
                        start.wait();
                        jetstream.ensure_queue(&format!("race.{round}"), ROOMY)
                    })
                    .collect();
                results.into_iter().collect::<Result<Vec<()>, _>>()
            })
        })
        .collect();
    for maker in makers {
        maker.join().expect("no panic").expect("the queues exist");
    }
}

/// Takes the next delivery of `durable` on the stream of `queue` through a connection of its
/// own and never acknowledges it: to the consumer's owner, that delivery is lost on its way, as
/// one on the wire when the server restarts is. The server holds it as pending until its ack
/// wait (30 s) runs out.
fn lose_one_delivery(url: &str, queue: &str, durable: &str) -> u64 {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let client = async_nats::connect(url).await.expect("connects");
        let consumer: async_nats::jetstream::consumer::PullConsumer =
            async_nats::jetstream::new(client)
                .get_stream(ste_engine::queue::jetstream::stream_name(queue))
                .await
                .expect("the stream")
                .get_consumer(durable)
                .await
                .expect("the consumer");
        // A pull that waits: one that returns at once finds nothing when the server answers
        // before it has the batch ready for the consumer (seen once in a full test run).
        let delivered = consumer
            .batch()
            .max_messages(1)
            .expires(std::time::Duration::from_secs(10))
            .messages()
            .await
            .expect("a pull")
            .next()
            .await
            .expect("a delivery")
            .expect("a delivery");
        let items: Vec<u64> = postcard::from_bytes(&delivered.payload).expect("a batch");
        items[0]
    })
}

/// The first item of each of the next `batches` batches, each acknowledged as it comes.
fn take_acknowledged(receiver: &impl BatchReceiver<u64>, batches: usize) -> Vec<u64> {
    (0..batches)
        .map(|_| {
            let received = next(receiver);
            received.receipt.ack().expect("acks");
            received.items[0]
        })
        .collect()
}

#[test]
fn a_delivery_lost_on_its_way_comes_again_before_the_batches_behind_it() {
    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    jetstream.ensure_queue("match.2", ROOMY).expect("stream");
    let sender = jetstream.sender::<u64>("match.2");
    let owner = jetstream
        .receiver::<u64>("match.2", "owner", false)
        .expect("consumer");
    sender.send(vec![0]).expect("sends");
    let first = next(&owner);
    assert_eq!(first.items, vec![0]);
    first.receipt.ack().expect("acks");
    wait_until_it_holds(&jetstream, "match.2", 0, "the ack never arrived");
    for batch in 1..4_u64 {
        sender.send(vec![batch]).expect("sends");
    }
    assert_eq!(lose_one_delivery(&server.url, "match.2", "owner"), 1);
    // The owner sees the consumer's delivery numbers jump and takes the queue again from its
    // first unacknowledged batch, instead of serving 2 and 3 and then 1 half a minute later.
    assert_eq!(take_acknowledged(&owner, 3), vec![1, 2, 3]);
}

#[test]
fn a_new_owner_whose_first_deliveries_a_stalled_owner_took_gets_them_first_and_in_order() {
    let server = NatsServer::start();
    let jetstream = queue_holding(&server, "in.5", 4);
    // The new owner takes the queue over: it makes the consumer afresh. Before it pulls, the
    // owner it replaced, back from a stall and not yet aware of it, pulls the first delivery
    // through the same durable name and never acknowledges it.
    let owner = jetstream
        .receiver::<u64>("in.5", "owner-5", true)
        .expect("consumer");
    assert_eq!(lose_one_delivery(&server.url, "in.5", "owner-5"), 0);
    // Its first delivery is numbered 2, not 1: it takes the queue again instead of serving
    // 1, 2 and 3 and then 0 half a minute later (a trade's late message answered E_CONFLICT
    // instead of E_CLOSED).
    assert_eq!(take_acknowledged(&owner, 4), vec![0, 1, 2, 3]);
}

#[test]
fn a_cluster_sinks_confirmations_reach_the_book_as_each_shards_highest_and_none_is_lost_at_the_end()
{
    use std::sync::Arc;
    use ste_engine::lease::DeliveryBook;
    use ste_engine::network::Delivery;

    let server = NatsServer::start();
    let jetstream = JetStream::connect(&server.url).expect("connects");
    let book = Arc::new(DeliveryBook::open(&jetstream).expect("the delivery book"));
    let delivery = Delivery::cluster(book.clone());
    delivery
        .confirm_all(&[(0, 5), (1, 3), (0, 9), (0, 7)])
        .expect("confirms");
    // Written by the confirmer's thread within its interval.
    let started = Instant::now();
    while book.delivered_through(0).expect("reads") < 9 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "shard 0's confirmation never reached the book"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(book.delivered_through(1).expect("reads"), 3);
    // Lower than what the book holds: the watermark does not go back.
    delivery.confirm(0, 8).expect("confirms");
    delivery.flush().expect("flushes");
    assert_eq!(book.delivered_through(0).expect("reads"), 9);
    // What a sink confirms just before it ends is in the book once its delivery is dropped.
    delivery.confirm(2, 11).expect("confirms");
    drop(delivery);
    assert_eq!(book.delivered_through(2).expect("reads"), 11);
}
