//! A TCP proxy in front of the PostgreSQL server that reads the frontend's protocol messages,
//! so that a test can lose the answer to one chosen statement: the connection is cut when the
//! broker executes it (a `Bind` of the statement a `Parse` prepared from text containing a
//! needle), either before the server sees it or after the server committed it and answered. It
//! can also go down as a whole, as a failed host would: every connection cut, none accepted.
//! The broker reaches the server through it without TLS (`sslmode=disable`), so that its
//! messages can be read.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Where the connection is cut when the chosen statement is executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Before the server sees it: nothing of it is written.
    Before,
    /// After the server executed and committed it and answered: its answer never arrives.
    AfterCommit,
}

pub struct Wire {
    pub addr: std::net::SocketAddr,
    armed: Arc<Mutex<Option<(String, Cut)>>>,
    cuts: Arc<Mutex<u32>>,
    down: watch::Sender<bool>,
    silent: watch::Sender<bool>,
}

impl Wire {
    /// A proxy to the server at `server` (`host:port`).
    pub async fn start(server: &str) -> Wire {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (armed, cuts) = (Arc::new(Mutex::new(None)), Arc::new(Mutex::new(0)));
        let (down, _) = watch::channel(false);
        let (silent, _) = watch::channel(false);
        let (server, a, c, d, q) = (server.to_string(), armed.clone(), cuts.clone(), down.clone(), silent.clone());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((client, _)) = listener.accept().await {
                if *d.borrow() {
                    continue;
                }
                if *q.borrow() {
                    // Accepted, and never answered: a host gone silent.
                    held.push(client);
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(&server).await else { continue };
                tokio::spawn(relay(client, upstream, a.clone(), c.clone(), d.subscribe(), q.subscribe()));
            }
        });
        Wire { addr, armed, cuts, down, silent }
    }

    /// Cuts the connection that next executes a statement whose text contains `needle`, as
    /// `cut` says; once.
    pub fn cut_at(&self, needle: &str, cut: Cut) {
        *self.armed.lock().unwrap() = Some((needle.to_string(), cut));
    }

    /// How many connections were cut at a chosen statement.
    pub fn cuts(&self) -> u32 {
        *self.cuts.lock().unwrap()
    }

    /// Silent, as a host powered off or cut off by the network: connections stay open and new
    /// ones are accepted, but nothing passes either way, and nothing is refused.
    pub fn set_silent(&self) {
        self.silent.send_replace(true);
    }

    /// Down: every open connection is cut and new ones are closed at once; or up again.
    pub fn set_down(&self, down: bool) {
        self.down.send_replace(down);
    }
}

/// One frontend message: its type byte (none for the startup message) and its body.
struct Message {
    kind: Option<u8>,
    bytes: Vec<u8>,
}

/// Splits the complete messages off the front of `buf`; the first message of a connection has
/// no type byte.
fn messages(buf: &mut Vec<u8>, started: &mut bool) -> Vec<Message> {
    let mut out = Vec::new();
    loop {
        let head = if *started { 5 } else { 4 };
        if buf.len() < head {
            return out;
        }
        let at = head - 4;
        let len = u32::from_be_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
        let total = at + len;
        if buf.len() < total {
            return out;
        }
        let bytes: Vec<u8> = buf.drain(..total).collect();
        out.push(Message { kind: (*started).then(|| bytes[0]), bytes });
        *started = true;
    }
}

/// The first two NUL-terminated strings of a message's body.
fn two_strings(body: &[u8]) -> (String, String) {
    let mut parts = body.splitn(3, |&b| b == 0);
    let first = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    let second = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    (first, second)
}

async fn relay(
    mut client: TcpStream,
    mut server: TcpStream,
    armed: Arc<Mutex<Option<(String, Cut)>>>,
    cuts: Arc<Mutex<u32>>,
    mut down: watch::Receiver<bool>,
    mut silent: watch::Receiver<bool>,
) {
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    // The statements of this connection prepared from the needle's text; and, once the chosen
    // one is executed after the server's commit, that its answer is to be swallowed.
    let mut chosen: Vec<String> = Vec::new();
    let mut swallow = false;
    let (mut buf, mut started, mut answers) = (Vec::new(), false, Vec::new());
    let (mut from_client, mut from_server) = ([0u8; 16 * 1024], [0u8; 16 * 1024]);
    loop {
        tokio::select! {
            _ = async { down.wait_for(|d| *d).await.map(|_| ()) } => return,
            // Silent: the connection is held open, and nothing more passes.
            _ = async { silent.wait_for(|s| *s).await.map(|_| ()) } => {
                std::future::pending::<()>().await;
            }
            read = client_read.read(&mut from_client) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                buf.extend_from_slice(&from_client[..n]);
                for m in messages(&mut buf, &mut started) {
                    let body = &m.bytes[5.min(m.bytes.len())..];
                    let needle = armed.lock().unwrap().clone();
                    match (m.kind, needle) {
                        (Some(b'P'), Some((needle, _))) => {
                            let (name, text) = two_strings(body);
                            if text.contains(&needle) {
                                chosen.push(name);
                            }
                        }
                        (Some(b'B'), Some((_, cut))) if chosen.contains(&two_strings(body).1) => {
                            *armed.lock().unwrap() = None;
                            *cuts.lock().unwrap() += 1;
                            if cut == Cut::Before {
                                return;
                            }
                            swallow = true;
                        }
                        _ => {}
                    }
                    if server_write.write_all(&m.bytes).await.is_err() {
                        return;
                    }
                }
            }
            read = server_read.read(&mut from_server) => {
                let n = match read { Ok(0) | Err(_) => return, Ok(n) => n };
                if !swallow {
                    if client_write.write_all(&from_server[..n]).await.is_err() {
                        return;
                    }
                    continue;
                }
                // The server's answers from the chosen statement on: once `ReadyForQuery` ends
                // the answer to its `Sync`, it has committed, and the broker never hears it.
                answers.extend_from_slice(&from_server[..n]);
                if messages(&mut answers, &mut true).iter().any(|m| m.kind == Some(b'Z')) {
                    return;
                }
            }
        }
    }
}
