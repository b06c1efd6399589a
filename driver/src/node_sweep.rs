//! `driver sweep --nodes 1,2,4,8 [--db-counts 1,4] [--compose FILE]`: the STE's scale-out
//! experiment. Each level is a fresh cluster of K engine nodes on D shard databases, loaded in a
//! closed loop of W messages in flight; per level the sweep records X, the per-node rate X/K,
//! N = W and R = N/X (Little's law), the CLS latency, the bottleneck station and the CPU the
//! level cost this machine by program; and beside each the MVA prediction of a model whose
//! stations are the machines' cores (see [`NodeModel`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Serialize;
use ste_driver::scale::{
    local_programs, Compose, CpuUse, LocalCluster, LocalSpec, Share, LOCAL_NATS_SERVERS,
};
use ste_driver::{StoreKind, Summary};
use ste_engine::keys::KeyRing;
use ste_engine::refdata::RefData;
use ste_monitor::mva::{self, Kind, Station};

use super::{
    check_summary, default_run_dir, load_refdata, optional_cell, refdata_with_keys, run_config,
    write_series, RunArgs,
};

/// Messages in flight of a node sweep's closed loop unless --window says otherwise.
pub const NODE_SWEEP_WINDOW: u64 = 4096;

/// How long a level waits for its nodes to own every shard.
const OWNERS_TIMEOUT: Duration = Duration::from_secs(120);

/// The share of the machine's cores busy from which the cores are the level's bottleneck.
const CORES_SATURATED: f64 = 0.9;

/// The compose file's shards.
const COMPOSE_SHARDS: u32 = 4;

/// The compose file's NATS servers, as its containers reach them.
const COMPOSE_NATS: &str = "nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222";

/// One level of a node sweep.
#[derive(Serialize)]
#[allow(non_snake_case)]
struct NodePoint {
    level: usize,
    /// `processes` (a cluster of this machine's processes) or `compose`.
    platform: &'static str,
    databases: u32,
    nodes: u32,
    /// Cores each node was capped at (`--node-cpus`), if it was.
    node_cpus: Option<f64>,
    window: u64,
    /// System throughput, messages per second.
    X: f64,
    /// X per node.
    X_per_node: f64,
    /// Messages in the system: the closed loop's window.
    N: f64,
    /// N / X, ms.
    R_ms: f64,
    cls_p50_ms: f64,
    cls_p99_ms: f64,
    /// `cores` when the machine's cores were at least 90% busy, else the busiest station.
    bottleneck: Option<String>,
    /// The station of the highest utilisation.
    busiest_station: Option<String>,
    /// Mean busy cores of the machine during the run.
    cpu_busy_cores: f64,
    /// The machine's busy CPU per message, µs.
    cpu_us_per_msg: f64,
    /// The engine nodes' CPU per message, µs.
    node_cpu_us_per_msg: f64,
    /// The model on this machine: every process shares its cores.
    X_mva: Option<f64>,
    R_mva_ms: Option<f64>,
    /// The same model with this level's own measured CPU per message: what the cores allow
    /// once what more nodes cost is known.
    X_mva_level: Option<f64>,
    /// The model with each node on a machine of its own (as many cores as this one).
    X_own: Option<f64>,
    R_own_ms: Option<f64>,
    /// The model with every program on machines of its own: nodes, each database, NATS and
    /// the load.
    X_spread: Option<f64>,
    /// What bounds `X_spread`: the kind of station of the largest demand per server (node,
    /// database, nats, load).
    spread_bound: Option<String>,
    /// With capped nodes: the model of this machine with each owning node a server of its cap
    /// and the rest of the machine's cores for everything else.
    X_capped: Option<f64>,
    cpu: CpuUse,
    run_dir: String,
}

