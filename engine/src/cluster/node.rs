//! A node of a cluster: it contends for the shards whose leases nobody holds, owns what it wins
//! ([`super::owner`]), and keeps the shards balanced between the nodes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::owner::LEASE_POLLS_PER_TTL;
use super::{ClusterLayout, ShardOwner, ShardOwnerConfig};
use crate::cluster_samples::{NodeSampler, StationBoard};
use crate::lease::{LeaseKeeper, Leased, Leases};
use crate::matcher::MatcherMemory;
use crate::network::{join, spawn, Aging, Joined, PipelineError, RetryPolicy};
use crate::profile::Tolerances;
use crate::queue::jetstream::JetStream;
use crate::queue::QueueError;
use crate::refdata::RefData;

/// What a node of a cluster runs besides its gateway.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: String,
    pub layout: ClusterLayout,
    /// Time to live of every lease, where this node makes the cluster's lease bucket (the
    /// first node's otherwise).
    pub lease_ttl: Duration,
    /// Shards this node owns at most.
    pub shards_max: u32,
    /// The database of each shard, in shard order.
    pub database_urls: Vec<String>,
    pub tolerances: Tolerances,
    pub aging: Option<Aging>,
    pub batch_max: crate::pipeline::BatchBound,
    pub retry: RetryPolicy,
    /// What each of its shards' matchers keeps in memory.
    pub matcher_memory: MatcherMemory,
    /// How often the node publishes its stations' counters (at least
    /// [`crate::cluster_samples::NODE_SAMPLE_INTERVAL_MIN`]); zero: never.
    pub sample_interval: Duration,
    /// How long a starting node tries to reach its cluster's queues and leases before it gives
    /// up ([`STARTING_PATIENCE`] unless told).
    pub start_patience: Duration,
}

/// What a node holds right now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    pub shards: Vec<u32>,
}

/// A node of a cluster: it contends for shards (up to [`NodeConfig::shards_max`]) whose leases
/// nobody holds, owns what it wins, and contends again for whatever it loses or another node
/// leaves behind.
pub struct Node {
    stop: Arc<AtomicBool>,
    holdings: Arc<Mutex<Holdings>>,
    thread: Joined<()>,
    sampler: Option<NodeSampler>,
    jetstream: JetStream,
}

