//! `engine`: the STE engine as a long-lived node behind the bridge's listeners.
//!
//! Participants connect over framed XML on TCP (`--tcp`), SOAP over HTTP (`--http`) or FIX 4.4
//! (`--fix`). Every message is answered with an
//! ACK or NAK after the commit that holds it; CLS and status advices are pushed to the
//! connections subscribed for a party of the trade. SIGTERM or Ctrl-C stops it gracefully: no
//! new connections or messages, what is in flight is committed and answered, then it exits.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use ste_bridge::fix::{self, FixConfig};
use ste_bridge::gateway::{Gateway, GatewayConfig};
use ste_bridge::soap::{self, SoapConfig};
use ste_bridge::tcp::{self, TcpConfig};
use ste_bridge::tls::{self, Tls, TlsFiles};
use ste_engine::cluster::roles::Role;
use ste_engine::keys::KeyRing;
use ste_engine::options::{PipelineArgs, Scope, Settings, TlsIdentityArgs};
use ste_engine::pipeline::PipelineConfig;
use ste_engine::refdata::RefData;
use tracing::info;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "engine",
    about = "The STE trade-matching engine as a server: participants connect over framed XML, SOAP/HTTP and FIX 4.4"
)]
struct Cli {
    #[command(flatten)]
    pipeline: PipelineArgs,
    #[command(flatten)]
    tls: TlsIdentityArgs,
    /// Address of the framed-XML listener (port 0: any free port; the bound address is printed).
    #[arg(long, env = "STE_TCP_ADDR", default_value = "127.0.0.1:7400")]
    tcp: String,
    /// Address of the SOAP/HTTP listener (`POST /soap`, `GET /soap?wsdl`; port 0: any free port).
    #[arg(long, env = "STE_HTTP_ADDR", default_value = "127.0.0.1:7480")]
    http: String,
    /// Address of the FIX 4.4 listener (port 0: any free port).
    #[arg(long, env = "STE_FIX_ADDR", default_value = "127.0.0.1:9878")]
    fix: String,
    /// UTC time of day (HH:MM or HH:MM:SS) at which FIX sessions end and their sequence
    /// numbers start again at 1 (default: only a Logon with ResetSeqNumFlag resets them).
    #[arg(long, env = "STE_FIX_RESET_AT", value_parser = parse_time_of_day)]
    fix_reset_at: Option<time::Time>,
    /// Largest SOAP request body in bytes.
    #[arg(long, default_value_t = 1024 * 1024)]
    max_body_bytes: usize,
    /// Folder of the node's files: the embedded store, samples.csv, fix-sessions/ (each FIX
    /// participant's sequence numbers and sent messages).
    #[arg(long, env = "STE_DATA_DIR", default_value = "ste-data")]
    data_dir: PathBuf,
    /// Append every CLS to this file, one per line (flushed before delivery is confirmed).
    #[arg(long, env = "STE_CLS_OUT")]
    cls_out: Option<PathBuf>,
    /// Connections (FIX: sessions) each listener serves at once.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Connections (FIX: sessions) each listener serves at once from one source address (an
    /// IPv6 /64).
    #[arg(long, default_value_t = 64)]
    max_connections_per_source: usize,
    /// Connections each listener serves at once that have not yet logged on (or, over SOAP,
    /// sent a correctly signed request), apart from the others.
    #[arg(long, default_value_t = ste_bridge::listener::UNAUTHENTICATED_DEFAULT)]
    max_unauthenticated: usize,
    /// Messages a second each participant may submit once it has proved who it is (a burst of
    /// as many); a faster one is slowed, not refused. 0: no bound.
    #[arg(long, default_value_t = ste_bridge::gateway::PARTICIPANT_RATE_DEFAULT)]
    participant_rate: u32,
    /// Connections each listener serves at once logged on as one participant.
    #[arg(long, default_value_t = ste_bridge::listener::PER_PARTICIPANT_DEFAULT)]
    max_connections_per_participant: usize,
    /// Connections that have not yet logged on, from one source address (an IPv6 /64).
    #[arg(long, default_value_t = ste_bridge::listener::UNAUTHENTICATED_PER_SOURCE_DEFAULT)]
    max_unauthenticated_per_source: usize,
    /// Messages one connection or FIX session may have in flight.
    #[arg(long, default_value_t = 4096)]
    window: usize,
    /// Bytes of messages one framed-XML connection may have in flight.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    window_bytes: usize,
    /// Seconds from connecting to a logon (framed XML and FIX), not extended by heartbeats.
    #[arg(long, default_value_t = 10)]
    logon_timeout_s: u64,
    /// Milliseconds allowed from a frame's first byte to its last (framed XML), for a
    /// request's headers and for its body (SOAP), and for a whole message (FIX).
    #[arg(long, default_value_t = 10_000)]
    frame_timeout_ms: u64,
    /// Seconds a connection may stay silent (heartbeats count).
    #[arg(long, default_value_t = 300)]
    idle_timeout_s: u64,
    /// The participants' signing keys: CSV `bic,key_id,key_hex`, up to two keys per participant
    /// (rotation). Required unless --throwaway-keys.
    #[arg(long, env = "STE_KEYS_FILE")]
    keys: Option<PathBuf>,
    /// Draw a random key set instead of reading one, and write it to
    /// DATA_DIR/throwaway-keys.csv (owner-only) for local clients; loopback listeners only.
    #[arg(long, conflicts_with = "keys")]
    throwaway_keys: bool,
    /// Require client certificates signed by this CA (PEM) on every listener (mutual TLS).
    #[arg(long, env = "STE_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Serve plain TCP on addresses that are not loopback (without it, such a node needs TLS).
    #[arg(long)]
    plaintext: bool,
    /// Run as a node of a cluster on this NATS JetStream server (e.g. nats://127.0.0.1:4222):
    /// each shard's owner takes the shard's inbound queue and validates, matches and commits
    /// its messages in process (DESIGN.md section 1a).
    #[arg(long, env = "STE_NATS_URL")]
    nats: Option<String>,
    /// This node's name in the cluster (leases, logs); unique among the nodes. Default: the
    /// host's name (a container's, under docker compose --scale), so that nodes on one host
    /// need a name each.
    #[arg(long, env = "STE_NODE_ID", requires = "nats")]
    node_id: Option<String>,
    /// Shards this node owns at most (cluster); default: every shard.
    #[arg(long, env = "STE_MAX_SHARDS", requires = "nats")]
    max_shards: Option<u32>,
    /// Time to live of the cluster's leases in milliseconds, set by the first node of the
    /// cluster (later ones renew by the cluster's). A node that dies leaves its shards to the
    /// others this long after its last renewal.
    #[arg(long, default_value_t = 3_000, requires = "nats")]
    lease_ttl_ms: u64,
    /// How long a starting node tries to reach its cluster's queues and leases, in seconds,
    /// before it gives up and exits (servers that are starting, or electing leaders, time
    /// requests out meanwhile).
    #[arg(
        long,
        env = "STE_START_PATIENCE_S",
        default_value_t = 30,
        requires = "nats"
    )]
    start_patience_s: u64,
    /// The placement tags of the cluster's NATS servers, one per server, separated by commas
    /// (e.g. ste:0,ste:1,ste:2): shard k's inbound stream goes to the server of tag k mod the
    /// count, so that no server carries every message. The same on every node and driver.
    #[arg(
        long,
        env = "STE_NATS_PLACEMENT",
        value_name = "TAGS",
        requires = "nats"
    )]
    nats_placement: Option<String>,
    /// Copies of each stream of the cluster: 1 (default: the database commit is the record of
    /// durability, and a stream whose server is down waits for it) or 3.
    #[arg(
        long,
        env = "STE_NATS_REPLICAS",
        default_value_t = 1,
        requires = "nats"
    )]
    nats_replicas: usize,
    /// Serve the participants' listeners (framed XML, SOAP, FIX) on this node of a cluster:
    /// their messages go to the cluster's inbound queues under a gateway number of the
    /// node's, their answers come back to it, and copies of the cluster's CLS are pushed to
    /// the connections subscribed for them.
    #[arg(long, requires = "nats")]
    gateway: bool,
    /// Run the cluster's sink on this node: take every CLS and advice off the CLS queue (to
    /// --cls-out, if given), drop repeated ClsIds and confirm delivery, which advances each
    /// shard's watermark. One node of a cluster runs it (or `driver --nats` does, for a run).
    #[arg(long, requires = "nats")]
    sink: bool,
    /// The cluster's secrets folder (`driver secrets`): TLS to the NATS servers checked
    /// against its CA, and each role of this process (node, gateway, sink) connected as its own
    /// identity, whose seed file must be readable by its owner only; the shards' database
    /// roles' passwords from its `pgpass` (unless PGPASSFILE names another). Without it the
    /// servers must ask for neither.
    #[arg(long, env = "STE_SECRETS_DIR", value_name = "DIR", requires = "nats")]
    secrets: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=error")),
        )
        .init();
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("engine: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Each listener's connection bounds from the command line.
fn connection_limits(cli: &Cli) -> ste_bridge::listener::ConnectionLimits {
    ste_bridge::listener::ConnectionLimits {
        total: cli.max_connections.max(1),
        per_source: cli.max_connections_per_source.max(1),
        unauthenticated: cli.max_unauthenticated.max(1),
        unauthenticated_per_source: cli.max_unauthenticated_per_source.max(1),
        per_participant: cli.max_connections_per_participant.max(1),
    }
}

fn gateway_config(cli: &Cli, settings: &Settings) -> anyhow::Result<GatewayConfig> {
    std::fs::create_dir_all(&cli.data_dir)
        .with_context(|| format!("creating {}", cli.data_dir.display()))?;
    Ok(GatewayConfig {
        pipeline: PipelineConfig {
            // A node restarts on its own data: matchers are rebuilt from the shards and
            // unconfirmed CLS are emitted again.
            recover: true,
            ..settings.pipeline(&cli.data_dir)
        },
        tolerances: settings.tolerances.clone(),
        cls_out: cli.cls_out.clone(),
        ingress_capacity: GATEWAY_INGRESS_CAPACITY,
        participant_rate: cli.participant_rate,
    })
}

/// The cluster's lease time to live from the command line.
fn lease_ttl(cli: &Cli) -> Duration {
    Duration::from_millis(cli.lease_ttl_ms.max(100))
}

/// How long a starting node waits for its cluster's servers (`--start-patience-s`).
fn start_patience(cli: &Cli) -> Duration {
    Duration::from_secs(cli.start_patience_s)
}

/// The first listener whose address is not on loopback, if any.
fn off_loopback(cli: &Cli) -> anyhow::Result<Option<(&'static str, &str)>> {
    for (name, address) in [
        ("--tcp", &cli.tcp),
        ("--http", &cli.http),
        ("--fix", &cli.fix),
    ] {
        let resolved: Vec<std::net::SocketAddr> =
            std::net::ToSocketAddrs::to_socket_addrs(address.as_str())
                .with_context(|| format!("resolving {name} {address}"))?
                .collect();
        if resolved.is_empty() || resolved.iter().any(|a| !a.ip().is_loopback()) {
            return Ok(Some((name, address.as_str())));
        }
    }
    Ok(None)
}

/// The listeners' TLS: from the certificate files, or none — which a listener off loopback
/// accepts only when told to (--plaintext).
fn tls(cli: &Cli) -> anyhow::Result<Option<Tls>> {
    match cli.tls.pair() {
        Some((cert, key)) => {
            let files = TlsFiles {
                cert,
                key,
                client_ca: cli.tls_client_ca.clone(),
            };
            Ok(Some(tls::acceptor(&files).context("setting up TLS")?))
        }
        None => {
            if let Some((name, address)) = off_loopback(cli)? {
                if !cli.plaintext {
                    bail!("{name} {address} is not a loopback address: give the node a certificate (--tls-cert, --tls-key), or say --plaintext to serve plain TCP there");
                }
            }
            Ok(None)
        }
    }
}

/// The key set the node verifies with: the key file, or throw-away keys when every listener is
/// on loopback (a stranger on the network must never meet keys nobody manages).
fn key_ring(cli: &Cli, refdata: &RefData) -> anyhow::Result<KeyRing> {
    if let Some(path) = &cli.keys {
        return KeyRing::load(path)
            .with_context(|| format!("loading keys from {}", path.display()));
    }
    if !cli.throwaway_keys {
        bail!("no signing keys: give a key file (--keys FILE or STE_KEYS_FILE), or --throwaway-keys for a loopback-only node");
    }
    if let Some((name, address)) = off_loopback(cli)? {
        bail!("--throwaway-keys serves loopback listeners only, and {name} {address} is not one: give a key file (--keys FILE)");
    }
    let ring = KeyRing::generate_for(refdata);
    let path = cli.data_dir.join("throwaway-keys.csv");
    ring.write(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    info!(path = %path.display(), "throw-away signing keys written");
    Ok(ring)
}

/// The compiled-in reference data with the participants' keys the node verifies with.
fn refdata_with_keys(cli: &Cli) -> anyhow::Result<Arc<RefData>> {
    let refdata = RefData::embedded().context("loading the compiled-in reference data")?;
    let ring = key_ring(cli, &refdata)?;
    Ok(Arc::new(
        refdata
            .with_keys(&ring)
            .context("installing the signing keys")?,
    ))
}

fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(url) = cli.nats.clone() {
        let settings = cli.pipeline.resolve(Scope::Cluster)?;
        return run_node(&cli, &settings, &url);
    }
    let settings = cli.pipeline.resolve(Scope::InProcess)?;
    let config = gateway_config(&cli, &settings)?;
    let refdata = refdata_with_keys(&cli)?;
    let gateway = Gateway::start(&config, refdata).context("starting the engine")?;
    let report = serve(&cli, gateway, || {})?;
    let shards: Vec<String> = report
        .pipeline
        .iter()
        .flat_map(|pipeline| &pipeline.shards)
        .map(|s| s.messages.to_string())
        .collect();
    info!(
        submitted = report.submitted,
        accepted = report.accepted,
        duplicates = report.duplicates,
        rejected = report.rejected,
        cls = report.sink.cls,
        pushed = report.pushed,
        shards = shards.join(","),
        "stopped"
    );
    Ok(())
}

/// Serves the participants' listeners in front of `gateway` until SIGTERM or Ctrl-C, calling
/// `tick` every 5 s meanwhile, then drains the gateway.
fn serve(
    cli: &Cli,
    gateway: Gateway,
    tick: impl FnMut(),
) -> anyhow::Result<ste_bridge::gateway::GatewayReport> {
    let tls = tls(cli)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let handle = gateway.handle();
    let tcp_config = TcpConfig {
        tls: tls.clone(),
        connections: connection_limits(cli),
        window: cli.window.max(1),
        window_bytes: cli.window_bytes,
        logon_timeout: Duration::from_secs(cli.logon_timeout_s.max(1)),
        frame_timeout: Duration::from_millis(cli.frame_timeout_ms.max(1)),
        idle_timeout: Duration::from_secs(cli.idle_timeout_s.max(1)),
        ..TcpConfig::default()
    };
    let soap_config = SoapConfig {
        tls: tls.clone(),
        connections: connection_limits(cli),
        max_body_bytes: cli.max_body_bytes.max(1024),
        header_timeout: Duration::from_millis(cli.frame_timeout_ms.max(1)),
        body_timeout: Duration::from_millis(cli.frame_timeout_ms.max(1)),
    };
    let fix_config = FixConfig {
        tls,
        connections: connection_limits(cli),
        window: cli.window.max(1),
        logon_timeout: Duration::from_secs(cli.logon_timeout_s.max(1)),
        message_timeout: Duration::from_millis(cli.frame_timeout_ms.max(1)),
        session_dir: Some(cli.data_dir.join("fix-sessions")),
        daily_reset: cli.fix_reset_at,
        ..FixConfig::default()
    };
    runtime.block_on(async move {
        let shutdown = ShutdownSignal::install().context("installing the signal handlers")?;
        let listener = tokio::net::TcpListener::bind(&cli.tcp)
            .await
            .with_context(|| format!("listening on {}", cli.tcp))?;
        let http_listener = tokio::net::TcpListener::bind(&cli.http)
            .await
            .with_context(|| format!("listening on {}", cli.http))?;
        let fix_listener = tokio::net::TcpListener::bind(&cli.fix)
            .await
            .with_context(|| format!("listening on {}", cli.fix))?;
        let address = listener.local_addr().context("the listener's address")?;
        let http_address = http_listener
            .local_addr()
            .context("the listener's address")?;
        let fix_address = fix_listener
            .local_addr()
            .context("the listener's address")?;
        // On stdout, for whoever started the node (tests bind port 0 and read it here).
        println!("tcp {address}");
        println!("http {http_address}");
        println!("fix {fix_address}");
        info!(%fix_address, "FIX 4.4 listener ready");
        info!(%address, "framed-XML listener ready");
        info!(%http_address, "SOAP listener ready: POST /soap, GET /soap?wsdl");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let counters = handle.clone();
        let soap_server = tokio::spawn(soap::serve(
            http_listener,
            handle.clone(),
            soap_config,
            stop_rx.clone(),
        ));
        let fix_server = tokio::spawn(fix::serve(
            fix_listener,
            handle.clone(),
            fix_config,
            stop_rx.clone(),
        ));
        let server = tokio::spawn(tcp::serve(listener, handle, tcp_config, stop_rx));
        let status = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            tick.tick().await;
            loop {
                tick.tick().await;
                let c = counters.counters();
                info!(
                    submitted = c.submitted.load(Ordering::Relaxed),
                    accepted = c.accepted.load(Ordering::Relaxed),
                    duplicates = c.duplicates.load(Ordering::Relaxed),
                    rejected = c.rejected.load(Ordering::Relaxed),
                    pushed = c.pushed.load(Ordering::Relaxed),
                    "status"
                );
            }
        });
        shutdown.wait_ticking(tick).await;
        info!("stopping: no new messages; answering what is in flight");
        let _ = stop_tx.send(true);
        let _ = server.await;
        let _ = soap_server.await;
        let _ = fix_server.await;
        status.abort();
        tokio::task::spawn_blocking(move || gateway.finish())
            .await
            .context("the shutdown task")?
            .context("draining the engine")
    })
}

