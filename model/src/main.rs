//! `idem-model`: checks the model of Idem's claim protocol (docs/guarantees.md#the-model).
//!
//! ```text
//! idem-model check                      every scenario, every interleaving within its bounds
//! idem-model check --scenario NAME      one scenario
//! idem-model check --mutant NAME        a broken variant: must fail, with a counterexample
//! idem-model mutants                    the broken variants, one name a line
//! idem-model scenarios                  the scenarios, one a line
//! ```
//!
//! `IDEM_MODEL_BOUNDS=name=value,…` changes a scenario's bounds (see `Bounds::with`).

use std::process::ExitCode;
use std::time::Instant;

use idem_model::{properties, scenarios, Mutant, Protocol, Scenario};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["mutants"] => {
            for mutant in Mutant::ALL {
                println!("{}", mutant.name());
            }
            ExitCode::SUCCESS
        }
        ["scenarios"] => {
            for scenario in scenarios::all() {
                println!("{:<18} {}", scenario.name, scenario.what);
            }
            ExitCode::SUCCESS
        }
        ["check"] => check(scenarios::all(), None),
        ["check", "--scenario", name] => match scenarios::named(name) {
            Some(scenario) => check(vec![scenario], None),
            None => usage(&format!("no scenario is called `{name}`; `idem-model scenarios` lists them")),
        },
        ["check", "--mutant", name] => match Mutant::parse(name) {
            Some(mutant) => {
                // Its own scenario first: the others only if that one misses it.
                let mut all = scenarios::all();
                all.sort_by_key(|s| s.name != mutant.scenario());
                check(all, Some(mutant))
            }
            None => usage(&format!("no mutant is called `{name}`; `idem-model mutants` lists them")),
        },
        _ => usage(
            "usage: idem-model check [--scenario NAME | --mutant NAME] | idem-model mutants | idem-model scenarios",
        ),
    }
}

fn usage(message: &str) -> ExitCode {
    eprintln!("idem-model: {message}");
    ExitCode::from(2)
}

/// Checks `scenarios` (broken by `mutant`, if any): success when every property holds in each,
/// failure with a numbered counterexample at the first that does not.
fn check(scenarios: Vec<Scenario>, mutant: Option<Mutant>) -> ExitCode {
    if let Some(mutant) = mutant {
        println!("mutant {}: {}", mutant.name(), mutant.describe());
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (mut states, started) = (0, Instant::now());
    for mut scenario in scenarios {
        if let Ok(text) = std::env::var("IDEM_MODEL_BOUNDS") {
            match scenario.bounds.clone().with(&text) {
                Ok(bounds) => scenario.bounds = bounds,
                Err(e) => return usage(&format!("IDEM_MODEL_BOUNDS: {e}")),
            }
        }
        let model = Protocol::new(&scenario, mutant);
        println!("scenario {}: {}", scenario.name, scenario.what);
        println!("  {}", describe(&scenario));
        let began = Instant::now();
        let mut builder = model.clone().checker().threads(threads);
        if mutant.is_some() {
            builder = builder.finish_when(HasDiscoveries::AnyFailures);
        }
        let checker = builder.spawn_bfs().join();
        states += checker.unique_state_count();
        println!(
            "  explored {} states ({} unique) in {:.1} s, to depth {}",
            checker.state_count(),
            checker.unique_state_count(),
            began.elapsed().as_secs_f64(),
            checker.max_depth()
        );
        let mut failed = false;
        for property in model.properties() {
            let found = checker.discovery(property.name);
            let holds = match property.expectation {
                Expectation::Sometimes => found.is_some(),
                _ => found.is_none(),
            };
            // Stopped at a mutant's first failure, a `sometimes` not met yet says nothing.
            if !holds && mutant.is_some() && property.expectation == Expectation::Sometimes {
                continue;
            }
            println!("  {} {}", if holds { "holds" } else { "FAILS" }, property.name);
            if holds {
                continue;
            }
            failed = true;
            match found {
                Some(path) => {
                    println!("  counterexample:");
                    for (i, (state, action)) in path.into_vec().into_iter().enumerate() {
                        match action {
                            Some(action) => println!("  {:>3}. t={} {:?}", i + 1, state.t, action),
                            None => println!("       then: {}", properties::summary(&state)),
                        }
                    }
                }
                None => println!("  no state reached it"),
            }
        }
        if failed {
            return ExitCode::FAILURE;
        }
    }
    println!("every property holds: {states} states in all, in {:.1} s", started.elapsed().as_secs_f64());
    ExitCode::SUCCESS
}

fn describe(scenario: &Scenario) -> String {
    let b = &scenario.bounds;
    format!(
        "{} nodes, up to tick {}; lease {}, clock margin {}, send window {}, attempt limit {}, retention {}, \
         {} attempts; {} requests, {} faults, {} operator actions, {} probes, {} records{}",
        b.nodes,
        b.horizon,
        b.lease,
        b.margin,
        b.window,
        b.limit,
        b.retention,
        b.max_attempts,
        b.requests,
        b.faults,
        b.operator,
        b.probes,
        b.gens,
        if b.liveness {
            format!("; settled within {} ticks of the last disturbance", b.settles_within)
        } else {
            String::new()
        }
    )
}