impl Node {
    /// Makes the cluster's queues where they do not exist and starts contending.
    pub fn start(
        jetstream: &JetStream,
        config: NodeConfig,
        refdata: Arc<RefData>,
    ) -> Result<Self, PipelineError> {
        if config.database_urls.len() != config.layout.shards as usize {
            return Err(PipelineError::Config(format!(
                "{} shards need {} database URLs, {} given",
                config.layout.shards,
                config.layout.shards,
                config.database_urls.len()
            )));
        }
        // Servers that are starting with the nodes (or electing leaders) may time out a
        // request or have no responder yet.
        retrying(config.start_patience, || config.layout.ensure(jetstream))
            .map_err(PipelineError::Queue)?;
        let leases = Arc::new(
            retrying(config.start_patience, || {
                Leases::open(jetstream, config.lease_ttl)
            })
            .map_err(PipelineError::Queue)?,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let holdings = Arc::new(Mutex::new(Holdings::default()));
        let board = StationBoard::default();
        let sampler = (!config.sample_interval.is_zero()).then(|| {
            NodeSampler::start(
                jetstream,
                &config.node_id,
                board.clone(),
                config.sample_interval,
            )
        });
        let thread = {
            let (jetstream, stop, holdings) = (jetstream.clone(), stop.clone(), holdings.clone());
            spawn(format!("node-{}", config.node_id), move || {
                supervise(
                    &jetstream, &config, &leases, &refdata, &stop, &holdings, &board,
                )
            })
        };
        Ok(Self {
            stop,
            holdings,
            thread,
            sampler,
            jetstream: jetstream.clone(),
        })
    }

    /// The shards this node holds now.
    pub fn holdings(&self) -> Holdings {
        self.holdings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Stops contending, lets every station finish what it holds, and waits for them.
    pub fn stop(self) -> Result<(), PipelineError> {
        self.stop.store(true, Ordering::Relaxed);
        // What is in hand is finished while the server answers; an outage now is not waited
        // out (what is not acknowledged goes to the node that takes over).
        self.jetstream.stop_riding_out_outages();
        let result = join(self.thread);
        if let Some(sampler) = self.sampler {
            sampler.stop();
        }
        result
    }
}

/// The node's loop: reap what ended, contend for what is free, a few times per time to live.
fn supervise(
    jetstream: &JetStream,
    config: &NodeConfig,
    leases: &Arc<Leases>,
    refdata: &Arc<RefData>,
    stop: &AtomicBool,
    holdings: &Mutex<Holdings>,
    board: &StationBoard,
) -> Result<(), PipelineError> {
    let poll = leases.ttl() / LEASE_POLLS_PER_TTL;
    let mut owners: Vec<ShardOwner> = Vec::new();
    let mut balance = Balance::default();
    // Nodes start their search at different shards, so that they spread.
    let offset = crate::routing::fnv1a_64(config.node_id.as_bytes());
    let shards = config.layout.shards;
    let rotated = |step: u32| {
        let count = u64::from(shards);
        ((offset % count + u64::from(step)) % count) as u32
    };
    while !stop.load(Ordering::Relaxed) {
        for ended in drain_where(&mut owners, ShardOwner::has_ended) {
            let report = ended.stop();
            tracing::warn!(shard = report.shard, token = report.token, writer = ?report.writer.err(), "stood down from the shard");
        }
        if balance.due() {
            let held = owners.len() as u32;
            balance.count(leases, config, held);
            if balance.shards.should_give_up_one(held) {
                if let Some(owner) = owners.pop() {
                    let report = owner.hand_over();
                    tracing::info!(
                        shard = report.shard,
                        held,
                        "handed a shard over to a node with fewer"
                    );
                }
            }
        }
        for step in 0..shards {
            if owners.len() >= config.shards_max as usize
                || balance.shards.holds_enough(owners.len() as u32)
                || stop.load(Ordering::Relaxed)
            {
                break;
            }
            let shard = rotated(step);
            if owners.iter().any(|owner| owner.shard() == shard) {
                continue;
            }
            let owner_config = ShardOwnerConfig {
                node_id: config.node_id.clone(),
                shard,
                shards,
                database_url: config.database_urls[shard as usize].clone(),
                tolerances: config.tolerances.clone(),
                aging: config.aging,
                batch_max: config.batch_max,
                retry: config.retry,
                matcher_memory: config.matcher_memory,
            };
            match ShardOwner::take_over(
                jetstream,
                leases.clone(),
                &owner_config,
                refdata.clone(),
                Duration::ZERO,
            ) {
                Ok(Some(owner)) => {
                    owners.push(owner);
                    // One new shard a pass: nodes that start together share the shards.
                    break;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(shard, %error, "taking the shard over failed; trying again")
                }
            }
        }
        if let Ok(mut shared) = holdings.lock() {
            let mut held: Vec<u32> = owners.iter().map(ShardOwner::shard).collect();
            held.sort_unstable();
            *shared = Holdings { shards: held };
        }
        board.set(
            owners
                .iter()
                .flat_map(|o| o.stations().iter().cloned())
                .collect(),
            owners.iter().map(|o| o.table_bytes().clone()).collect(),
        );
        std::thread::sleep(poll);
    }
    let mut result = Ok(());
    if let Some(member) = balance.member.take() {
        member.give_back();
    }
    for owner in owners {
        let report = owner.stop();
        result = result.and(report.writer).and(report.counts.map(|_| ()));
    }
    result
}

/// How often a node compares what it holds with what the others hold, in times to live.
const BALANCE_EVERY_TTLS: u32 = 2;

/// The balance of shards between the nodes. Each node that takes shards holds a member number
/// whose value says how many it takes at most; every few times to live it counts the members
/// and who holds what. While some member holds less than the even share (the total over the
/// members that take shards, rounded down) and its own bound, a node holding more than that
/// share, and as much as anyone, hands one over, and no node with its share takes a new one.
/// Nodes that are even stay as they are.
#[derive(Default)]
struct Balance {
    member: Option<LeaseKeeper>,
    last: Option<Instant>,
    every: Duration,
    shards: Share,
}

/// This node's view of the shards (by default: nobody is short, nothing to do).
#[derive(Debug, Clone, Copy, Default)]
struct Share {
    /// The even share, rounded down: what every member that takes shards should hold.
    even: u32,
    /// The most any member holds.
    most: u32,
    /// Whether another member holds less than the even share (and could take more).
    others_short: bool,
}

impl Share {
    fn of(total: u32, me: &str, held: u32, members: &[Member], holdings: &HeldBy) -> Self {
        let takers = members
            .iter()
            .filter(|member| member.shards_max > 0)
            .count() as u32;
        let even = total / takers.max(1);
        let others_short = members.iter().any(|member| {
            member.node != me
                && holdings.get(&member.node).copied().unwrap_or(0) < even.min(member.shards_max)
        });
        let most = holdings.values().copied().max().unwrap_or(0).max(held);
        Self {
            even,
            most,
            others_short,
        }
    }

    /// Whether to hand one of `held` over now: another member is short, and this node holds
    /// more than the even share and as much as anyone.
    fn should_give_up_one(&self, held: u32) -> bool {
        self.others_short && held > self.even && held >= self.most
    }

    /// Whether to take no new one: another member is short and this node has its share.
    fn holds_enough(&self, held: u32) -> bool {
        self.others_short && held >= self.even
    }
}

/// A member of the cluster as its member lease describes it (`"<node> <shards_max>"`).
struct Member {
    node: String,
    shards_max: u32,
}

impl Balance {
    fn due(&self) -> bool {
        self.last.is_none_or(|last| last.elapsed() >= self.every)
    }

    /// Joins (again) as a member where needed, and counts the members and what they hold.
    fn count(&mut self, leases: &Arc<Leases>, config: &NodeConfig, held: u32) {
        self.last = Some(Instant::now());
        self.every = leases.ttl() * BALANCE_EVERY_TTLS;
        if config.shards_max == 0 {
            return;
        }
        let joined = self
            .member
            .as_ref()
            .is_some_and(|member| member.held().load(Ordering::Acquire));
        if !joined {
            let value = format!("{} {}", config.node_id, config.shards_max);
            match leases.take_lowest(Leased::Member, crate::lease::MEMBERS_MAX, &value) {
                Ok(Some((_, lease))) => {
                    self.member = Some(LeaseKeeper::start(leases.clone(), lease, value, || {}))
                }
                Ok(None) => {
                    tracing::warn!("every member number is taken: this node is not counted")
                }
                Err(error) => tracing::warn!(%error, "joining the members failed"),
            }
        }
        match balance_of(leases, config) {
            Ok((members, shards)) if !members.is_empty() => {
                self.shards = Share::of(
                    config.layout.shards,
                    config.node_id.as_str(),
                    held,
                    &members,
                    &shards,
                );
            }
            Ok(_) => self.shards = Share::default(),
            Err(error) => tracing::debug!(%error, "counting the members failed"),
        }
    }
}

/// How many shards each node holds, by node.
type HeldBy = BTreeMap<String, u32>;

/// The members, and how many shards each node holds.
fn balance_of(leases: &Leases, config: &NodeConfig) -> Result<(Vec<Member>, HeldBy), QueueError> {
    let mut members = Vec::new();
    for number in 0..crate::lease::MEMBERS_MAX {
        if let Some(value) = leases.holder(Leased::Member(number))? {
            let mut parts = value.rsplitn(2, ' ');
            let shards_max = parts.next().and_then(|bound| bound.parse().ok());
            if let (Some(shards_max), Some(node)) = (shards_max, parts.next()) {
                members.push(Member {
                    node: node.to_owned(),
                    shards_max,
                });
            }
        }
    }
    let mut holdings = BTreeMap::new();
    for shard in 0..config.layout.shards {
        if let Some(node) = leases.holder(Leased::Shard(shard))? {
            *holdings.entry(node).or_insert(0) += 1;
        }
    }
    Ok((members, holdings))
}

/// How long a process starting tries to reach its cluster's queues and leases.
pub const STARTING_PATIENCE: Duration = Duration::from_secs(30);

/// `attempt` until it succeeds or `patience` has passed (its last error then): for a cluster
/// of NATS servers that is starting, or electing leaders, and meanwhile times a request out or
/// has no responder yet.
pub fn retrying<T, E: std::fmt::Display>(
    patience: Duration,
    mut attempt: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let started = Instant::now();
    loop {
        match attempt() {
            Ok(value) => return Ok(value),
            Err(error) if started.elapsed() < patience => {
                tracing::info!(%error, "the cluster is not ready yet; trying again");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(error) => return Err(error),
        }
    }
}

/// [`retrying`] only what fails on its carrier (the queues' servers starting or electing
/// leaders): any other error of `attempt` ends the wait at once.
pub fn retrying_carrier<T>(
    patience: Duration,
    mut attempt: impl FnMut() -> Result<T, PipelineError>,
) -> Result<T, PipelineError> {
    retrying(patience, || match attempt() {
        Err(PipelineError::Queue(error)) => Err(error),
        other => Ok(other),
    })
    .map_err(PipelineError::Queue)?
}

/// Takes out of `items` those for which `ended` holds.
fn drain_where<T>(items: &mut Vec<T>, ended: impl Fn(&T) -> bool) -> Vec<T> {
    let (gone, kept): (Vec<T>, Vec<T>) = std::mem::take(items).into_iter().partition(ended);
    *items = kept;
    gone
}
