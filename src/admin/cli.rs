//! `idem requests …` and `idem switch …`: the operator CLI, a client of the admin API. Readable
//! tables by default, the API's JSON with `--json` for scripts.

use secrecy::{ExposeSecret, SecretString};
use serde_json::{json, Value};

use super::tables::{render_bulk, render_list, render_record, render_reload, render_switch, render_switches, text};

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Said with its causes (a refused connection, an untrusted certificate), which reqwest's
    /// own words leave out, each once, and what to do about an authority it does not know.
    #[error("cannot reach the admin API at {url}: {}{}", crate::observe::logs::in_one_line(cause), remedy(cause))]
    Unreachable { url: String, cause: reqwest::Error },
    /// The API answered with a problem; its title and detail say what to do.
    #[error("{status} {title}: {detail}")]
    Refused { status: u16, title: String, detail: String },
    #[error("{0}")]
    Usage(String),
}

/// What to do when the admin listener's certificate is not trusted: name its authority.
fn remedy(cause: &reqwest::Error) -> &'static str {
    let said = crate::observe::logs::in_one_line(cause);
    if said.contains("UnknownIssuer") || said.contains("certificate") {
        "; an admin listener whose certificate a private authority issued needs --ca-file naming that authority's PEM"
    } else if said.contains("Connection refused") {
        "; is the node running, and is --admin (or IDEM_ADMIN_URL) its admin_listen?"
    } else {
        ""
    }
}

/// How to reach the admin API, and who is acting.
pub struct Client {
    pub base: String,
    /// The admin bearer token: kept out of any debug print.
    pub token: Option<SecretString>,
    pub actor: String,
    http: reqwest::Client,
}

pub enum Command {
    List {
        state: Option<String>,
        route: Option<String>,
        tenant: Option<String>,
        limit: u32,
        cursor: Option<String>,
    },
    Show {
        id: String,
    },
    Resolve {
        id: String,
        outcome: Finding,
        note: Option<String>,
    },
    Retry {
        id: String,
        note: Option<String>,
    },
    Cancel {
        id: String,
        note: Option<String>,
    },
    Bulk(Bulk),
    Switch(SwitchCommand),
    /// The node reads its configuration file again (`POST /admin/config/reload`): applied, or
    /// refused (an error, so that `systemctl reload` fails with the reason).
    Reload,
}

/// `idem switch …`: the emergency switches.
pub enum SwitchCommand {
    /// A switch on (replacing an active one of the same scope and action).
    Set {
        scope: String,
        action: String,
        reason: String,
        expires_in: Option<String>,
    },
    /// By id, or the active switch of a scope and action.
    Clear {
        target: SwitchTarget,
        reason: String,
    },
    List {
        history: bool,
        limit: Option<u32>,
    },
}

pub enum SwitchTarget {
    Id(String),
    Active { scope: String, action: String },
}

/// `idem requests bulk`: the filter, the action as the API names it, and whether to only plan.
pub struct Bulk {
    pub state: String,
    pub route: Option<String>,
    pub tenant: Option<String>,
    pub created_after: Option<String>,
    pub created_before: Option<String>,
    pub action: String,
    pub dry_run: bool,
    pub limit: Option<u32>,
    pub note: Option<String>,
}

pub enum Finding {
    /// It executed; this is the response duplicates will get.
    Executed {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    NotExecuted,
}

impl Client {
    /// A client of the admin API at `base`; an https one trusts `ca_file` (PEM) besides the
    /// built-in roots, for an admin listener whose certificate a private authority issued.
    pub fn new(
        base: &str,
        token: Option<String>,
        actor: String,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Client, CliError> {
        let mut http = reqwest::Client::builder().no_proxy();
        if let Some(path) = ca_file {
            let pem = std::fs::read(path)
                .map_err(|e| CliError::Usage(format!("cannot read --ca-file {}: {e}", path.display())))?;
            let roots = reqwest::Certificate::from_pem_bundle(&pem)
                .ok()
                .filter(|roots| !roots.is_empty())
                .ok_or_else(|| CliError::Usage(format!("--ca-file {} holds no PEM certificate", path.display())))?;
            for root in roots {
                http = http.add_root_certificate(root);
            }
        }
        let http = http.build().map_err(|e| CliError::Usage(format!("cannot build the HTTP client: {e}")))?;
        Ok(Client { base: base.trim_end_matches('/').to_string(), token: token.map(SecretString::from), actor, http })
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Value, CliError> {
        let url = format!("{}{}", self.base, path);
        let mut request = self.http.request(method, &url);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token.expose_secret());
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|cause| CliError::Unreachable { url: url.clone(), cause })?;
        let status = response.status().as_u16();
        let bytes = response.bytes().await.map_err(|cause| CliError::Unreachable { url, cause })?;
        let value: Value =
            serde_json::from_slice(&bytes).unwrap_or_else(|_| json!({"detail": String::from_utf8_lossy(&bytes)}));
        if status >= 400 {
            return Err(CliError::Refused {
                status,
                title: value["title"].as_str().unwrap_or("error").to_string(),
                detail: value["detail"].as_str().unwrap_or("").to_string(),
            });
        }
        Ok(value)
    }

