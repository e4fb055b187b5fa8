use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use idem::config::Config;
use idem::observe::telemetry::Telemetry;
use idem::simulate::history;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

mod args;
mod manual;

use args::{requests_command, switch_command, Cli, Command, LogFormat};

/// Every request allocates its head, its record and its answer several times over; with
/// mimalloc's thread-local free lists a new key costs 20–45 µs less CPU at c=8 than with glibc's
/// malloc (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Logs at `level` unless `RUST_LOG` says otherwise. Lines are written to stderr in batches by
/// a thread of their own (`idem::observe::logs`), so a request never waits on the terminal or the
/// journal, nor wakes anyone per line; none is dropped. Keep the guard until exit: dropping it
/// writes out what is buffered. `spans`, when traces are exported, sees the same spans the
/// logs do.
fn init_logging(
    format: LogFormat,
    level: &str,
    spans: Option<Box<dyn Layer<Registry> + Send + Sync>>,
) -> anyhow::Result<idem::observe::logs::Flushed> {
    // PostgreSQL's notices (`relation "_sqlx_migrations" already exists, skipping`) are the
    // driver's business unless they warn.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{level},sqlx::postgres::notice=warn")));
    let (writer, flushed) = idem::observe::logs::batched(std::io::stderr()).context("cannot start the log writer")?;
    // Colours for a person at a terminal; a file, a pipe or the journal gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // The access log's lines, but for a terminal's coloured ones, are formatted by hand, as
    // tracing would, at a tenth of a replay's CPU less.
    let access = match format {
        LogFormat::Text if ansi => None,
        LogFormat::Text => Some(idem::observe::access_line::Shape::Text),
        LogFormat::Json => Some(idem::observe::access_line::Shape::Json),
    };
    if let Some(shape) = access {
        idem::observe::access_line::install(writer.clone(), shape);
    }
    let lines = tracing_subscriber::fmt::layer().with_writer(writer).with_ansi(ansi);
    let lines = match format {
        LogFormat::Text => lines.boxed(),
        LogFormat::Json => lines.json().boxed(),
    };
    tracing_subscriber::registry().with(spans).with(lines).with(filter).init();
    Ok(flushed)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.command {
        Command::Demo { verbose: false, .. } => "warn",
        _ => "info",
    };
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("idem: {e}");
        ExitCode::FAILURE
    };
    // `idem serve` reads its configuration before anything is logged: its `[telemetry]` says
    // where the spans go.
    let serving = match &cli.command {
        Command::Serve { config } => match Config::load(config) {
            Ok(loaded) => Some(loaded),
            Err(e) => return fail(&idem::observe::logs::in_one_line(&e)),
        },
        _ => None,
    };
    // Built by hand rather than by `#[tokio::main]`, so that the runtime stops (and what its
    // tasks log while they stop is buffered) before the log writer writes its last lines, and
    // the final error comes after them.
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    let telemetry = match serving.as_ref().map(|c| Telemetry::start(&c.telemetry, runtime.handle().clone())) {
        Some(Ok(telemetry)) => telemetry,
        Some(Err(e)) => return fail(&e),
        None => None,
    };
    let flushed = match init_logging(cli.log_format, level, telemetry.as_ref().map(Telemetry::layer)) {
        Ok(flushed) => flushed,
        Err(e) => return fail(&idem::observe::logs::in_one_line(e.as_ref())),
    };
    let ran = runtime.block_on(run(cli.command, serving));
    // The last spans go out while the runtime that sends them still runs.
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    drop(runtime);
    drop(flushed);
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&idem::observe::logs::in_one_line(e.as_ref())),
    }
}