/// A node of a cluster: shard owners on the JetStream queues at `url`, until
/// SIGTERM or Ctrl-C.
fn run_node(cli: &Cli, settings: &Settings, url: &str) -> anyhow::Result<()> {
    if let Some(secrets) = &cli.secrets {
        ste_engine::store::PgStore::use_password_file_in(secrets);
    }
    let host_name = || {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|name| name.trim().to_owned())
            .filter(|name| !name.is_empty())
    };
    let Some(node_id) = cli.node_id.clone().or_else(host_name) else {
        bail!("a node of a cluster needs a name: --node-id ID (unique among the nodes)");
    };
    let shards = settings.shards;
    if cli.keys.is_none() {
        bail!(
            "the nodes of a cluster verify with one shared key set: --keys FILE (or STE_KEYS_FILE)"
        );
    }
    let refdata = refdata_with_keys(cli)?;
    let backlog_bytes = settings.shard_backlog_bytes as i64;
    let mut layout = ste_engine::cluster::ClusterLayout {
        shards,
        ..Default::default()
    };
    layout.inbound.bytes_max = backlog_bytes;
    let config = ste_engine::cluster::NodeConfig {
        node_id: node_id.clone(),
        layout,
        lease_ttl: lease_ttl(cli),
        shards_max: cli.max_shards.unwrap_or(shards),
        database_urls: settings.database_urls.clone(),
        tolerances: settings.tolerances.clone(),
        aging: settings.aging,
        batch_max: settings.batch_max,
        retry: Default::default(),
        matcher_memory: settings.matcher_memory,
        // Published on ste.samples.<node> for whoever collects them (the driver of a run).
        sample_interval: settings.sample_interval,
        start_patience: start_patience(cli),
    };
    let placement = ste_engine::queue::jetstream::Placement::parse(
        cli.nats_placement.as_deref(),
        cli.nats_replicas,
    )
    .map_err(anyhow::Error::msg)?;
    let access = ste_engine::cluster::ClusterAccess {
        url: url.to_owned(),
        placement,
        secrets: cli.secrets.clone(),
    };
    // Servers that start with the nodes, or elect leaders, time a request out or have no
    // responder yet: everything a node opens at start waits for them as long as it is told.
    let patience = start_patience(cli);
    let jetstream = ste_engine::cluster::retrying(patience, || access.connect(Role::Node))
        .with_context(|| format!("connecting to NATS at {url} as a node"))?;
    let layout = config.layout;
    let node = ste_engine::cluster::Node::start(&jetstream, config, refdata.clone())
        .context("starting the node")?;
    info!(node = %node_id, %url, "node started");
    println!("node {node_id}");
    let mut last = None;
    let log_holdings = || {
        let holdings = node.holdings();
        if last.as_ref() != Some(&holdings) {
            info!(node = %node_id, shards = ?holdings.shards, "holding");
            last = Some(holdings);
        }
    };
    let sink_connection = || {
        ste_engine::cluster::retrying(patience, || access.connect(Role::Sink))
            .with_context(|| format!("connecting to NATS at {url} as the sink"))
    };
    // A node that runs a gateway and the sink pushes what the sink takes off the CLS queue,
    // which keeps what a gateway's NATS connection misses while it is down; copies do not.
    let sink = if cli.sink && !cli.gateway {
        Some(ClusterSink::start(
            &sink_connection()?,
            &layout,
            cli.cls_out.as_deref(),
            patience,
        )?)
    } else {
        None
    };
    if cli.gateway {
        let feed = if cli.sink {
            let connection = sink_connection()?;
            let feed = ste_engine::cluster::retrying_carrier(patience, || {
                ste_engine::cluster::ClsFeed::open(&connection, &layout)
            })
            .context("opening the CLS queue")?;
            info!("running the cluster's sink in the gateway");
            Some(feed)
        } else {
            None
        };
        let gateway = cluster_gateway(cli, settings, &access, &layout, &node_id, refdata, feed)?;
        let report = serve(cli, gateway, log_holdings)?;
        info!(
            submitted = report.submitted,
            accepted = report.accepted,
            duplicates = report.duplicates,
            rejected = report.rejected,
            pushed = report.pushed,
            "the gateway stopped"
        );
    } else {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?;
        runtime.block_on(async {
            let shutdown = ShutdownSignal::install().context("installing the signal handlers")?;
            shutdown.wait_ticking(log_holdings).await;
            anyhow::Ok(())
        })?;
    }
    info!(node = %node_id, "stopping: finishing what is in hand");
    node.stop().context("stopping the node")?;
    if let Some(sink) = sink {
        let report = sink.stop()?;
        info!(
            cls = report.cls,
            repeats = report.cls_repeats,
            "the sink stopped"
        );
    }
    info!(node = %node_id, "stopped");
    Ok(())
}

