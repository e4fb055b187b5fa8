//! An operator's emergency switch (docs/operations.md): what a team flips, without a release, when retries
//! make an incident worse. A switch has a scope (one route, or all of them), an action, a reason,
//! an optional expiry, and who set it and when; clearing it keeps who cleared it, when and why.
//! This module is the switch as a value, parsed from what an operator sends and checked there;
//! the store keeps them, and [`crate::runtime::switches`] holds the active ones in memory for the hot path.

use std::time::Duration;

use serde_json::{json, Value};
use uuid::Uuid;

use crate::domain::{RouteName, Timestamp};

/// What a switch applies to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every route, those configured later included.
    All,
    /// One route, by name.
    Route(RouteName),
}

impl Scope {
    /// The word for every route, in the API, the CLI and the store.
    pub const ALL: &'static str = "all";

    pub fn as_str(&self) -> &str {
        match self {
            Scope::All => Scope::ALL,
            Scope::Route(name) => name,
        }
    }

    /// `all`, or a route's name (not checked against the config here).
    pub fn of(text: &str) -> Scope {
        if text == Scope::ALL {
            Scope::All
        } else {
            Scope::Route(RouteName::from(text))
        }
    }

    pub fn covers(&self, route: &RouteName) -> bool {
        match self {
            Scope::All => true,
            Scope::Route(name) => name == route,
        }
    }
}

/// What a switch does while it is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SwitchAction {
    /// First attempts only: no retry starts; an execution that would retry stops with
    /// `retries_off`.
    RetriesOff,
    /// The route's upstream circuit is forced open: new keys get 503 `circuit-open`, executions
    /// send no further attempt, replays of done records are still served.
    Isolate,
    /// A route's canary ends and all its traffic uses the main policy.
    CanaryOff,
}

impl SwitchAction {
    pub const ALL: [SwitchAction; 3] = [SwitchAction::RetriesOff, SwitchAction::Isolate, SwitchAction::CanaryOff];

    pub fn as_str(self) -> &'static str {
        match self {
            SwitchAction::RetriesOff => "retries_off",
            SwitchAction::Isolate => "isolate",
            SwitchAction::CanaryOff => "canary_off",
        }
    }

    pub fn parse(text: &str) -> Option<SwitchAction> {
        SwitchAction::ALL.into_iter().find(|a| a.as_str() == text)
    }
}

/// Who ended a switch, when and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clearing {
    pub at: Timestamp,
    pub actor: String,
    pub reason: String,
    /// Set when the switch was not cleared by hand but replaced by a new one of the same scope
    /// and action.
    pub replaced_by: Option<Uuid>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Switch {
    pub id: Uuid,
    pub scope: Scope,
    pub action: SwitchAction,
    /// Why it was set: required, so that whoever finds it on knows what to check before clearing.
    pub reason: String,
    pub actor: String,
    pub set_at: Timestamp,
    /// After this it is off by itself, and stays in the history as `expired`.
    pub expires_at: Option<Timestamp>,
    pub cleared: Option<Clearing>,
}

/// Where a switch stands at a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Active,
    Expired,
    Cleared,
    Replaced,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Active => "active",
            Status::Expired => "expired",
            Status::Cleared => "cleared",
            Status::Replaced => "replaced",
        }
    }
}

impl Switch {
    pub fn status(&self, now: Timestamp) -> Status {
        match &self.cleared {
            Some(c) if c.replaced_by.is_some() => Status::Replaced,
            Some(_) => Status::Cleared,
            None if self.expires_at.is_some_and(|at| at <= now) => Status::Expired,
            None => Status::Active,
        }
    }

    pub fn is_active(&self, now: Timestamp) -> bool {
        self.status(now) == Status::Active
    }

    /// Whether it is on for `route`, doing `action`, at `now`.
    pub fn holds(&self, route: &RouteName, action: SwitchAction, now: Timestamp) -> bool {
        self.action == action && self.scope.covers(route) && self.is_active(now)
    }