impl NodePoint {
    const COLUMNS: &'static [&'static str] = &[
        "level",
        "databases",
        "nodes",
        "window",
        "X",
        "X_per_node",
        "N",
        "R_ms",
        "cls_p50_ms",
        "cls_p99_ms",
        "bottleneck",
        "busiest_station",
        "cpu_busy_cores",
        "cpu_us_per_msg",
        "node_cpu_us_per_msg",
        "X_mva",
        "R_mva_ms",
        "X_mva_level",
        "X_own",
        "R_own_ms",
        "X_spread",
        "spread_bound",
        "node_cpus",
        "X_capped",
    ];

    fn cells(&self) -> Vec<String> {
        vec![
            self.level.to_string(),
            self.databases.to_string(),
            self.nodes.to_string(),
            self.window.to_string(),
            format!("{:.1}", self.X),
            format!("{:.1}", self.X_per_node),
            format!("{:.0}", self.N),
            format!("{:.2}", self.R_ms),
            format!("{:.2}", self.cls_p50_ms),
            format!("{:.2}", self.cls_p99_ms),
            self.bottleneck.clone().unwrap_or_default(),
            self.busiest_station.clone().unwrap_or_default(),
            format!("{:.2}", self.cpu_busy_cores),
            format!("{:.1}", self.cpu_us_per_msg),
            format!("{:.1}", self.node_cpu_us_per_msg),
            optional_cell(self.X_mva, 1),
            optional_cell(self.R_mva_ms, 2),
            optional_cell(self.X_mva_level, 1),
            optional_cell(self.X_own, 1),
            optional_cell(self.R_own_ms, 2),
            optional_cell(self.X_spread, 1),
            self.spread_bound.clone().unwrap_or_default(),
            self.node_cpus.map(|c| format!("{c}")).unwrap_or_default(),
            optional_cell(self.X_capped, 1),
        ]
    }
}

/// The model of a node sweep, from the demands measured at the sweep's first level of a database
/// count (its reference): a closed network of the loop's W messages.
///
/// - On this machine, one station of `c` servers (its cores) with the machine's busy CPU per
///   message as demand: every process (nodes, NATS, PostgreSQL, driver) shares it. More nodes
///   add no cores, so the model predicts the reference's X at every node count; what it misses
///   is what more nodes cost in CPU per message, which the same model at each level's own
///   measured demand (`X_mva_level`) takes in. There is no delay station: at W in flight the
///   loop keeps the cores busy, and the CPU time a run leaves idle (threads waiting for batches
///   and for each other) is what the measurement falls short of the model.
/// - With nodes on machines of their own (as many cores each as this one): the nodes' CPU per
///   message moves to K stations of `c` servers, spread over min(K, shards) of them (a shard's
///   owner validates, matches and commits its shard), while NATS, PostgreSQL, the driver and
///   the rest stay on one shared machine.
/// - With every program on machines of its own: the nodes as above, each of the D databases
///   with PostgreSQL's CPU / D, the NATS servers, and the load (the rest of this machine's
///   time, the driver's) over K machines, one beside each node.
#[derive(Clone, Copy)]
struct NodeModel {
    cores: u32,
    window: u32,
    total_s: f64,
    nodes_s: f64,
    nats_s: f64,
    postgres_s: f64,
}

impl NodeModel {
    fn of(summary: &Summary, cpu: &CpuUse, window: u64) -> Option<Self> {
        let messages = summary.outcome.messages_in as f64;
        if messages <= 0.0 || cpu.busy_s <= 0.0 {
            return None;
        }
        Some(Self {
            cores: cpu.cores.max(1) as u32,
            window: u32::try_from(window.max(1)).unwrap_or(u32::MAX),
            total_s: cpu.busy_s / messages,
            nodes_s: (cpu.program_s("engine") / messages).min(cpu.busy_s / messages),
            nats_s: cpu.program_s("nats-server") / messages,
            postgres_s: cpu.program_s("postgres") / messages,
        })
    }

    fn cores(&self, name: String, demand: f64) -> Station {
        Station {
            name,
            kind: Kind::MultiServer(self.cores),
            service: demand,
            visits: 1.0,
        }
    }

    /// This machine at any node count.
    fn here(&self) -> Vec<Station> {
        vec![self.cores("cores".to_owned(), self.total_s)]
    }

