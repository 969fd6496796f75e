//! The model checked in the test run: the standard set-up (three replicas, two
//! requests, one fault of each kind) explored exhaustively to depth 16 — every request
//! admitted, queued or seeded, settled and committed around several faults;
//! `cargo run --release -p admission-model` checks further (the figures in
//! docs/reliability.md). And two checks that the checker has teeth: a broken
//! `finish.lua` is caught, and each documented exception is needed by some run.

use std::collections::BTreeSet;

use admission_model::properties::{self, BUDGET, HELD, SETTLED, SLOTS};
use admission_model::system::{Mutation, System};
use stateright::{Checker, HasDiscoveries, Model};

/// How deep the test run explores: the whole space (depth 33) takes 13 minutes and
/// 15 GB; this, about two minutes.
const DEPTH: usize = 16;

/// Checks `system` to [`DEPTH`], or until `found` has been found.
fn check(system: System, found: Option<&[&'static str]>) -> impl Checker<System> {
    let mut checker = system
        .checker()
        .threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
        .target_max_depth(DEPTH);
    if let Some(found) = found {
        checker = checker.finish_when(HasDiscoveries::AllOf(
            found.iter().copied().collect::<BTreeSet<_>>(),
        ));
    }
    let checker = checker.spawn_bfs().join();
    eprintln!(
        "{} states ({} unique), depth {}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth()
    );
    checker
}

#[test]
fn the_protocol_keeps_its_properties_in_every_interleaving() {
    let checker = check(System::standard(2), None);
    assert!(checker.is_done() && checker.unique_state_count() > 1_000_000);
    checker.assert_properties();
}

#[test]
fn a_finish_that_forgets_to_release_the_slot_is_caught() {
    let mut system = System::standard(2);
    system.mutation = Some(Mutation::FinishKeepsSlot);
    let checker = check(system, Some(&[HELD]));
    let path = checker.assert_any_discovery(HELD);
    let why = properties::explain(checker.model(), path.last_state());
    eprintln!("caught: {why}\n{:?}", path.into_actions());
    assert!(why.contains("slots held"), "{why}");
}

#[test]
fn each_documented_exception_is_needed_by_some_run() {
    let mut system = System::standard(2);
    system.strict = true;
    let checker = check(system, Some(&[BUDGET, SLOTS, SETTLED]));
    for property in [BUDGET, SLOTS, SETTLED] {
        let path = checker.assert_any_discovery(property);
        eprintln!("{property}: {:?}", path.into_actions());
    }
}
