//! The floor of Idem's HTTP stack: a reverse proxy made of the parts Idem's data plane stands
//! on and nothing else — hyper's HTTP/1 server, hyper-util's pooled client, tokio's
//! multi-threaded runtime — with no routing, recording, limits, logs or metrics.
//! `benches/wrk/compare` runs it beside nginx and Idem: what Idem's unrecorded requests cost over
//! it is Idem's own, and what it costs over nginx is the stack's.
//!
//! `cargo run --release --example hyper_proxy -- 127.0.0.1:18005 127.0.0.1:18001`

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Upstream = Client<HttpConnector, Full<Bytes>>;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: hyper_proxy <listen address> <upstream address>");
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().map_err(std::io::Error::other)?;
    let listener = TcpListener::bind(listen).await?;
    // As Idem's own client connects: without Nagle's delay on small writes.
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new()).build(connector);
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (client, upstream) = (client.clone(), upstream.clone());
        tokio::spawn(async move {
            let service = service_fn(move |request| forward(client.clone(), upstream.clone(), request));
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// Reads the request's body whole (as Idem does before it sends), sends it on, and answers
/// with the upstream's answer read whole.
async fn forward(
    client: Upstream,
    upstream: String,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (mut parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else { return Ok(status(StatusCode::BAD_REQUEST)) };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = format!("http://{upstream}{path}").parse::<Uri>() else { return Ok(status(StatusCode::BAD_REQUEST)) };
    parts.uri = uri;
    parts.headers.remove(hyper::header::HOST);
    let Ok(answer) = client.request(Request::from_parts(parts, Full::new(body))).await else {
        return Ok(status(StatusCode::BAD_GATEWAY));
    };
    let (parts, body) = answer.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else { return Ok(status(StatusCode::BAD_GATEWAY)) };
    Ok(Response::from_parts(parts, Full::new(body)))
}

fn status(status: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = status;
    response
}