    pub fn to_json(&self, now: Timestamp) -> Value {
        let cleared = self.cleared.as_ref().map(|c| {
            json!({
                "at": c.at.rfc3339(),
                "actor": c.actor,
                "reason": c.reason,
                "replaced_by": c.replaced_by,
            })
        });
        json!({
            "id": self.id,
            "scope": self.scope.as_str(),
            "action": self.action.as_str(),
            "reason": self.reason,
            "actor": self.actor,
            "set_at": self.set_at.rfc3339(),
            "expires_at": self.expires_at.map(Timestamp::rfc3339),
            "status": self.status(now).as_str(),
            "active": self.is_active(now),
            "cleared": cleared,
        })
    }
}

/// Who acts when a request does not say: the admin API has one identity, its token's holder.
pub const DEFAULT_ACTOR: &str = "admin";
/// The longest reason and actor kept: enough for a sentence and a link, not a document.
const MAX_REASON: usize = 1000;
const MAX_ACTOR: usize = 200;
/// The longest expiry accepted: a switch meant for longer is a config change.
pub const MAX_EXPIRY: Duration = Duration::from_secs(90 * 24 * 3600);

/// Why a switch request was refused, naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {detail}")]
pub struct Invalid {
    pub field: &'static str,
    pub detail: String,
}

fn invalid(field: &'static str, detail: impl Into<String>) -> Invalid {
    Invalid { field, detail: detail.into() }
}

/// The fields of a request to set a switch, as sent.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetRequest {
    pub scope: Option<String>,
    pub action: Option<String>,
    pub reason: Option<String>,
    /// A duration like `30m` or `2h 30m`.
    pub expires_in: Option<String>,
    pub actor: Option<String>,
}

impl SetRequest {
    /// The switch this asks for, set at `now` with id `id`; `is_route` says which route names
    /// exist.
    pub fn parse(self, id: Uuid, now: Timestamp, is_route: impl Fn(&str) -> bool) -> Result<Switch, Invalid> {
        let scope = match self.scope.as_deref().map(str::trim) {
            None | Some("") => return Err(invalid("scope", "is required: a route's name, or \"all\"")),
            Some(Scope::ALL) => Scope::All,
            Some(name) if is_route(name) => Scope::Route(RouteName::from(name)),
            Some(name) => return Err(invalid("scope", format!("`{name}` is not a configured route (or \"all\")"))),
        };
        let action = match self.action.as_deref().map(str::trim) {
            None | Some("") => return Err(invalid("action", "is required: retries_off, isolate or canary_off")),
            Some(a) => SwitchAction::parse(a).ok_or_else(|| {
                invalid("action", format!("`{a}` is not an action: use retries_off, isolate or canary_off"))
            })?,
        };
        let reason = reason(self.reason)?;
        let expires_at = match self.expires_in.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
            None => None,
            Some(text) => Some(now + expiry(text)?),
        };
        Ok(Switch { id, scope, action, reason, actor: actor(self.actor)?, set_at: now, expires_at, cleared: None })
    }
}

/// The fields of a request to clear a switch, as sent.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClearRequest {
    pub reason: Option<String>,
    pub actor: Option<String>,
}

impl ClearRequest {
    pub fn parse(self, now: Timestamp) -> Result<Clearing, Invalid> {
        Ok(Clearing { at: now, actor: actor(self.actor)?, reason: reason(self.reason)?, replaced_by: None })
    }
}

fn reason(text: Option<String>) -> Result<String, Invalid> {
    let text = text.map(|t| t.trim().to_string()).unwrap_or_default();
    if text.is_empty() {
        return Err(invalid("reason", "is required: say why, for whoever finds the switch later"));
    }
    if text.chars().count() > MAX_REASON {
        return Err(invalid("reason", format!("is longer than {MAX_REASON} characters")));
    }
    Ok(text)
}

fn actor(text: Option<String>) -> Result<String, Invalid> {
    let text = text.map(|t| t.trim().to_string()).filter(|t| !t.is_empty());
    let text = text.unwrap_or_else(|| DEFAULT_ACTOR.to_string());
    if text.chars().count() > MAX_ACTOR || text.chars().any(char::is_control) {
        return Err(invalid("actor", format!("must be a name of at most {MAX_ACTOR} printable characters")));
    }
    Ok(text)
}