    /// K nodes on machines of their own; the rest on one shared machine.
    fn own(&self, share: Share) -> Vec<Station> {
        let mut stations = vec![self.cores(
            "shared machine".to_owned(),
            (self.total_s - self.nodes_s).max(0.0),
        )];
        stations.extend(self.node_stations(share));
        stations
    }

    /// Every program on machines of its own: K nodes, each of the D databases, the NATS
    /// servers (the shards' streams spread over min(3, D) of them by placement), and the load:
    /// the rest of this machine's busy time (to err on the slow side), which is the driver
    /// generating and signing as the participants do and publishing as a gateway does, split
    /// over K machines, one beside each node, as a cluster's gateways run on its nodes and its
    /// participants on machines of their own.
    fn spread(&self, share: Share) -> Vec<Station> {
        let databases = share.shards.max(1);
        let mut stations = self.node_stations(share);
        stations.extend((0..databases).map(|k| {
            self.cores(
                format!("database {k}"),
                self.postgres_s / f64::from(databases),
            )
        }));
        let servers = (LOCAL_NATS_SERVERS as u32).min(databases).max(1);
        stations.extend(
            (0..servers).map(|server| {
                self.cores(format!("nats {server}"), self.nats_s / f64::from(servers))
            }),
        );
        let rest = self.total_s - self.nodes_s - self.postgres_s - self.nats_s;
        let sources = share.nodes.max(1);
        stations.extend((0..sources).map(|source| {
            self.cores(format!("load {source}"), rest.max(0.0) / f64::from(sources))
        }));
        stations
    }

    /// The name of the station that bounds `stations`' throughput (the largest demand on one
    /// of its servers), numbers dropped: "nats" for any of the NATS servers.
    fn bound(stations: &[Station]) -> Option<String> {
        stations
            .iter()
            .max_by(|a, b| a.demand_per_server().total_cmp(&b.demand_per_server()))
            .map(|station| {
                station
                    .name
                    .trim_end_matches(|c: char| c.is_ascii_digit() || c == ' ')
                    .to_owned()
            })
    }

    /// The nodes' stations: the shards' owners, min(K, shards) of them (a node without a
    /// shard has nothing to do).
    fn node_stations(&self, share: Share) -> Vec<Station> {
        let owning = share.nodes.min(share.shards).max(1);
        (0..owning)
            .map(|node| self.cores(format!("node {node}"), self.nodes_s / f64::from(owning)))
            .collect()
    }

    /// This machine with every owning node capped at `cpus` cores: each of the min(K, D)
    /// owning nodes a server of that speed (its share of the nodes' demand over `cpus`), and
    /// the machine's cores, less what the caps may take, for everything else.
    fn capped(&self, share: Share, cpus: f64) -> Vec<Station> {
        let owning = share.nodes.min(share.shards).max(1);
        let mut stations: Vec<Station> = (0..owning)
            .map(|node| Station {
                name: format!("node {node}"),
                kind: Kind::Queueing,
                service: self.nodes_s / f64::from(owning) / cpus.max(1e-3),
                visits: 1.0,
            })
            .collect();
        let rest_cores = (f64::from(self.cores) - cpus * f64::from(owning)).max(1.0);
        stations.push(Station {
            name: "rest of the machine".to_owned(),
            kind: Kind::MultiServer(rest_cores.floor().max(1.0) as u32),
            service: (self.total_s - self.nodes_s).max(0.0)
                * (rest_cores.floor().max(1.0) / rest_cores),
            visits: 1.0,
        });
        stations
    }

    /// X and R (s) of `stations` at the window's population.
    fn solve(&self, stations: &[Station]) -> Option<(f64, f64)> {
        let points = mva::closed(stations, 0.0, self.window).ok()?;
        points.last().map(|p| (p.X, p.R))
    }
}

/// What the sweep runs each level on.
enum Platform {
    Local {
        servers: Vec<String>,
        /// The reference data with the level's signing keys (`keys`).
        refdata: Arc<RefData>,
        keys: PathBuf,
        engine: PathBuf,
        nats_server: PathBuf,
    },
    Compose(Compose),
}