/// The gateway of a cluster node: a gateway number of the node's, the shards' inbound queues, and
/// for the connections' pushes the CLS queue itself (`feed`: the gateway is the cluster's sink)
/// or copies of it.
fn cluster_gateway(
    cli: &Cli,
    settings: &Settings,
    access: &ste_engine::cluster::ClusterAccess,
    layout: &ste_engine::cluster::ClusterLayout,
    node_id: &str,
    refdata: Arc<RefData>,
    feed: Option<ste_engine::cluster::ClsFeed>,
) -> anyhow::Result<Gateway> {
    let (ingress, jetstream) = ste_engine::cluster::Ingress::open_as(
        access,
        Role::Gateway,
        layout,
        lease_ttl(cli),
        node_id,
        start_patience(cli),
    )
    .context("taking a gateway number")?;
    let (pushes, stopper, delivery): (ste_engine::queue::Rx<_>, _, _) = match feed {
        Some(mut feed) => (
            feed.take_events().context("the CLS queue")?,
            feed.stopper(),
            Some(feed.delivery()),
        ),
        None => {
            let copies = ste_engine::cluster::retrying(start_patience(cli), || {
                jetstream.copies::<ste_engine::pipeline::OutboundEvent>(
                    ste_engine::cluster::ClusterLayout::CLS_QUEUE,
                )
            })
            .context("listening to the CLS queue")?;
            let stopper = copies.stopper();
            (Box::new(copies), stopper, None)
        }
    };
    let config = GatewayConfig {
        pipeline: PipelineConfig::default(),
        tolerances: settings.tolerances.clone(),
        cls_out: cli.cls_out.clone().filter(|_| delivery.is_some()),
        ingress_capacity: GATEWAY_INGRESS_CAPACITY,
        participant_rate: cli.participant_rate,
    };
    Gateway::start_cluster(ingress, pushes, stopper, delivery, &config, refdata)
        .context("starting the gateway")
}

