//! Requests that are proxied without being recorded: methods that need no key, and keyless
//! requests on routes that do not require one.

use axum::extract::Request;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::intake::{deadline, read_body};
use super::Ingress;
use crate::config::{Config, Route};
use crate::problem::Problem;
use crate::upstream::{self, Outbound};

impl Ingress {
    /// Methods that need no key are proxied as they are: nothing is recorded.
    pub(super) async fn plain(&self, config: &Config, route: &Route, request: Request) -> Response {
        let (mut parts, body) = request.into_parts();
        let url = match route.upstream_url(parts.uri.path(), parts.uri.query().unwrap_or("")) {
            Ok(url) => url,
            Err(why) => return Problem::invalid_path(&why).into_response(),
        };
        let (body, _held) = match read_body(body, route, &self.bodies).await {
            Ok(read) => read,
            Err(problem) => return problem.into_response(),
        };
        let mut credentials = upstream::route_credentials(route, parts.headers.get(header::AUTHORIZATION));
        let limit = deadline(&route.retry, route, &parts.headers);
        upstream::tell_deadline(&mut credentials, route.deadline_header.as_ref(), limit);
        // Nothing is stored: the client's own map goes on, with what may go upstream left in it.
        let mut headers = std::mem::take(&mut parts.headers);
        upstream::keep_forwardable(&mut headers, true);
        upstream::forward(&mut headers, parts.extensions.get(), &config.server.forwarded);
        let request = Outbound::passed(route, &parts.method, url, headers, &credentials, body);
        match self.upstream.pass(request, limit).await {
            Ok(answer) => answer.map(axum::body::Body::from),
            Err(failure) if failure.observed == crate::policy::Observed::TimedOut => {
                Problem::deadline_exceeded().into_response()
            }
            Err(failure) => {
                let why = failure.cause.map(|cause| format!("route {}: {}", route.name, cause.why));
                let reason = super::answers::could_not_reach(why.as_deref());
                Problem::upstream_unavailable(&reason).retry_after(1).into_response()
            }
        }
    }
}