pub fn sweep_nodes(
    mut args: RunArgs,
    nodes: &[u32],
    db_counts: &[u32],
    node_cpus: Option<f64>,
    compose: Option<PathBuf>,
    out: Option<PathBuf>,
) -> anyhow::Result<()> {
    if args.run_dir.is_some() || args.resume || args.nats.is_some() || args.target.is_some() {
        bail!("a node sweep starts a cluster per level under --out; --run-dir, --resume, --nats and --target do not apply");
    }
    if args.input.is_some() {
        bail!("a node sweep generates its load (--trades, --seed, --fault-rate, --shuffle)");
    }
    if nodes.contains(&0) || db_counts.contains(&0) {
        bail!("--nodes and --db-counts must be at least 1");
    }
    if node_cpus.is_some_and(|cpus| !(cpus > 0.0 && cpus.is_finite())) {
        bail!("--node-cpus must be a positive number of cores");
    }
    let out = out.unwrap_or_else(|| {
        let mut dir = default_run_dir();
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        dir.set_file_name(format!("sweep-nodes-{}", name.unwrap_or_default()));
        dir
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let window = args.window.unwrap_or(NODE_SWEEP_WINDOW).max(1);
    args.window = Some(window);
    let platform = match &compose {
        Some(file) => Platform::Compose(Compose::find(file)?),
        None => {
            let (engine, nats_server) = local_programs()?;
            args.pipeline.store = Some(StoreKind::Postgres);
            let servers = run_config(args.clone())?.settings.database_urls;
            let keys = match &args.keys {
                Some(keys) => keys.clone(),
                None => {
                    let keys = out.join("keys.csv");
                    KeyRing::generate_for(&load_refdata(args.refdata.as_ref())?)
                        .write(&keys)
                        .with_context(|| format!("writing {}", keys.display()))?;
                    keys
                }
            };
            args.keys = Some(keys.clone());
            Platform::Local {
                servers,
                refdata: Arc::new(refdata_with_keys(&args)?),
                keys,
                engine,
                nats_server,
            }
        }
    };
    let db_counts: Vec<u32> = match (&platform, db_counts.is_empty()) {
        (_, false) => db_counts.to_vec(),
        (Platform::Local { servers, .. }, true) => vec![servers.len() as u32],
        (Platform::Compose(_), true) => vec![COMPOSE_SHARDS],
    };
    let most_databases = db_counts.iter().copied().max().unwrap_or(1);
    match &platform {
        Platform::Local { servers, .. } if (servers.len() as u32) < most_databases => bail!(
            "{most_databases} databases need as many --db URLs (one per shard's server); {} given",
            servers.len()
        ),
        Platform::Compose(_) if most_databases > COMPOSE_SHARDS => {
            bail!("the compose file has {COMPOSE_SHARDS} shards")
        }
        _ => {}
    }

    let mut points: Vec<NodePoint> = Vec::new();
    for &databases in &db_counts {
        let mut model: Option<NodeModel> = None;
        for &k in nodes {
            let level = points.len();
            let share = Share {
                nodes: k,
                shards: databases,
            };
            let name = format!("level-{level}-dbs-{databases}-nodes-{k}");
            let dir = out.join(&name);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            eprintln!(
                "sweep level {level}: {k} nodes on {databases} databases ({window} messages in flight)"
            );
            let (summary, cpu) = match &platform {
                Platform::Local {
                    servers,
                    refdata,
                    keys,
                    engine,
                    nats_server,
                } => run_local(
                    &args,
                    refdata,
                    &LocalSpec {
                        dir: &dir,
                        share,
                        servers: &servers[..databases as usize],
                        keys,
                        engine,
                        nats_server,
                        node_args: &[],
                        node_cpus,
                    },
                )?,
                Platform::Compose(compose) => {
                    let driver_args = compose_driver_args(&args, window, &name);
                    compose.level(share, node_cpus, &driver_args)?
                }
            };
            check_summary(&summary)?;
            std::fs::write(dir.join("cpu.json"), serde_json::to_string_pretty(&cpu)?)
                .context("writing cpu.json")?;
            let messages = summary.outcome.messages_in.max(1) as f64;
            if model.is_none() {
                model = NodeModel::of(&summary, &cpu, window);
            }
            let x = summary.throughput_msg_s;
            let here = model.as_ref().and_then(|m| m.solve(&m.here()));
            let own = model.as_ref().and_then(|m| m.solve(&m.own(share)));
            let spread_stations = model.as_ref().map(|m| m.spread(share));
            let spread = model
                .as_ref()
                .zip(spread_stations.as_ref())
                .and_then(|(m, stations)| m.solve(stations));
            let capped = node_cpus
                .and_then(|cpus| model.as_ref().and_then(|m| m.solve(&m.capped(share, cpus))));
            let at_level = model.as_ref().and_then(|m| {
                let level = NodeModel {
                    total_s: cpu.busy_s / messages,
                    ..*m
                };
                level.solve(&level.here())
            });
            let point = NodePoint {
                level,
                platform: match &platform {
                    Platform::Local { .. } => "processes",
                    Platform::Compose(_) => "compose",
                },
                databases,
                nodes: k,
                node_cpus,
                window,
                X: x,
                X_per_node: x / f64::from(k),
                N: window as f64,
                R_ms: if x > 0.0 {
                    1e3 * window as f64 / x
                } else {
                    0.0
                },
                cls_p50_ms: summary.latency_ms.p50,
                cls_p99_ms: summary.latency_ms.p99,
                bottleneck: if cpu.busy_cores() >= CORES_SATURATED * cpu.cores as f64 {
                    Some("cores".to_owned())
                } else {
                    summary.bottleneck.clone()
                },
                busiest_station: summary.bottleneck.clone(),
                cpu_busy_cores: cpu.busy_cores(),
                cpu_us_per_msg: 1e6 * cpu.busy_s / messages,
                node_cpu_us_per_msg: 1e6 * cpu.program_s("engine") / messages,
                X_mva: here.map(|(x, _)| x),
                R_mva_ms: here.map(|(_, r)| r * 1e3),
                X_mva_level: at_level.map(|(x, _)| x),
                X_own: own.map(|(x, _)| x),
                R_own_ms: own.map(|(_, r)| r * 1e3),
                X_spread: spread.map(|(x, _)| x),
                spread_bound: spread_stations.as_deref().and_then(NodeModel::bound),
                X_capped: capped.map(|(x, _)| x),
                cpu,
                run_dir: match &platform {
                    Platform::Local { .. } => dir.join("run").display().to_string(),
                    Platform::Compose(_) => summary.run_dir.clone(),
                },
            };
            eprintln!(
                "  {k} nodes, {databases} databases: X {x:.0} msg/s ({:.0} per node), R {:.1} ms, {:.2} cores busy{}",
                point.X_per_node,
                point.R_ms,
                point.cpu_busy_cores,
                point
                    .X_mva
                    .map(|m| format!(", model here {m:.0} msg/s"))
                    .unwrap_or_default()
            );
            points.push(point);
        }
    }
    if let Platform::Compose(compose) = &platform {
        compose.down()?;
    }

    let chart = out.join("nodes.svg");
    let svg = ste_monitor::chart::node_sweep_svg(&serde_json::to_value(&points)?)
        .map_err(|reason| anyhow::anyhow!("drawing {}: {reason}", chart.display()))?;
    std::fs::write(&chart, svg).with_context(|| format!("writing {}", chart.display()))?;
    write_series(
        &out,
        NodePoint::COLUMNS,
        points.iter().map(NodePoint::cells).collect(),
        &points,
        &chart,
    )
}

/// One level on local processes.
fn run_local(
    args: &RunArgs,
    refdata: &Arc<RefData>,
    spec: &LocalSpec<'_>,
) -> anyhow::Result<(Summary, CpuUse)> {
    let cluster = LocalCluster::start(spec)?;
    let outcome = (|| {
        let mut level_args = args.clone();
        level_args.pipeline.db = cluster.db_urls.clone();
        level_args.pipeline.shards = Some(spec.share.shards);
        level_args.run_dir = Some(spec.dir.join("run"));
        let config = run_config(level_args)?;
        let target = ste_driver::cluster::ClusterTarget {
            url: cluster.nats_url.clone(),
            lease_ttl: Duration::from_secs(3),
            stall_timeout: Duration::from_secs(args.stall_timeout_s.max(1)),
            resend_after: Duration::from_secs(args.resend_after_s.max(1)),
            placement: ste_engine::queue::jetstream::Placement::parse(
                Some(&cluster.nats_placement),
                1,
            )
            .map_err(anyhow::Error::msg)?,
            batch_messages: args.nats_batch.max(1),
            wait_for_owners: Some(OWNERS_TIMEOUT),
            secrets: Some(cluster.secrets.clone()),
        };
        let summary = ste_driver::cluster::run_cluster(&config, &target, refdata.clone())?;
        // From the first injection, once every shard is owned, to the last answer.
        let cpu = summary
            .cpu
            .clone()
            .context("the cluster run measured no CPU")?;
        Ok::<_, anyhow::Error>((summary, cpu))
    })();
    let stopped = cluster.stop();
    let result = outcome?;
    stopped?;
    Ok(result)
}

/// The compose file driver's arguments for one level.
fn compose_driver_args(args: &RunArgs, window: u64, name: &str) -> Vec<String> {
    let g = &args.generation;
    let mut list = vec![
        "--trades".to_owned(),
        g.trades.to_string(),
        "--seed".to_owned(),
        g.seed.to_string(),
        "--fault-rate".to_owned(),
        g.fault_rate.to_string(),
        "--window".to_owned(),
        window.to_string(),
        "--nats".to_owned(),
        COMPOSE_NATS.to_owned(),
        "--wait-for-owners-s".to_owned(),
        OWNERS_TIMEOUT.as_secs().to_string(),
        "--run-dir".to_owned(),
        format!("/runs/{name}"),
        "--json".to_owned(),
        "--quiet".to_owned(),
    ];
    if g.shuffle {
        list.push("--shuffle".to_owned());
    }
    list
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Demands of the order measured for one node on this machine (µs a message): the nodes
    /// 16, NATS 9, PostgreSQL 17, the rest (the driver) 6.
    fn measured() -> NodeModel {
        NodeModel {
            cores: 2,
            window: 4096,
            total_s: 48e-6,
            nodes_s: 16e-6,
            nats_s: 9e-6,
            postgres_s: 17e-6,
        }
    }

    fn spread(model: &NodeModel, nodes: u32, shards: u32) -> (f64, Option<String>) {
        let stations = model.spread(Share { nodes, shards });
        let (x, _) = model.solve(&stations).expect("solves");
        (x, NodeModel::bound(&stations))
    }

    #[test]
    fn every_program_on_machines_of_its_own_grows_with_the_nodes_until_nats_bounds_it() {
        let model = measured();
        let (one, one_bound) = spread(&model, 1, 8);
        let (eight, eight_bound) = spread(&model, 8, 8);
        assert_eq!(one_bound.as_deref(), Some("node"));
        // 8 nodes × 2 cores at 2 µs each, 8 databases at 2.1 µs, the load over 8 machines:
        // three NATS servers at 3 µs a message on 2 cores each bound it, at about 667k msg/s.
        assert_eq!(eight_bound.as_deref(), Some("nats"));
        assert!(
            eight > 4.0 * one,
            "8 nodes {eight:.0} msg/s against 1 node {one:.0}"
        );
        assert!(
            eight < 2.0 / 3e-6,
            "no more than the NATS servers carry: {eight:.0}"
        );
    }

    #[test]
    fn nodes_beyond_the_shards_add_nothing_to_the_spread_model_but_load() {
        let model = measured();
        let (four, _) = spread(&model, 4, 4);
        let (eight, _) = spread(&model, 8, 4);
        assert!(eight >= four * 0.99, "{eight:.0} against {four:.0}");
        assert!(eight <= four * 1.2, "{eight:.0} against {four:.0}");
    }
}