/// The cluster's sink on a node: the CLS queue's one consumer.
struct ClusterSink {
    stopper: ste_engine::queue::jetstream::StopReceiving,
    thread: std::thread::JoinHandle<std::io::Result<ste_sink::SinkReport>>,
}

impl ClusterSink {
    fn start(
        jetstream: &ste_engine::queue::jetstream::JetStream,
        layout: &ste_engine::cluster::ClusterLayout,
        cls_out: Option<&std::path::Path>,
        patience: Duration,
    ) -> anyhow::Result<Self> {
        let mut feed = ste_engine::cluster::retrying_carrier(patience, || {
            ste_engine::cluster::ClsFeed::open(jetstream, layout)
        })
        .context("opening the CLS queue")?;
        let events = feed.take_events().context("the CLS queue")?;
        let delivery = feed.delivery();
        let sink = ste_sink::Sink::new(cls_out, false).context("opening the CLS output")?;
        let clock = ste_engine::station::RunClock::start();
        let thread = std::thread::Builder::new()
            .name("sink".to_owned())
            .spawn(move || ste_sink::run(events, sink, clock, Some(delivery)))
            .context("starting the sink")?;
        info!("running the cluster's sink");
        Ok(Self {
            stopper: feed.stopper(),
            thread,
        })
    }