    /// Runs a command; returns what to print.
    pub async fn run(&self, command: Command, as_json: bool) -> Result<String, CliError> {
        let attribution = |note: Option<String>| json!({"actor": self.actor, "note": note});
        let (value, render): (Value, fn(&Value) -> String) = match command {
            Command::Switch(command) => self.switch(command).await?,
            Command::Reload => {
                (self.call(reqwest::Method::POST, "/admin/config/reload", Some(json!({}))).await?, render_reload)
            }
            Command::List { state, route, tenant, limit, cursor } => {
                let mut query = vec![format!("limit={limit}")];
                for (name, value) in [("state", state), ("route", route), ("tenant", tenant), ("cursor", cursor)] {
                    if let Some(v) = value {
                        query.push(format!(
                            "{name}={}",
                            percent_encoding::utf8_percent_encode(&v, percent_encoding::NON_ALPHANUMERIC)
                        ));
                    }
                }
                let path = format!("/admin/requests?{}", query.join("&"));
                (self.call(reqwest::Method::GET, &path, None).await?, render_list)
            }
            Command::Show { id } => {
                (self.call(reqwest::Method::GET, &format!("/admin/requests/{id}"), None).await?, render_record)
            }
            Command::Resolve { id, outcome, note } => {
                let mut body = attribution(note);
                match outcome {
                    Finding::Executed { status, headers, body: text } => {
                        let mut map = serde_json::Map::new();
                        for (name, value) in headers {
                            map.insert(name, json!(value));
                        }
                        body["outcome"] = json!("executed");
                        body["response"] = json!({"status": status, "headers": map, "body": text});
                    }
                    Finding::NotExecuted => body["outcome"] = json!("not_executed"),
                }
                let path = format!("/admin/requests/{id}/resolve");
                (self.call(reqwest::Method::POST, &path, Some(body)).await?, render_record)
            }
            Command::Retry { id, note } => {
                let path = format!("/admin/requests/{id}/retry");
                (self.call(reqwest::Method::POST, &path, Some(attribution(note))).await?, render_record)
            }
            Command::Cancel { id, note } => {
                let path = format!("/admin/requests/{id}/cancel");
                (self.call(reqwest::Method::POST, &path, Some(attribution(note))).await?, render_record)
            }
            Command::Bulk(b) => {
                let mut body = attribution(b.note);
                body["filter"] = json!({
                    "state": b.state, "route": b.route, "tenant": b.tenant,
                    "created_after": b.created_after, "created_before": b.created_before,
                });
                body["action"] = json!(b.action);
                body["dry_run"] = json!(b.dry_run);
                if let Some(limit) = b.limit {
                    body["limit"] = json!(limit);
                }
                (self.call(reqwest::Method::POST, "/admin/requests/bulk", Some(body)).await?, render_bulk)
            }
        };
        Ok(if as_json { format!("{value:#}\n") } else { render(&value) })
    }

    async fn switch(&self, command: SwitchCommand) -> Result<(Value, fn(&Value) -> String), CliError> {
        Ok(match command {
            SwitchCommand::Set { scope, action, reason, expires_in } => {
                let body = json!({"scope": scope, "action": action, "reason": reason,
                                  "expires_in": expires_in, "actor": self.actor});
                (self.call(reqwest::Method::POST, "/admin/switches", Some(body)).await?, render_switch)
            }
            SwitchCommand::Clear { target, reason } => {
                let ids = match target {
                    SwitchTarget::Id(id) => vec![id],
                    SwitchTarget::Active { scope, action } => {
                        let active = self.call(reqwest::Method::GET, "/admin/switches", None).await?;
                        let ids: Vec<String> = active["items"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter(|s| s["scope"] == json!(scope) && s["action"] == json!(action))
                            .map(|s| text(&s["id"]))
                            .collect();
                        if ids.is_empty() {
                            return Err(CliError::Usage(format!("no {action} switch is active for scope {scope}")));
                        }
                        ids
                    }
                };
                let mut cleared = Vec::new();
                for id in ids {
                    let path = format!("/admin/switches/{id}/clear");
                    let body = json!({"reason": reason, "actor": self.actor});
                    cleared.push(self.call(reqwest::Method::POST, &path, Some(body)).await?);
                }
                (json!({"items": cleared}), render_switches)
            }
            SwitchCommand::List { history, limit } => {
                let mut path = format!("/admin/switches?history={history}");
                if let Some(limit) = limit {
                    path.push_str(&format!("&limit={limit}"));
                }
                (self.call(reqwest::Method::GET, &path, None).await?, render_switches)
            }
        })
    }
}

/// Parses `name: value` header arguments.
pub fn parse_header(arg: &str) -> Result<(String, String), CliError> {
    let (name, value) =
        arg.split_once(':').ok_or_else(|| CliError::Usage(format!("`{arg}` is not a header: use `name: value`")))?;
    Ok((name.trim().to_ascii_lowercase(), value.trim().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_given_as_name_colon_value() {
        assert_eq!(
            parse_header("Content-Type: application/json").unwrap(),
            ("content-type".into(), "application/json".into())
        );
        assert!(parse_header("no colon").is_err());
    }

    #[test]
    fn a_listing_is_a_table_with_a_continuation_hint() {
        let v = json!({
            "items": [{"id": "0190-a", "state": "unknown", "route": "payments", "tenant": "default",
                       "key": "a-very-long-key-that-will-not-fit-the-column", "attempts": [{}],
                       "stop_reason": "unsafe_replay", "created_at": "2026-11-30T05:00:00.000Z"}],
            "next_cursor": "123.abc"
        });
        let out = render_list(&v);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("ID") && lines[0].contains("STATE") && lines[0].contains("STOP"));
        assert!(lines[1].contains("unknown") && lines[1].contains("unsafe_replay") && lines[1].contains('…'));
        assert!(out.contains("--cursor 123.abc"));
    }
}
