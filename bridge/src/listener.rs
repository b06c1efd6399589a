//! The accept loop every listener shares: bounds on the connections served at once — in all,
//! from one source, and, apart from those, on connections whose peer has not yet proved who it
//! is — TCP_NODELAY on every socket, a refusal for the connection over a bound, and a drain on
//! shutdown.

use std::future::Future;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ahash::AHashMap;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

/// How many connections a listener serves at once: in all, and from one source (an IPv4
/// address, or an IPv6 /64: one host's share), so that one client cannot take every slot; and,
/// apart from those, how many of them may not have authenticated yet, in all and from one
/// source, so that sockets that never log on cannot keep participants out; and how many may be
/// logged on as one participant, so that a participant with many addresses cannot hold every
/// slot.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub total: usize,
    pub per_source: usize,
    pub unauthenticated: usize,
    pub unauthenticated_per_source: usize,
    pub per_participant: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            total: 1024,
            per_source: 64,
            unauthenticated: UNAUTHENTICATED_DEFAULT,
            unauthenticated_per_source: UNAUTHENTICATED_PER_SOURCE_DEFAULT,
            per_participant: PER_PARTICIPANT_DEFAULT,
        }
    }
}

/// Default of [`ConnectionLimits::per_participant`].
pub const PER_PARTICIPANT_DEFAULT: usize = 64;

/// Default of [`ConnectionLimits::unauthenticated`].
pub const UNAUTHENTICATED_DEFAULT: usize = 256;
/// Default of [`ConnectionLimits::unauthenticated_per_source`].
pub const UNAUTHENTICATED_PER_SOURCE_DEFAULT: usize = 8;

/// Whom a connection counts against: its IPv4 address, or its IPv6 /64 (an IPv4-mapped IPv6
/// address is its IPv4 address).
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1_u128 << 64) - 1))),
        },
    }
}

/// The connections a listener serves, by source.
#[derive(Default)]
struct Counts {
    all: usize,
    by_source: AHashMap<IpAddr, usize>,
    unauthenticated: usize,
    unauthenticated_by_source: AHashMap<IpAddr, usize>,
    /// Connections logged on as each participant.
    by_participant: AHashMap<String, usize>,
}

fn decrement(map: &mut AHashMap<IpAddr, usize>, source: IpAddr) {
    if let Some(count) = map.get_mut(&source) {
        *count -= 1;
        if *count == 0 {
            map.remove(&source);
        }
    }
}

/// A connection's standing with its listener: it counts as unauthenticated until its protocol
/// calls [`Admission::authenticated_as`] (a logon whose proof checked out, or a request whose
/// signature did), and then against each participant it proved to be.
#[derive(Clone)]
pub struct Admission {
    authenticated: Arc<AtomicBool>,
    /// The participants it counts against.
    participants: Arc<Mutex<Vec<String>>>,
    counts: Arc<Mutex<Counts>>,
    source: IpAddr,
    per_participant: usize,
}

impl Admission {
    /// The peer proved it is `participant`: the connection no longer counts as unauthenticated,
    /// and counts against that participant — unless it already has its most connections, which
    /// is `Err` with the reason, and the connection should be closed.
    pub fn authenticated_as(&self, participant: &str) -> Result<(), String> {
        let mut participants = self
            .participants
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if !participants.iter().any(|p| p == participant) {
            let count = counts
                .by_participant
                .entry(participant.to_owned())
                .or_default();
            if *count >= self.per_participant {
                return Err(format!(
                    "at most {} connections logged on as {participant}",
                    self.per_participant
                ));
            }
            *count += 1;
            participants.push(participant.to_owned());
        }
        if !self.authenticated.swap(true, Ordering::AcqRel) {
            counts.unauthenticated -= 1;
            decrement(&mut counts.unauthenticated_by_source, self.source);
        }
        Ok(())
    }

    /// Whether the peer has proved who it is.
    pub fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::Acquire)
    }

    fn ended(&self) {
        let participants = self
            .participants
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        for participant in participants.iter() {
            if let Some(count) = counts.by_participant.get_mut(participant) {
                *count -= 1;
                if *count == 0 {
                    counts.by_participant.remove(participant);
                }
            }
        }
        counts.all -= 1;
        decrement(&mut counts.by_source, self.source);
        if !self.authenticated.load(Ordering::Acquire) {
            counts.unauthenticated -= 1;
            decrement(&mut counts.unauthenticated_by_source, self.source);
        }
    }
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
    F: Fn(Connection, Admission) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let limits = accepting.limits;
    let counts: Arc<Mutex<Counts>> = Arc::default();
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
                let source = source_of(peer.ip());
                let why = {
                    let mut counts = counts.lock().unwrap_or_else(PoisonError::into_inner);
                    let from_source = counts.by_source.get(&source).copied().unwrap_or(0);
                    let unauthenticated_from_source = counts
                        .unauthenticated_by_source
                        .get(&source)
                        .copied()
                        .unwrap_or(0);
                    let why = if counts.all >= limits.total {
                        Some(format!("the engine serves at most {} connections", limits.total))
                    } else if from_source >= limits.per_source {
                        Some(format!("at most {} connections from one address", limits.per_source))
                    } else if counts.unauthenticated >= limits.unauthenticated {
                        Some(format!(
                            "at most {} connections that have not logged on",
                            limits.unauthenticated
                        ))
                    } else if unauthenticated_from_source >= limits.unauthenticated_per_source {
                        Some(format!(
                            "at most {} connections that have not logged on from one address",
                            limits.unauthenticated_per_source
                        ))
                    } else {
                        None
                    };
                    if why.is_none() {
                        counts.all += 1;
                        *counts.by_source.entry(source).or_default() += 1;
                        counts.unauthenticated += 1;
                        *counts.unauthenticated_by_source.entry(source).or_default() += 1;
                    }
                    why
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
                let admission = Admission {
                    authenticated: Arc::new(AtomicBool::new(false)),
                    participants: Arc::default(),
                    counts: counts.clone(),
                    source,
                    per_participant: limits.per_participant,
                };
                let serve = serve.clone();
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
                        serve(connection, admission.clone()).await;
                    }
                    admission.ended();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_is_its_64_and_a_mapped_address_is_its_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().expect("an address");
        let b: IpAddr = "2001:db8:1:2:ffff:ffff:ffff:ffff"
            .parse()
            .expect("an address");
        let c: IpAddr = "2001:db8:1:3::1".parse().expect("an address");
        assert_eq!(source_of(a), source_of(b));
        assert_ne!(source_of(a), source_of(c));
        assert_eq!(
            source_of(a),
            "2001:db8:1:2::".parse::<IpAddr>().expect("an address")
        );
        let mapped: IpAddr = "::ffff:127.0.0.2".parse().expect("an address");
        assert_eq!(
            source_of(mapped),
            "127.0.0.2".parse::<IpAddr>().expect("an address")
        );
        let v4: IpAddr = "10.1.2.3".parse().expect("an address");
        assert_eq!(source_of(v4), v4);
    }
}
