//! A TCP forwarder on loopback that can be cut and healed: how the nemesis cuts one node off
//! from the NATS servers or from its databases while the rest of the cluster still reaches
//! them. A node is given the forwarders' addresses instead of the servers'; cutting closes
//! every connection through the forwarder and stops listening (a connection attempt is then
//! refused), healing listens again on the same port. What goes through is copied as it is
//! (TLS runs end to end between the node and the server).

use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;

/// Connections a forwarder carries at once; more are closed as they come.
const CONNECTIONS_MAX: usize = 64;
/// How often the forwarder looks for a connection, a cut or a heal.
const POLL: Duration = Duration::from_millis(20);
/// How long it waits for the server when a connection comes.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A forwarder from a port of its own on 127.0.0.1 to `upstream`.
pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    upstream: SocketAddr,
    cut: AtomicBool,
    stop: AtomicBool,
    next_id: AtomicU64,
    /// Both ends of every connection it carries, to close them at a cut.
    connections: Mutex<Vec<(u64, TcpStream, TcpStream)>>,
}

impl Shared {
    fn close_all(&self) {
        let connections = std::mem::take(&mut *self.connections.lock().expect("connections"));
        for (_, client, server) in connections {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
        }
    }

    fn forget(&self, id: u64) {
        self.connections
            .lock()
            .expect("connections")
            .retain(|(other, _, _)| *other != id);
    }
}

impl Proxy {
    /// Starts forwarding from a free port to `upstream`.
    pub fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("a forwarder's port")?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            upstream,
            cut: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            connections: Mutex::default(),
        });
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("proxy-{port}"))
                .spawn(move || accept(listener, port, &shared))
                .context("starting a forwarder")?
        };
        Ok(Self {
            port,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address clients are given.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection and refuses new ones until [`Proxy::heal`].
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::Release);
        self.shared.close_all();
    }

    /// Forwards again (the acceptor listens again within a poll).
    pub fn heal(&self) {
        self.shared.cut.store(false, Ordering::Release);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.close_all();
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

/// Accepts while not cut; while cut, holds no listener, so that connections are refused.
fn accept(listener: TcpListener, port: u16, shared: &Arc<Shared>) {
    let mut listener = Some(listener);
    while !shared.stop.load(Ordering::Acquire) {
        if shared.cut.load(Ordering::Acquire) {
            listener = None;
            std::thread::sleep(POLL);
            continue;
        }
        let Some(open) = listener.as_ref() else {
            // Healed: listen on the same port again (the kernel may hold it a moment).
            listener = TcpListener::bind(("127.0.0.1", port)).ok();
            if listener.is_none() {
                std::thread::sleep(POLL);
            }
            continue;
        };
        if open.set_nonblocking(true).is_err() {
            std::thread::sleep(POLL);
            continue;
        }
        match open.accept() {
            Ok((client, _)) => {
                let _ = client.set_nonblocking(false);
                carry(client, shared);
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// Connects `client` to the server and copies both ways on two threads, until either side
/// closes or a cut closes both.
fn carry(client: TcpStream, shared: &Arc<Shared>) {
    let connected = shared.connections.lock().expect("connections").len();
    if connected >= CONNECTIONS_MAX {
        return;
    }
    let Ok(server) = TcpStream::connect_timeout(&shared.upstream, CONNECT_TIMEOUT) else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(client_copy), Ok(server_copy), Ok(client_kept), Ok(server_kept)) = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
    ) else {
        return;
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    shared
        .connections
        .lock()
        .expect("connections")
        .push((id, client_kept, server_kept));
    // A cut that came while this connection was being made closes it too.
    if shared.cut.load(Ordering::Acquire) {
        shared.close_all();
        return;
    }
    let pipe = |mut from: TcpStream, mut to: TcpStream, shared: Arc<Shared>| {
        move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
            shared.forget(id);
        }
    };
    let _ = std::thread::Builder::new()
        .name("proxy-up".into())
        .spawn(pipe(client, server, shared.clone()));
    let _ = std::thread::Builder::new()
        .name("proxy-down".into())
        .spawn(pipe(server_copy, client_copy, shared.clone()));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// An echo server on a free port.
    fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
        let address = listener.local_addr().expect("its address");
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut stream = stream;
                    let mut reader = stream.try_clone().expect("a clone");
                    let _ = std::io::copy(&mut reader, &mut stream);
                });
            }
        });
        address
    }

    fn round_trip(port: u16) -> std::io::Result<Vec<u8>> {
        let mut stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(b"ping")?;
        let mut answer = [0; 4];
        stream.read_exact(&mut answer)?;
        Ok(answer.to_vec())
    }

    #[test]
    fn a_cut_closes_what_goes_through_and_refuses_more_until_healed() {
        let proxy = Proxy::start(echo()).expect("a forwarder");
        assert_eq!(round_trip(proxy.port()).expect("through"), b"ping");
        let mut open = TcpStream::connect(("127.0.0.1", proxy.port())).expect("connects");
        open.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("a timeout");
        open.write_all(b"ping").expect("writes");
        let mut answer = [0; 4];
        open.read_exact(&mut answer).expect("echoed");

        proxy.cut();
        let mut rest = Vec::new();
        // The open connection ends: end of stream or reset, not a hang.
        let ended = open.read_to_end(&mut rest);
        assert!(ended.as_ref().map_or(true, |read| *read == 0), "{ended:?}");
        std::thread::sleep(POLL * 5);
        assert!(round_trip(proxy.port()).is_err(), "refused while cut");

        proxy.heal();
        let healed = (0..100).find_map(|_| {
            std::thread::sleep(POLL);
            round_trip(proxy.port()).ok()
        });
        assert_eq!(healed.as_deref(), Some(&b"ping"[..]));
    }
}
