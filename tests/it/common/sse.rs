//! A fake upstream that answers like an OpenAI-style streaming chat completion: server-sent
//! events, `data: {…}` lines ending with `data: [DONE]`, scripted per Idempotency-Key. It counts
//! each key's requests, and a script can hold its stream at a gate until the test opens it, so a
//! test can see what reached the client while the upstream is provably not finished.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// One step of a scripted answer.
#[derive(Clone, Debug)]
pub enum Step {
    /// `data: {"choices":[{"delta":{"content":TEXT}}]}`, then a blank line.
    Event(String),
    /// `data: [DONE]`: the normal end of the stream.
    Done,
    /// Waits this long before the next step.
    Wait(Duration),
    /// Waits until the test calls [`SseUpstream::open`] for this key.
    Gate,
    /// Cuts the connection: the body ends without its last chunk.
    Cut,
    /// Sends nothing more, ever.
    Stall,
    /// One event whose content is this many `x`s: bulk, to fill buffers quickly.
    Filler(usize),
}

/// A scripted answer: a status without a stream (`Refuse`), a 200 event stream, or the same
/// parts as a chunked `application/json` body (no length announced).
#[derive(Clone, Debug)]
pub enum Answer {
    Refuse(u16),
    Stream(Vec<Step>),
    Chunked(Vec<Step>),
}

/// `n` events `part 1` … `part n`, then `[DONE]`.
pub fn events(n: usize) -> Vec<Step> {
    let mut steps: Vec<Step> = (1..=n).map(|i| Step::Event(format!("part {i}"))).collect();
    steps.push(Step::Done);
    steps
}

/// The bytes of one event as the upstream sends it.
pub fn event_bytes(text: &str) -> String {
    let data = serde_json::json!({"object": "chat.completion.chunk", "choices": [{"delta": {"content": text}}]});
    format!("data: {data}\n\n")
}

pub const DONE: &str = "data: [DONE]\n\n";

#[derive(Default)]
struct Seen {
    hits: HashMap<String, u32>,
    scripts: HashMap<String, VecDeque<Answer>>,
    gates: HashMap<String, Arc<Semaphore>>,
    /// Keys whose stream the upstream has sent to its end (or cut).
    finished: HashMap<String, u32>,
}

#[derive(Clone)]
pub struct SseUpstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
}

impl SseUpstream {
    pub async fn start() -> SseUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let app = axum::Router::new().fallback(answer).with_state(seen.clone());
        // Each event goes out as it is written, as streaming upstreams do: what holds one
        // back on its way to the client is then the broker's doing.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        SseUpstream { addr, seen }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The answers to give `key`'s next requests, in order; after them, [`events`]`(3)`.
    pub fn script(&self, key: &str, answers: Vec<Answer>) {
        self.seen.lock().unwrap().scripts.insert(key.to_string(), answers.into());
    }

    pub fn hits(&self, key: &str) -> u32 {
        self.seen.lock().unwrap().hits.get(key).copied().unwrap_or(0)
    }

    /// How many of `key`'s streams the upstream has ended or cut.
    pub fn finished(&self, key: &str) -> u32 {
        self.seen.lock().unwrap().finished.get(key).copied().unwrap_or(0)
    }

    /// Lets `key`'s stream go past one [`Step::Gate`].
    pub fn open(&self, key: &str) {
        self.gate(key).add_permits(1);
    }

    fn gate(&self, key: &str) -> Arc<Semaphore> {
        gate(&self.seen, key)
    }
}

fn gate(seen: &Mutex<Seen>, key: &str) -> Arc<Semaphore> {
    seen.lock().unwrap().gates.entry(key.to_string()).or_insert_with(|| Arc::new(Semaphore::new(0))).clone()
}

// The request's body is read whole before answering: closing a socket with unread input makes
// the kernel send a reset, which can discard the answer's bytes before the broker reads them.
async fn answer(State(seen): State<Arc<Mutex<Seen>>>, headers: HeaderMap, _body: Bytes) -> Response {
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let scripted = {
        let mut s = seen.lock().unwrap();
        *s.hits.entry(key.clone()).or_default() += 1;
        s.scripts.get_mut(&key).and_then(VecDeque::pop_front)
    };
    let (steps, content_type) = match scripted.unwrap_or(Answer::Stream(events(3))) {
        Answer::Refuse(status) => {
            let body = serde_json::json!({"error": {"message": "try again"}}).to_string();
            return (StatusCode::from_u16(status).unwrap(), body).into_response();
        }
        Answer::Stream(steps) => (steps, "text/event-stream"),
        Answer::Chunked(steps) => (steps, "application/json"),
    };
    let parts = futures_util::stream::unfold((steps.into_iter(), seen, key), |(mut steps, seen, key)| async move {
        loop {
            let ended = |seen: &Mutex<Seen>| *seen.lock().unwrap().finished.entry(key.clone()).or_default() += 1;
            let item = match steps.next()? {
                Step::Event(text) => Ok(Bytes::from(event_bytes(&text))),
                Step::Done => {
                    ended(&seen);
                    Ok(Bytes::from_static(DONE.as_bytes()))
                }
                Step::Wait(d) => {
                    tokio::time::sleep(d).await;
                    continue;
                }
                Step::Gate => {
                    gate(&seen, &key).acquire().await.unwrap().forget();
                    continue;
                }
                Step::Cut => {
                    // hyper drops what it buffered but has not written when a body fails: let the
                    // events before the cut go out first, as a real upstream's would have.
                    tokio::task::yield_now().await;
                    ended(&seen);
                    Err(std::io::Error::other("cut by the script"))
                }
                Step::Stall => std::future::pending().await,
                Step::Filler(n) => Ok(Bytes::from(event_bytes(&"x".repeat(n)))),
            };
            return Some((item, (steps, seen, key)));
        }
    });
    Response::builder()
        .status(200)
        .header("content-type", content_type)
        .header("cache-control", "no-cache")
        .body(Body::from_stream(parts))
        .unwrap()
}
