use std::net::SocketAddr;

/// Who sent a request to the broker: the peer of its connection, and whether that was TLS. The
/// edge puts it in each request's extensions; what goes upstream names it
/// (`X-Forwarded-For`, `Forwarded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub peer: SocketAddr,
    pub tls: bool,
}
