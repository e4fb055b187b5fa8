//! Server-sent events as MCP's Streamable HTTP carries JSON-RPC messages in them: one message
//! per event, in its `data` lines. The broker splits a stream into events to read the messages
//! it looks at (an `initialize` result, a `tools/list` result, `notifications/tools/list_changed`)
//! and passes every event on byte for byte unless it changes that message.

use serde_json::Value;

/// An event longer than this is passed on unread: no message the broker looks at is that long,
/// and the stream must not be held in memory.
const MAX_EVENT: usize = 4 * 1024 * 1024;

/// Splits a stream's bytes into whole events (each with the blank line that ends it).
#[derive(Default)]
pub(crate) struct Events {
    pending: Vec<u8>,
    /// Bytes still to pass unread, until the end of an event too long to read.
    skipping: bool,
    /// How far `pending` was searched for an event's end: a long event arriving in many parts
    /// is searched once, not once per part.
    searched: usize,
}

/// A piece of the stream: a whole event to read, or bytes to pass on as they are.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    Event(Vec<u8>),
    Raw(Vec<u8>),
}

impl Events {
    /// The pieces that `bytes` completes.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<Piece> {
        self.pending.extend_from_slice(bytes);
        let mut pieces = Vec::new();
        // A blank line may straddle the parts: search again from a few bytes back.
        let mut from = self.searched.saturating_sub(3);
        while let Some(end) = event_end(&self.pending[from..]).map(|end| from + end) {
            from = 0;
            let event: Vec<u8> = self.pending.drain(..end).collect();
            pieces.push(if std::mem::take(&mut self.skipping) { Piece::Raw(event) } else { Piece::Event(event) });
        }
        if self.pending.len() > MAX_EVENT {
            self.skipping = true;
            pieces.push(Piece::Raw(std::mem::take(&mut self.pending)));
        }
        self.searched = self.pending.len();
        pieces
    }

    /// What is left at the stream's end: an unfinished event, passed on as it is.
    pub(crate) fn rest(&mut self) -> Option<Vec<u8>> {
        (!self.pending.is_empty()).then(|| std::mem::take(&mut self.pending))
    }
}

/// Where the first event in `bytes` ends: after its blank line (`\n\n`, `\r\n\r\n` or `\r\r`).
fn event_end(bytes: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < bytes.len() {
        match (bytes[i], bytes[i + 1]) {
            (b'\n', b'\n') | (b'\r', b'\r') => return Some(i + 2),
            (b'\r', b'\n') if bytes.get(i + 2..i + 4) == Some(b"\r\n") => return Some(i + 4),
            _ => i += 1,
        }
    }
    None
}

fn lines(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    event.split(|&b| b == b'\n').map(|line| line.strip_suffix(b"\r").unwrap_or(line)).filter(|l| !l.is_empty())
}

/// The JSON-RPC message an event carries: its `data` lines joined, parsed as JSON.
pub(crate) fn message(event: &[u8]) -> Option<Value> {
    let mut data = Vec::new();
    for line in lines(event) {
        let value = match line.strip_prefix(b"data:") {
            Some(value) => value.strip_prefix(b" ").unwrap_or(value),
            None => continue,
        };
        if !data.is_empty() {
            data.push(b'\n');
        }
        data.extend_from_slice(value);
    }
    serde_json::from_slice(&data).ok()
}

/// The event with its data replaced by `message`; its other fields (`id`, `event`) kept.
pub(crate) fn with_message(event: &[u8], message: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.len() + 64);
    let mut data_written = false;
    for line in lines(event) {
        if line.starts_with(b"data:") {
            if !data_written {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(message.to_string().as_bytes());
                out.push(b'\n');
                data_written = true;
            }
            continue;
        }
        out.extend_from_slice(line);
        out.push(b'\n');
    }
    out.push(b'\n');
    out
}

/// An event of the broker's own: `event: idem-error`, which ends a cut stream (docs/concepts.md).
pub(crate) fn is_broker_error(event: &[u8]) -> bool {
    lines(event).any(|line| line == b"event: idem-error" || line == b"event:idem-error")
}

/// A message as an event of its own.
pub(crate) fn event(message: &Value) -> Vec<u8> {
    format!("event: message\ndata: {message}\n\n").into_bytes()
}

/// Every message of a whole stream, in order.
pub(crate) fn messages(stream: &[u8]) -> Vec<Value> {
    let mut events = Events::default();
    let mut pieces = events.push(stream);
    pieces.extend(events.rest().map(Piece::Event));
    pieces
        .into_iter()
        .filter_map(|piece| match piece {
            Piece::Event(event) => message(&event),
            Piece::Raw(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_stream_splits_into_events_however_its_bytes_arrive() {
        let stream = b"event: message\ndata: {\"a\":1}\n\nid: 2\r\ndata: {\"b\":\r\ndata: 2}\r\n\r\ndata: [";
        for cut in 0..stream.len() {
            let mut events = Events::default();
            let mut pieces = events.push(&stream[..cut]);
            pieces.extend(events.push(&stream[cut..]));
            let read: Vec<Value> = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Event(e) => message(e),
                    Piece::Raw(_) => None,
                })
                .collect();
            assert_eq!(read, vec![json!({"a": 1}), json!({"b": 2})], "cut at {cut}");
            assert_eq!(events.rest(), Some(b"data: [".to_vec()));
        }
    }

    #[test]
    fn a_rewritten_event_keeps_its_other_fields() {
        let event = b"event: message\nid: 7\ndata: {\"x\":1}\n\n";
        let rewritten = with_message(event, &json!({"y": 2}));
        assert_eq!(rewritten, b"event: message\nid: 7\ndata: {\"y\":2}\n\n");
        assert_eq!(message(&rewritten), Some(json!({"y": 2})));
    }

    #[test]
    fn an_event_too_long_to_read_passes_on_unread() {
        let mut events = Events::default();
        let long = vec![b'x'; MAX_EVENT + 1];
        assert_eq!(events.push(&long), vec![Piece::Raw(long.clone())]);
        assert_eq!(
            events.push(b"y\n\ndata: 1\n\n"),
            vec![Piece::Raw(b"y\n\n".to_vec()), Piece::Event(b"data: 1\n\n".to_vec())]
        );
    }

    #[test]
    fn a_stored_stream_gives_its_messages_in_order() {
        let stream =
            b": comment\n\ndata: {\"method\":\"notifications/progress\"}\n\ndata: {\"id\":1,\"result\":{}}\n\n";
        assert_eq!(messages(stream), vec![json!({"method": "notifications/progress"}), json!({"id": 1, "result": {}})]);
    }
}
