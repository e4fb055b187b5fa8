//! Streamed answers (docs/concepts.md): which upstream answers are passed through as they arrive, the
//! [`Tap`] that holds one in flight for the client, attached duplicates and the record, and the
//! body a client is sent from it, which ends visibly when the stream is cut.

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::HeaderMap;

pub(crate) mod tap;

pub(crate) use tap::{End, Next, Reader, Tap};

/// Answers up to this long, with their length announced, are read whole before the client sees
/// them: waiting for a few kilobytes costs less than passing them on part by part.
pub(crate) const BUFFERED_MAX: u64 = 64 * 1024;

/// How far the upstream is read ahead of the slowest reader once an answer is past storing.
pub(crate) const WINDOW: u64 = 256 * 1024;

/// Is this answer passed to the client as it arrives? Server-sent events always; any other body
/// without an announced length (chunked), or longer than [`BUFFERED_MAX`].
pub(crate) fn is_streamed(headers: &HeaderMap) -> bool {
    if is_event_stream(headers) {
        return true;
    }
    match headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(length) => length > BUFFERED_MAX,
        None => true,
    }
}

/// `text/event-stream`, whatever its parameters and case.
pub(crate) fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// The event a server-sent-events client reads last when its stream is cut: `idem-error`, whose
/// data is the problem document, one `data:` line per line of it.
pub(crate) fn error_event(problem: &str) -> Bytes {
    let mut event = String::from("event: idem-error\n");
    for line in problem.lines() {
        event.push_str("data: ");
        event.push_str(line);
        event.push('\n');
    }
    event.push('\n');
    Bytes::from(event)
}

/// Why a client's body ended short: what hyper sees, so the response is aborted rather than
/// ended as though it were whole.
#[derive(Debug, thiserror::Error)]
#[error("the upstream's stream was cut")]
pub(crate) struct StreamCut;

/// The body a client is sent from `reader`: every part as it comes; at a cut, the `idem-error`
/// event for server-sent events, then an error that aborts the response (chunked encoding
/// without its last chunk), so no client takes a partial body for a whole one.
pub(crate) fn client_body(reader: Reader, event_stream: bool) -> Body {
    enum Step {
        Reading(Reader),
        Failing,
        Over,
    }
    let parts = futures_util::stream::unfold(Step::Reading(reader), move |step| async move {
        match step {
            Step::Reading(mut reader) => match reader.next().await {
                Next::Part(part) => Some((Ok(part), Step::Reading(reader))),
                Next::End(End::Complete) => None,
                Next::End(End::Cut(problem)) if event_stream => Some((Ok(error_event(&problem)), Step::Failing)),
                Next::End(End::Cut(_)) => Some((Err(cut_after_flush().await), Step::Over)),
            },
            Step::Failing => Some((Err(cut_after_flush().await), Step::Over)),
            Step::Over => None,
        }
    });
    Body::from_stream(parts)
}

/// The error that aborts a client's response, once what was passed on before it is written.
/// hyper drops what it has buffered but not yet written when a body fails — the parts before
/// the cut, the error event, even the response's head — and writes out whatever it holds
/// whenever the body has nothing ready: so the body has nothing ready once, first.
async fn cut_after_flush() -> StreamCut {
    tokio::task::yield_now().await;
    StreamCut
}

/// The problem text a cut carries, shared by every reader of the tap.
pub(crate) fn cut(problem: String) -> End {
    End::Cut(Arc::from(problem))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn event_streams_chunked_and_long_bodies_are_streamed_short_ones_are_not() {
        assert!(is_streamed(&headers(&[("content-type", "Text/Event-Stream; charset=utf-8")])));
        assert!(is_streamed(&headers(&[("content-type", "text/event-stream"), ("content-length", "10")])));
        assert!(is_streamed(&headers(&[("content-type", "application/json")])), "no length: chunked");
        assert!(is_streamed(&headers(&[("content-length", "65537")])));
        assert!(!is_streamed(&headers(&[("content-length", "65536")])));
        assert!(!is_streamed(&headers(&[("content-type", "application/json"), ("content-length", "12")])));
        assert!(is_streamed(&headers(&[("content-length", "twelve")])), "an unreadable length is none");
    }

    #[test]
    fn the_error_event_carries_each_line_of_the_problem_as_data() {
        assert_eq!(&error_event("{\"a\":1}")[..], b"event: idem-error\ndata: {\"a\":1}\n\n");
        assert_eq!(&error_event("{\n}")[..], b"event: idem-error\ndata: {\ndata: }\n\n");
    }

    #[tokio::test]
    async fn a_cut_event_stream_ends_with_the_error_event_then_aborts() {
        use http_body_util::BodyExt;
        let tap = Tap::new(1024, 64);
        let body = client_body(tap.attach().unwrap(), true);
        tap.push(Bytes::from_static(b"data: 1\n\n")).await;
        tap.finish(cut("{}".into()));
        let mut body = body;
        let mut seen = Vec::new();
        let mut failed = false;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => seen.extend_from_slice(&frame.into_data().unwrap()),
                Err(_) => failed = true,
            }
        }
        assert_eq!(seen, b"data: 1\n\nevent: idem-error\ndata: {}\n\n");
        assert!(failed, "the response is aborted, not ended as whole");
    }

    #[tokio::test]
    async fn a_whole_stream_ends_cleanly() {
        let tap = Tap::new(1024, 64);
        let body = client_body(tap.attach().unwrap(), false);
        tap.push(Bytes::from_static(b"abc")).await;
        tap.finish(End::Complete);
        let bytes = axum::body::to_bytes(body, 1024).await.unwrap();
        assert_eq!(&bytes[..], b"abc");
    }
}
