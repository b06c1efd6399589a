//! The accept loop every listener shares: a bound on the connections served at once, TCP_NODELAY
//! on every socket, a refusal for the connection over the bound, and a drain on shutdown.

use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ahash::AHashMap;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
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

/// Accepts connections until `shutdown` turns true and hands each to `serve`, within `limits`;
/// a connection over a bound is sent `refusal(why)` and closed. Then waits for every
/// connection served to finish.
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    name: &'static str,
    limits: ConnectionLimits,
    mut shutdown: watch::Receiver<bool>,
    refusal: impl Fn(&str) -> Vec<u8>,
    serve: F,
) where
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
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
                    let refusal = refusal(&why);
                    connections.spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&refusal)).await;
                    });
                    continue;
                }
                active.fetch_add(1, Ordering::Relaxed);
                *per_source
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(source)
                    .or_default() += 1;
                let (served, active, per_source) = (serve(stream), active.clone(), per_source.clone());
                connections.spawn(async move {
                    debug!(listener = name, %peer, "connected");
                    served.await;
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
