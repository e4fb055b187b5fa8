//! The command line as clap reads it: the commands, their flags and help, and how the operator
//! commands become the admin client's.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::builder::PossibleValuesParser;
use clap::{Parser, Subcommand, ValueEnum};
use idem::admin::bulk::BulkAction;
use idem::admin::cli;

/// What idem(1)'s NAME says, and `idem --help` first.
const ABOUT: &str = "An idempotency-aware request broker";
/// What idem(1)'s DESCRIPTION says, and `idem --help` after it.
const LONG_ABOUT: &str = "Idem sits in front of HTTP APIs with side effects. Every request carrying an \
Idempotency-Key is recorded durably before it is sent upstream, executed once under a deadline with \
classified retries, and replayed byte for byte to duplicates; a request whose outcome cannot be known \
goes to a reconciliation queue.";

#[derive(Parser)]
#[command(
    name = "idem",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("IDEM_COMMIT"), ")"),
    about = ABOUT,
    long_about = LONG_ABOUT
)]
pub(super) struct Cli {
    #[command(subcommand)]
    pub(super) command: Command,
    /// Log format on stderr.
    #[arg(long, env = "IDEM_LOG_FORMAT", global = true, value_enum, default_value_t = LogFormat::Text)]
    pub(super) log_format: LogFormat,
}

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
pub(super) enum Command {
    /// Run the broker.
    Serve {
        /// The configuration file (TOML); keys of its tables may be overridden from the
        /// environment (`IDEM_STORE__URL`).
        #[arg(long, short, env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Run the broker on a fresh SQLite file in front of a built-in flaky upstream.
    Demo {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        #[arg(long, default_value = "127.0.0.1:8081")]
        admin_listen: SocketAddr,
        /// Log every request (at info); by default the demo logs only warnings, so that its
        /// story comes first on screen.
        #[arg(long)]
        verbose: bool,
    },
    /// Apply the store's schema migrations.
    Migrate {
        /// The configuration file: its store is migrated.
        #[arg(long, short, env = "IDEM_CONFIG")]
        config: PathBuf,
        /// Apply nothing: show the store's protocol and migrations against this build's, and
        /// whether upgrading to this build rolls node by node or needs every node stopped.
        #[arg(long)]
        status: bool,
    },
    /// Validate a config and print the effective routes and policies.
    ///
    /// Fails, naming each, on what `idem serve` would refuse on this host: an unset secret, a
    /// SQLite directory that does not exist. With --connect, connects to its store too, changing
    /// nothing: the host serving it, its protocol and migrations, and a warning when a failover
    /// of its PostgreSQL server may lose acknowledged commits.
    Check {
        /// The configuration file to check, as `idem serve` would read it (with the
        /// environment's overrides).
        #[arg(long, short, env = "IDEM_CONFIG")]
        config: PathBuf,
        /// Connect to the store and say what serves it.
        #[arg(long)]
        connect: bool,
    },
    /// Run a route's retry policy against a scripted upstream, or replay its history.
    ///
    /// On a logical clock: no network, no sleeping. One row per step, then the stop reason and
    /// the state the record would end in. With --history, replay the route's recorded requests
    /// through its current policy and a candidate one instead, and compare them.
    Simulate {
        /// The config file: the route's policy is read from it, and with --history its store.
        #[arg(long, short, env = "IDEM_CONFIG")]
        config: PathBuf,
        /// The route whose policy (`[routes.retry]`, `replay_safe`) is simulated.
        #[arg(long)]
        route: String,
        /// What the upstream does on each attempt, in order.
        // Hyphen values are let through so that a negative duration is refused for what it is.
        #[arg(long, value_name = "SCRIPT", long_help = OUTCOMES_HELP, allow_hyphen_values = true,
              required_unless_present = "history")]
        outcomes: Option<idem::simulate::Script>,
        /// Replay the route's recorded requests (read-only, from the config's store) through the
        /// current policy and the --candidate one, side by side.
        #[arg(long, conflicts_with = "outcomes", requires_all = ["since", "candidate"])]
        history: bool,
        /// With --history: requests that arrived since then, a duration back from now (24h) or an
        /// RFC 3339 time.
        #[arg(long, requires = "history", allow_hyphen_values = true)]
        since: Option<String>,
        /// With --history: the candidate policy, a whole config (the route of the same name) or a
        /// `[retry]` table (with an optional `replay_safe`) whose keys replace the route's.
        #[arg(long, requires = "history", value_name = "FILE")]
        candidate: Option<PathBuf>,
        /// With --history: what an attempt the history does not show meets. `last`: the outcome of
        /// the latest recorded attempt that started no later than it; `success`: a 200.
        #[arg(long, requires = "history", default_value = "last", value_name = "last|success")]
        unobserved: idem::simulate::history::Assume,
        /// With --history: at most this many requests, the oldest.
        #[arg(long, requires = "history", default_value_t = idem::store::recorded::MAX_RECORDED)]
        limit: u32,
        /// Fix every jitter draw to F (0 to 1); several, comma-separated, are used in order, the
        /// last repeating. Without it draws are random, and printed so the run can be reproduced;
        /// with --history they default to 0.5, so that runs compare.
        #[arg(long, value_name = "F[,F…]", allow_hyphen_values = true)]
        draw: Option<idem::simulate::Draws>,
        /// Print one JSON document instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Operate on records through the admin API: the reconciliation queue and its actions.
    Requests {
        #[command(flatten)]
        client: AdminArgs,
        #[command(subcommand)]
        action: RequestsAction,
    },
    /// Emergency switches through the admin API: retries off, or a route isolated.
    ///
    /// Without a release; obeyed by every node within two seconds.
    Switch {
        #[command(flatten)]
        client: AdminArgs,
        #[command(subcommand)]
        action: SwitchAction,
    },
    /// Ask the node this config describes whether it is alive (or ready), on its admin listener.
    ///
    /// For a container's health check: it reads the admin address and scheme from the config
    /// (`server.admin_listen`, TLS when `admin_tls_cert` is set), asks `/healthz` (or `/readyz`
    /// with --ready) on this host, and exits 0 if the node answers 200, 1 otherwise.
    Health {
        /// The configuration file the node runs.
        #[arg(long, short, env = "IDEM_CONFIG")]
        config: PathBuf,
        /// Ask whether it is ready for requests (the store answers), not only alive.
        #[arg(long)]
        ready: bool,
    },
    /// Make a running node read its configuration file again, and wait for its answer.
    ///
    /// Exits non-zero, with the key and the reason, when the file is refused; the running
    /// configuration is then kept (`systemctl reload` runs it).
    Reload {
        #[command(flatten)]
        client: AdminArgs,
    },
    /// Print a completion script for a shell: `idem completions bash >
    /// /usr/local/share/bash-completion/completions/idem`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page, or write every command's page into a directory.
    ///
    /// `idem man > /usr/local/share/man/man1/idem.1` prints idem(1); `idem man --dir
    /// /usr/local/share/man/man1` writes it and the page of each command it refers to
    /// (idem-serve(1), idem-check(1), …).
    Man {
        /// Write idem.1 and idem-<command>.1 for every command into this directory.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
pub(super) enum SwitchAction {
    /// Turn a switch on (replacing an active one of the same scope and action).
    Set {
        /// A route's name, or `all`.
        #[arg(long)]
        scope: String,
        #[arg(long, value_parser = switch_actions())]
        action: String,
        /// Why: required, for whoever finds it on.
        #[arg(long)]
        reason: String,
        /// Off by itself after this long: 30m, 2h.
        #[arg(long)]
        expires_in: Option<String>,
    },
    /// Turn a switch off: by its id, or the active one of --scope and --action.
    Clear {
        #[arg(required_unless_present_all = ["scope", "action"], conflicts_with_all = ["scope", "action"])]
        id: Option<String>,
        #[arg(long, requires = "action")]
        scope: Option<String>,
        #[arg(long, requires = "scope", value_parser = switch_actions())]
        action: Option<String>,
        /// Why it can go off now.
        #[arg(long)]
        reason: String,
    },
    /// The switches on now; with --history every switch ever set, newest first.
    List {
        #[arg(long)]
        history: bool,
        #[arg(long)]
        limit: Option<u32>,
    },
}

#[derive(Subcommand)]
pub(super) enum RequestsAction {
    /// List records, oldest first (the reconciliation queue: `--state unknown`).
    List {
        /// Only records in this state.
        #[arg(long, value_parser = states())]
        state: Option<String>,
        /// Only the records of this route.
        #[arg(long)]
        route: Option<String>,
        /// Only the records of this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// At most this many records per page.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Continue a listing where the previous page ended.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show one record: its attempts, response and history.
    Show { id: String },
    /// Settle an unknown record: it executed (give the response to replay) or it did not.
    Resolve {
        id: String,
        /// It executed upstream; duplicates will get the response given here.
        #[arg(long, conflicts_with = "not_executed", requires = "status")]
        executed: bool,
        /// It did not execute: the key is freed and the next request with it executes.
        #[arg(long)]
        not_executed: bool,
        #[arg(long)]
        status: Option<u16>,
        /// A response header, `name: value` (repeatable).
        #[arg(long = "header")]
        headers: Vec<String>,
        #[arg(long, default_value = "")]
        body: String,
        #[arg(long)]
        note: Option<String>,
    },
    /// Send an unknown record again (you assert a re-send is safe).
    Retry {
        id: String,
        #[arg(long)]
        note: Option<String>,
    },
    /// Stop a record: no further attempt starts.
    Cancel {
        id: String,
        #[arg(long)]
        note: Option<String>,
    },
    /// Apply one action to every record a filter matches, each audited on its own.
    ///
    /// Try it with --dry-run first: that prints how many match and a sample, and changes
    /// nothing.
    Bulk {
        /// The records' state (`unknown`: the reconciliation queue).
        #[arg(long, value_parser = states())]
        state: String,
        /// Only the records of this route.
        #[arg(long)]
        route: Option<String>,
        /// Only the records of this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// Only records created after this RFC 3339 UTC time (2024-05-01T12:00:00Z).
        #[arg(long)]
        created_after: Option<String>,
        /// Only records created before this RFC 3339 UTC time.
        #[arg(long)]
        created_before: Option<String>,
        /// What to do to each record.
        #[arg(long, value_parser = bulk_actions())]
        action: String,
        /// Say how many match, with a sample, and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// At most this many records (the API's default is 1000).
        #[arg(long)]
        limit: Option<u32>,
        #[arg(long)]
        note: Option<String>,
    },
}

const OUTCOMES_HELP: &str = "What the upstream does on each attempt, in order: comma-separated items

  DURATION:RESULT[ retry-after=VALUE][ cancel]

DURATION  when the result comes, from the attempt's start: 400ms, 1.5s, 2s 300ms
          (whole milliseconds, not negative, with a unit). A result that comes after the
          attempt's limit is a timeout, and its Retry-After is never seen.
RESULT    an HTTP status 100-599;
          timeout         no answer within DURATION: it may have executed;
          connect-failed  the connection failed: nothing was sent;
          broken          the connection was cut after sending: it may have executed;
          cancel          the caller cancels during this attempt, whose answer is unknown
                          (read as broken). Add ` cancel` after another result to script
                          what the cancelled attempt itself returned: `700ms:200 cancel`.
VALUE     the upstream's Retry-After: delta-seconds as in HTTP (3) or a duration (300ms);
          only with a status.

Example: \"400ms:503 retry-after=300ms, 700ms:200, 100ms:200\"";

/// How the operator commands reach the admin API, and how they print its answers.
#[derive(clap::Args)]
pub(super) struct AdminArgs {
    /// The admin listener's URL.
    #[arg(long, env = "IDEM_ADMIN_URL", default_value = "http://127.0.0.1:8081", global = true)]
    pub(super) admin: String,
    /// The admin bearer token.
    #[arg(long, env = "IDEM_ADMIN_TOKEN", hide_env_values = true, global = true)]
    pub(super) token: Option<String>,
    /// Certificates (PEM) to trust for an https admin URL besides the built-in roots: the
    /// authority that issued `[server] admin_tls_cert`.
    #[arg(long, env = "IDEM_ADMIN_CA_FILE", global = true)]
    pub(super) ca_file: Option<PathBuf>,
    /// Who is acting, kept in the audit trail (a record's history, a switch's).
    #[arg(long, env = "USER", default_value = "operator", global = true)]
    pub(super) actor: String,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub(super) json: bool,
}

impl AdminArgs {
    pub(super) fn connect(self) -> Result<cli::Client, cli::CliError> {
        cli::Client::new(&self.admin, self.token, self.actor, self.ca_file.as_deref())
    }
}

/// The actions a switch takes, as `--action` values.
fn switch_actions() -> PossibleValuesParser {
    PossibleValuesParser::new(idem::domain::switch::SwitchAction::ALL.map(|a| a.as_str()))
}

/// The actions a bulk call takes, as `--action` values.
/// A record's states, as the admin API names them.
fn states() -> PossibleValuesParser {
    PossibleValuesParser::new(idem::domain::State::ALL.map(|s| s.as_str()))
}

fn bulk_actions() -> PossibleValuesParser {
    PossibleValuesParser::new(BulkAction::ALL.map(|a| a.flag()))
}

pub(super) fn switch_command(action: SwitchAction) -> cli::Command {
    let command = match action {
        SwitchAction::Set { scope, action, reason, expires_in } => {
            cli::SwitchCommand::Set { scope, action, reason, expires_in }
        }
        SwitchAction::Clear { id, scope, action, reason } => {
            let target = match (id, scope, action) {
                (Some(id), _, _) => cli::SwitchTarget::Id(id),
                // clap requires both when there is no id.
                (None, scope, action) => {
                    cli::SwitchTarget::Active { scope: scope.unwrap_or_default(), action: action.unwrap_or_default() }
                }
            };
            cli::SwitchCommand::Clear { target, reason }
        }
        SwitchAction::List { history, limit } => cli::SwitchCommand::List { history, limit },
    };
    cli::Command::Switch(command)
}

pub(super) fn requests_command(action: RequestsAction) -> Result<cli::Command, cli::CliError> {
    Ok(match action {
        RequestsAction::List { state, route, tenant, limit, cursor } => {
            cli::Command::List { state, route, tenant, limit, cursor }
        }
        RequestsAction::Show { id } => cli::Command::Show { id },
        RequestsAction::Resolve { id, executed, not_executed, status, headers, body, note } => {
            let outcome = match (executed, not_executed, status) {
                (true, false, Some(status)) => cli::Finding::Executed {
                    status,
                    headers: headers.iter().map(|h| cli::parse_header(h)).collect::<Result<_, _>>()?,
                    body,
                },
                (false, true, _) => cli::Finding::NotExecuted,
                _ => {
                    return Err(cli::CliError::Usage(
                        "say --executed --status N [--header …] [--body …], or --not-executed".into(),
                    ))
                }
            };
            cli::Command::Resolve { id, outcome, note }
        }
        RequestsAction::Retry { id, note } => cli::Command::Retry { id, note },
        RequestsAction::Cancel { id, note } => cli::Command::Cancel { id, note },
        RequestsAction::Bulk { state, route, tenant, created_after, created_before, action, dry_run, limit, note } => {
            cli::Command::Bulk(cli::Bulk {
                state,
                route,
                tenant,
                created_after,
                created_before,
                action: BulkAction::ALL.into_iter().find(|a| a.flag() == action).map_or(action, |a| a.as_str().into()),
                dry_run,
                limit,
                note,
            })
        }
    })
}