/// Runs `command`; `serving` is the configuration `idem serve` read.
async fn run(command: Command, serving: Option<Config>) -> anyhow::Result<()> {
    match command {
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "idem",
                &mut std::io::stdout(),
            );
        }
        Command::Man { dir: None } => manual::page(&mut std::io::stdout()).context("cannot write the manual page")?,
        Command::Man { dir: Some(dir) } => {
            manual::pages(&dir).with_context(|| format!("cannot write the manual pages into {}", dir.display()))?;
            println!("manual pages written into {}", dir.display());
        }
        Command::Serve { config } => {
            let loaded = serving.context("the configuration is read before the runtime starts")?;
            idem::server::serve(loaded, config, idem::server::termination()).await?;
        }
        Command::Demo { listen, admin_listen, .. } => idem::server::demo::run(listen, admin_listen).await?,
        Command::Migrate { config, status: true } => {
            let (config, _unset) = Config::load_offline(&config)?;
            let status = idem::store::status(&config.store.url)
                .await
                .with_context(|| format!("reading the status of {}", config.store.url))?;
            println!("store            {}\n{status}", config.store.url);
        }
        Command::Migrate { config, status: false } => {
            let (config, _unset) = Config::load_offline(&config)?;
            idem::store::migrate(&config.store.url, config.longest_reach())
                .await
                .with_context(|| format!("migrating {}", config.store.url))?;
            println!("migrations applied to {}", config.store.url);
        }
        Command::Check { config, connect } => {
            let (config, unset) = Config::load_offline(&config)?;
            print!("{}", idem::config::describe(&config));
            // What `idem serve` would refuse on this host, though the file is right: said here,
            // so that a unit's `ExecStartPre=idem check` stops the start rather than a loop.
            let mut refusals: Vec<String> = unset
                .iter()
                .map(|var| format!("the environment variable {var} is not set (or empty): `idem serve` refuses this config until it is"))
                .collect();
            refusals.extend(idem::store::missing_directory(&config.store.url));
            if !refusals.is_empty() {
                anyhow::bail!("{}", refusals.join("; "));
            }
            if connect {
                let found = idem::store::inspect(&config.store.url)
                    .await
                    .with_context(|| format!("connecting to the store {}", config.store.url))?;
                println!("\nstore            {}", config.store.url);
                if let Some(serving) = &found.serving {
                    let timeline = serving.timeline.as_deref().unwrap_or("none: a standby");
                    let started = serving.started.as_deref().unwrap_or("-");
                    println!("serving host     {} (timeline {timeline}, started {started})", serving.host);
                }
                if let Some(replication) = &found.replication {
                    println!("replication      {replication}");
                }
                print!("{}", found.status);
                for warning in found.warnings {
                    eprintln!("warning: {warning}");
                }
                // Each route's upstream, reached as an attempt would reach it: its address
                // resolved and a connection opened (TLS is the attempt's business).
                let mut unreached = Vec::new();
                for route in &config.routes {
                    let reached = reach(&route.upstream).await;
                    match &reached {
                        Ok(addr) => println!("upstream         {} {} ok ({addr})", route.name, route.upstream),
                        Err(why) => println!("upstream         {} {} failed: {why}", route.name, route.upstream),
                    }
                    if let Err(why) = reached {
                        unreached.push(format!("{} ({}): {why}", route.name, route.upstream));
                    }
                }
                if !unreached.is_empty() {
                    anyhow::bail!("cannot reach the upstream of {}", unreached.join("; "));
                }
            }
        }
        Command::Simulate { config, route, outcomes, history, since, candidate, unobserved, limit, draw, json } => {
            let (config, _unset) = Config::load_offline(&config)?;
            match (outcomes, history, since, candidate) {
                (Some(outcomes), false, _, _) => {
                    print!("{}", idem::simulate::command(&config, &route, &outcomes, draw.as_ref(), json)?);
                }
                (None, true, Some(since), Some(candidate)) => {
                    let since = history::Since::parse(&since, idem::domain::Timestamp::now())
                        .map_err(|problem| anyhow::anyhow!("--since {problem}"))?;
                    let draws = draw.unwrap_or_else(|| "0.5".parse().expect("0.5 is a draw"));
                    let request = history::Request {
                        config: &config,
                        route: &route,
                        since: &since,
                        candidate: &candidate,
                        draws: &draws,
                        assume: unobserved,
                        limit,
                        as_json: json,
                    };
                    print!("{}", history::command(request).await?);
                }
                // clap requires --outcomes, or --history with --since and --candidate.
                _ => anyhow::bail!("give --outcomes, or --history with --since and --candidate"),
            }
        }
        Command::Requests { client, action } => {
            let json = client.json;
            print!("{}", client.connect()?.run(requests_command(action)?, json).await?);
        }
        Command::Switch { client, action } => {
            let json = client.json;
            print!("{}", client.connect()?.run(switch_command(action), json).await?);
        }
        Command::Health { config, ready } => {
            let (config, _unset) = Config::load_offline(&config)?;
            let said = idem::admin::health::ask(&config, ready).await?;
            println!("{said}");
        }
        Command::Reload { client } => {
            let json = client.json;
            print!("{}", client.connect()?.run(idem::admin::cli::Command::Reload, json).await?);
        }
    }
    Ok(())
}

/// Opens a connection to the host and port of `upstream` (a URL), within a few seconds: the
/// address it reached, or why not.
async fn reach(upstream: &str) -> Result<std::net::SocketAddr, String> {
    let url = url::Url::parse(upstream).map_err(|e| e.to_string())?;
    let host = url.host_str().ok_or("no host")?.trim_start_matches('[').trim_end_matches(']').to_string();
    let port = url.port_or_known_default().ok_or("no port")?;
    let connect = tokio::net::TcpStream::connect((host.as_str(), port));
    match tokio::time::timeout(std::time::Duration::from_secs(3), connect).await {
        Ok(Ok(stream)) => stream.peer_addr().map_err(|e| e.to_string()),
        Ok(Err(e)) => Err(format!("{host}:{port}: {e}")),
        Err(_) => Err(format!("{host}:{port}: no answer within 3s")),
    }
}
