//! The accept loop every listener shares: a bound on the connections served at once, TCP_NODELAY
//! on every socket, a refusal for the connection over the bound, and a drain on shutdown.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

/// Accepts connections until `shutdown` turns true and hands each to `serve`, at most
/// `max_connections` at once; a connection over the bound is sent `refusal()` and closed. Then
/// waits for every connection served to finish.
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    name: &'static str,
    max_connections: usize,
    mut shutdown: watch::Receiver<bool>,
    refusal: impl Fn() -> Vec<u8>,
    serve: F,
) where
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
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
                if active.load(Ordering::Relaxed) >= max_connections {
                    let refusal = refusal();
                    connections.spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&refusal)).await;
                    });
                    continue;
                }
                active.fetch_add(1, Ordering::Relaxed);
                let (served, active) = (serve(stream), active.clone());
                connections.spawn(async move {
                    debug!(listener = name, %peer, "connected");
                    served.await;
                    active.fetch_sub(1, Ordering::Relaxed);
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