/// A humane duration (`30m`, `1h 30m`), more than zero and at most [`MAX_EXPIRY`].
pub fn expiry(text: &str) -> Result<Duration, Invalid> {
    let d = humantime::parse_duration(text)
        .map_err(|e| invalid("expires_in", format!("`{text}` is not a duration like 30m or 2h ({e})")))?;
    if d.is_zero() {
        return Err(invalid("expires_in", "must be longer than zero (leave it out for no expiry)"));
    }
    if d > MAX_EXPIRY {
        return Err(invalid("expires_in", "must be at most 90 days: a switch meant for longer belongs in the config"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Timestamp = Timestamp::from_millis(1_700_000_000_000);

    fn request(scope: &str, action: &str, reason: &str, expires_in: Option<&str>) -> SetRequest {
        SetRequest {
            scope: Some(scope.into()),
            action: Some(action.into()),
            reason: Some(reason.into()),
            expires_in: expires_in.map(Into::into),
            actor: None,
        }
    }

    fn parse(r: SetRequest) -> Result<Switch, Invalid> {
        r.parse(Uuid::nil(), NOW, |name| name == "payments")
    }

    #[test]
    fn a_valid_request_becomes_a_switch_with_an_absolute_expiry() {
        let s = parse(request("payments", "retries_off", " storm on the PSP ", Some("30m"))).unwrap();
        assert_eq!(s.scope, Scope::Route("payments".into()));
        assert_eq!(s.action, SwitchAction::RetriesOff);
        assert_eq!(s.reason, "storm on the PSP");
        assert_eq!(s.actor, DEFAULT_ACTOR);
        assert_eq!(s.expires_at, Some(NOW + Duration::from_secs(30 * 60)));
        let all = parse(request("all", "isolate", "x", None)).unwrap();
        assert_eq!((all.scope, all.expires_at), (Scope::All, None));
    }

    #[test]
    fn each_bad_field_is_named() {
        let field = |r| parse(r).unwrap_err().field;
        assert_eq!(field(request("orders", "retries_off", "x", None)), "scope");
        assert_eq!(field(request("", "retries_off", "x", None)), "scope");
        assert_eq!(field(request("payments", "retries_of", "x", None)), "action");
        assert_eq!(field(request("payments", "isolate", "  ", None)), "reason");
        assert_eq!(field(request("payments", "isolate", "x", Some("soon"))), "expires_in");
        assert_eq!(field(request("payments", "isolate", "x", Some("0s"))), "expires_in");
        assert_eq!(field(request("payments", "isolate", "x", Some("1000d"))), "expires_in");
        let mut r = request("payments", "isolate", "x", None);
        r.actor = Some("a\nb".into());
        assert_eq!(field(r), "actor");
        assert_eq!(ClearRequest::default().parse(NOW).unwrap_err().field, "reason");
    }

    #[test]
    fn a_switch_holds_for_its_scope_and_action_until_it_expires_or_is_cleared() {
        let mut s = parse(request("payments", "retries_off", "x", Some("1s"))).unwrap();
        assert!(s.holds(&"payments".into(), SwitchAction::RetriesOff, NOW));
        assert!(!s.holds(&"orders".into(), SwitchAction::RetriesOff, NOW));
        assert!(!s.holds(&"payments".into(), SwitchAction::Isolate, NOW));
        assert!(!s.holds(&"payments".into(), SwitchAction::RetriesOff, NOW + Duration::from_millis(1000)));
        assert_eq!(s.status(NOW + Duration::from_millis(1000)), Status::Expired);
        s.expires_at = None;
        s.cleared = Some(Clearing { at: NOW, actor: "bob".into(), reason: "over".into(), replaced_by: None });
        assert_eq!(s.status(NOW), Status::Cleared);
        s.cleared.as_mut().unwrap().replaced_by = Some(Uuid::nil());
        assert_eq!(s.status(NOW), Status::Replaced);
        let all = parse(request("all", "isolate", "x", None)).unwrap();
        assert!(all.holds(&"anything".into(), SwitchAction::Isolate, NOW));
    }
}
