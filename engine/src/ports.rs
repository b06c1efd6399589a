//! Ports for the servers a test or a local run starts for itself on loopback.
//!
//! A port from the kernel's ephemeral range (`bind(":0")`) is unsafe for a server started a
//! moment later: between the probe and the server's own bind, any outgoing connection on the
//! machine may be given that port as its local end, and two threads probing at once may both be
//! told the same one. So ports come from below the ephemeral range (32768 on Linux), from a
//! window that depends on the process, and never twice from one process.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The range ports are taken from: below Linux's ephemeral range (32768–60999), above the
/// well-known services of these machines, and clear of those tests start at fixed offsets
/// (PostgreSQL instances at 26000–28000) and of RabbitMQ's 25672.
const FIRST: u32 = 10_000;
const LAST: u32 = 25_000;

/// How many ports this process has been handed (or skipped as taken).
static NEXT: AtomicU32 = AtomicU32::new(0);

/// A port on 127.0.0.1 nothing listens on, never handed out before by this process.
pub fn free_local_port() -> std::io::Result<u16> {
    let span = LAST - FIRST;
    let base = (std::process::id().wrapping_mul(97)) % span;
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (base + offset) % span;
        let port = u16::try_from(port).expect("ports below 25000 fit in u16");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free port on 127.0.0.1 between {FIRST} and {LAST}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_and_never_handed_out_twice() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let port = free_local_port().expect("a free port");
            assert!((FIRST..LAST).contains(&u32::from(port)), "{port}");
            assert!(seen.insert(port), "{port} handed out twice");
        }
    }

    #[test]
    fn a_port_something_listens_on_is_skipped() {
        let port = free_local_port().expect("a free port");
        let _held = TcpListener::bind(("127.0.0.1", port)).expect("binds");
        // Handing out continues past it; whichever comes next is free.
        let next = free_local_port().expect("a free port");
        assert_ne!(next, port);
        assert!(TcpListener::bind(("127.0.0.1", next)).is_ok());
    }
}