    fn stop(self) -> anyhow::Result<ste_sink::SinkReport> {
        self.stopper.stop();
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the sink panicked"))?
            .context("writing CLS")
    }
}

/// Messages that may wait between the listeners and the ingress thread.
const GATEWAY_INGRESS_CAPACITY: usize = 16_384;

/// SIGTERM or Ctrl-C. Installed before the listeners announce their addresses: a signal that
/// comes right after them must already find the handler, not the default action (death).
struct ShutdownSignal {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                term: signal(SignalKind::terminate())?,
                interrupt: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Waits for the signal, calling `tick` every 5 s meanwhile.
    async fn wait_ticking(self, mut tick: impl FnMut()) {
        let waiting = self.wait();
        tokio::pin!(waiting);
        let mut ticks = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = &mut waiting => return,
                _ = ticks.tick() => tick(),
            }
        }
    }

    async fn wait(mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.interrupt.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = &mut self;
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// `HH:MM` or `HH:MM:SS`.
fn parse_time_of_day(text: &str) -> Result<time::Time, String> {
    let long = time::macros::format_description!("[hour]:[minute]:[second]");
    let short = time::macros::format_description!("[hour]:[minute]");
    time::Time::parse(text, long)
        .or_else(|_| time::Time::parse(text, short))
        .map_err(|_| format!("{text:?} is not a time of day HH:MM or HH:MM:SS"))
}
