//! The accept loop every listener shares: a bound on the connections served at once, TCP_NODELAY
//! on every socket, a refusal for the connection over the bound, and a drain on shutdown.

use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ahash::AHashMap;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

/// How many connections a listener serves at once: in all, and from one source address (so
/// that one client cannot take every slot).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub total: usize,
    pub per_source: usize,
}

/// A byte stream a listener serves: plain TCP or TLS over it.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// An accepted connection, after its TLS handshake where the listener has TLS.
pub type Connection = Box<dyn Io>;

/// How a listener accepts: its bounds and, optionally, TLS.
#[derive(Clone)]
pub struct Accepting {
    pub limits: ConnectionLimits,
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Time allowed for a TLS handshake.
    pub handshake_timeout: Duration,
}

impl Accepting {
    /// Plain TCP within `limits`.
    pub fn plain(limits: ConnectionLimits) -> Self {
        Self {
            limits,
            tls: None,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Accepts connections until `shutdown` turns true and hands each to `serve`, within `limits`;
/// a connection over a bound is sent `refusal(why)` and closed. Then waits for every
/// connection served to finish.
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    name: &'static str,
    accepting: Accepting,
    mut shutdown: watch::Receiver<bool>,
    refusal: impl Fn(&str) -> Vec<u8>,
    serve: F,
) where
    F: Fn(Connection) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let limits = accepting.limits;
    let max_connections = limits.total;
    let per_source: Arc<Mutex<AHashMap<IpAddr, usize>>> = Arc::default();
    let active = Arc::new(AtomicUsize::new(0));
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (mut stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        warn!(listener = name, %error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let source = peer.ip();
                let from_source = per_source
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&source)
                    .copied()
                    .unwrap_or(0);
                let why = if active.load(Ordering::Relaxed) >= max_connections {
                    Some(format!("the engine serves at most {max_connections} connections"))
                } else if from_source >= limits.per_source {
                    Some(format!("at most {} connections from one address", limits.per_source))
                } else {
                    None
                };
                if let Some(why) = why {
                    // Over TLS a plain refusal would be noise to the client, and a handshake
                    // is what a refused client must not cost: the socket is just closed.
                    if accepting.tls.is_none() {
                        let refusal = refusal(&why);
                        connections.spawn(async move {
                            let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&refusal)).await;
                        });
                    }
                    continue;
                }
                active.fetch_add(1, Ordering::Relaxed);
                *per_source
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(source)
                    .or_default() += 1;
                let (serve, active, per_source) = (serve.clone(), active.clone(), per_source.clone());
                let (tls, handshake_timeout) = (accepting.tls.clone(), accepting.handshake_timeout);
                connections.spawn(async move {
                    debug!(listener = name, %peer, "connected");
                    let connection: Option<Connection> = match tls {
                        None => Some(Box::new(stream)),
                        Some(acceptor) => {
                            match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                                Ok(Ok(tls)) => Some(Box::new(tls)),
                                Ok(Err(error)) => {
                                    debug!(listener = name, %peer, error = ?error.to_string(), "TLS handshake failed");
                                    None
                                }
                                Err(_) => {
                                    debug!(listener = name, %peer, "TLS handshake timed out");
                                    None
                                }
                            }
                        }
                    };
                    if let Some(connection) = connection {
                        serve(connection).await;
                    }
                    active.fetch_sub(1, Ordering::Relaxed);
                    let mut counts = per_source.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(count) = counts.get_mut(&source) {
                        *count -= 1;
                        if *count == 0 {
                            counts.remove(&source);
                        }
                    }
                    drop(counts);
                    debug!(listener = name, %peer, "closed");
                });
            }
            _ = shutdown.changed() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    // What `serve` holds (the gateway handle among it) goes before the drain.
    drop(serve);
    info!(
        listener = name,
        connections = connections.len(),
        "listener stopped; draining"
    );
    while connections.join_next().await.is_some() {}
}
