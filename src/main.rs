use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use idem::config::Config;

/// Idem, an idempotency-aware request broker: every keyed request is recorded before it is sent,
/// executed once, and replayed byte for byte to duplicates.
#[derive(Parser)]
#[command(name = "idem", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the broker.
    Serve {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Run the broker on a fresh SQLite file in front of a built-in flaky upstream.
    Demo {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        #[arg(long, default_value = "127.0.0.1:8081")]
        admin_listen: SocketAddr,
    },
    /// Apply the store's schema migrations.
    Migrate {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a config and print the effective routes and policies.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match run(cli.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve { config } => {
            let config = Config::load(&config)?;
            idem::server::serve(config, idem::server::termination()).await?;
        }
        Command::Demo { listen, admin_listen } => idem::demo::run(listen, admin_listen).await?,
        Command::Migrate { config } => {
            let config = Config::load(&config)?;
            idem::store::open(&config.store.url).await.with_context(|| format!("migrating {}", config.store.url))?;
            println!("migrations applied to {}", config.store.url);
        }
        Command::Check { config } => {
            let config = Config::load(&config)?;
            print!("{}", idem::config::describe(&config));
        }
    }
    Ok(())
}
