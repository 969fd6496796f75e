//! Checks the admission model exhaustively up to a bound and prints the figures:
//! `cargo run --release -p admission-model -- [--requests N] [--depth D] [--threads T]
//! [--broken] [--strict]`. `--broken`: with a `finish.lua` that forgets to release the
//! slot; `--strict`: the properties without their documented exceptions.

use std::sync::atomic::Ordering;
use std::time::Instant;

use admission_model::properties;
use admission_model::system::{Mutation, System};
use stateright::{Checker, HasDiscoveries, Model};

fn main() {
    let mut requests = 3;
    let mut depth = 0;
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut mutation = None;
    let mut strict = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().and_then(|v| v.parse::<usize>().ok());
        match arg.as_str() {
            "--requests" => requests = value().unwrap_or(requests),
            "--depth" => depth = value().unwrap_or(depth),
            "--threads" => threads = value().unwrap_or(threads),
            "--broken" => mutation = Some(Mutation::FinishKeepsSlot),
            "--strict" => strict = true,
            _ => {
                eprintln!(
                    "usage: admission-model [--requests N (3)] [--depth D (0: all)] [--threads T] [--broken] [--strict]"
                );
                std::process::exit(2);
            }
        }
    }
    let mut system = System::standard(u8::try_from(requests).unwrap_or(3));
    system.mutation = mutation;
    system.strict = strict;
    let started = Instant::now();
    let mut checker = system.checker().threads(threads);
    if depth > 0 {
        checker = checker.target_max_depth(depth);
    }
    if mutation.is_some() {
        // The broken script's first violation is the point; the rest is the same.
        checker = checker.finish_when(HasDiscoveries::AnyFailures);
    }
    let checker = checker.spawn_bfs().join();
    let elapsed = started.elapsed();
    println!(
        "requests {requests}, replicas 3: {} states ({} unique), depth {}, {:.1} s on {threads} threads",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        elapsed.as_secs_f64()
    );
    println!(
        "once the faults stop, every request over within {:.0} s (the bound checked: {:.0} s)",
        properties::SLOWEST_SETTLEMENT.load(Ordering::Relaxed) as f64 / 1e6,
        properties::settle_within(checker.model()) as f64 / 1e6
    );
    let mut failed = false;
    for property in checker.model().properties() {
        match checker.discovery(property.name) {
            Some(path) if property.expectation != stateright::Expectation::Sometimes => {
                failed = true;
                let why = properties::explain(checker.model(), path.last_state());
                println!("VIOLATED  {}: {why}", property.name);
                for action in path.into_actions() {
                    println!("  {action:?}");
                }
            }
            None if property.expectation == stateright::Expectation::Sometimes => {
                failed = true;
                println!("NEVER SEEN  {}", property.name);
            }
            _ => println!("holds     {}", property.name),
        }
    }
    std::process::exit(i32::from(failed));
}
