//! The runs of the share protocol's model check (`super`): their sizes, the faults each
//! explores, each rule removed once, and the deeper runs (`#[ignore]`d).

use super::*;

fn holds(run: &Run) -> usize {
    match run.search() {
        Ok(states) => {
            eprintln!("{states} states");
            states
        }
        Err(e) => panic!("the envelope broke: {e}"),
    }
}

fn breaks(run: &Run) -> String {
    match run.search() {
        Ok(states) => panic!("no overshoot found in {states} states"),
        Err(e) => e,
    }
}

impl Run {
    fn requests(mut self, requests: &[u8]) -> Run {
        self.requests = requests.to_vec();
        self
    }

    fn horizon(mut self, horizon: u64) -> Run {
        self.horizon = horizon;
        self
    }

    /// Every request of every region reports `demand`.
    fn demand(mut self, demand: u64) -> Run {
        self.demands = vec![vec![demand]; self.floors.len()];
        self
    }

    fn three(lease: u64, margin: u64) -> Run {
        let mut run = Run::two(lease, margin);
        run.floors = vec![Share { rate: 1, burst: 1 }; 3];
        run.settings.total = Share { rate: 5, burst: 5 };
        run.offsets = vec![7, 3, 4];
        run.demands = vec![vec![0, 2]; 3];
        run.instances = vec![1; 3];
        run
    }

    fn restarts(mut self, restarts: u8) -> Run {
        self.restarts = restarts;
        self.forget = true;
        self
    }

    fn steps_back(mut self, steps: u8) -> Run {
        self.steps_back = steps;
        self
    }

    fn region_losses(mut self, losses: u8) -> Run {
        self.region_losses = losses;
        self
    }

    fn joining(mut self, region: usize) -> Run {
        self.joining = vec![region];
        self
    }

    /// Each region's number of instances.
    fn instances(mut self, instances: &[usize]) -> Run {
        self.instances = instances.to_vec();
        self
    }

    fn sabotage(mut self, sabotage: Sabotage) -> Run {
        self.sabotage = sabotage;
        self
    }
}

// The runs of the test command: each explores every interleaving at its sizes in seconds in a
// debug build. Two regions, floors 1 of a limit of 4 (2 move), or three regions, floors 1 of 5.

#[test]
fn two_regions_lapsed_leases_losses_and_reordering_never_overshoot() {
    // Requests of demand 0 or 2; leases of 1 tick; every message late, lost or reordered.
    holds(&Run::two(1, 0).requests(&[2, 2]).horizon(3));
}

#[test]
fn a_share_moves_only_after_its_holder_confirms_giving_it_up() {
    // Leases long enough that nothing lapses: every transfer goes through a confirmation.
    holds(&Run::two(3, 0).requests(&[3, 2]).horizon(3).demand(2));
}

#[test]
fn three_regions_never_overshoot() {
    holds(&Run::three(1, 0).requests(&[1, 1, 1]).horizon(3));
}

#[test]
fn a_global_store_that_loses_its_records_never_overshoots() {
    holds(
        &Run::two(1, 0)
            .requests(&[1, 1])
            .horizon(3)
            .demand(2)
            .restarts(1),
    );
}

#[test]
fn a_region_clock_stepped_back_within_the_margin_never_overshoots() {
    holds(
        &Run::two(1, 1)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .steps_back(1),
    );
}

#[test]
fn a_region_store_that_loses_its_records_never_overshoots() {
    holds(
        &Run::two(1, 0)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .region_losses(1),
    );
}

#[test]
fn a_joining_region_uses_its_floor_only_after_every_older_grant_lapsed() {
    holds(
        &Run::two(1, 0)
            .requests(&[1, 2])
            .horizon(3)
            .demand(2)
            .joining(1),
    );
}

// Several instances in a region: the first has seen the registry, the others never held the
// lock (they have seen none); each learns and reads the confirmation on its own.

#[test]
fn two_instances_in_a_region_never_overshoot() {
    holds(
        &Run::two(1, 0)
            .instances(&[2, 1])
            .requests(&[2, 1])
            .horizon(3),
    );
}

#[test]
fn a_lost_registry_made_again_by_an_instance_that_never_saw_it_never_overshoots() {
    holds(
        &Run::two(1, 0)
            .instances(&[2, 1])
            .requests(&[1, 1])
            .horizon(3)
            .demand(2)
            .restarts(1),
    );
}

#[test]
fn a_region_store_that_loses_its_records_under_two_instances_never_overshoots() {
    holds(
        &Run::two(1, 0)
            .instances(&[2, 1])
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .region_losses(1),
    );
}

// Each rule removed once: the search finds the overshoot it prevents.

#[test]
fn a_lost_registry_made_again_from_one_instance_s_own_view_overshoots() {
    let run = Run::two(1, 0)
        .instances(&[2, 1])
        .requests(&[1, 1])
        .horizon(3)
        .demand(2)
        .restarts(1);
    eprintln!("{}", breaks(&run.sabotage(Sabotage::OwnSeenOnly)));
}

#[test]
fn without_the_margin_a_clock_stepped_back_overshoots() {
    breaks(
        &Run::two(1, 0)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .steps_back(1),
    );
}

#[test]
fn without_the_quiet_period_a_restarted_global_store_overshoots() {
    let run = Run::two(1, 0)
        .requests(&[1, 1])
        .horizon(3)
        .demand(2)
        .restarts(1);
    breaks(&run.sabotage(Sabotage::NoQuiet));
}

#[test]
fn a_lease_started_on_arrival_overshoots() {
    breaks(
        &Run::two(1, 0)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .sabotage(Sabotage::LeaseOnArrival),
    );
}

#[test]
fn a_joining_region_using_its_floor_at_once_overshoots() {
    let run = Run::two(1, 0)
        .requests(&[1, 2])
        .horizon(3)
        .demand(2)
        .joining(1);
    breaks(&run.sabotage(Sabotage::FloorAtOnce));
}

// Deeper runs, minutes in a debug build: `cargo test --release -p tower-ratelimits --lib
// --all-features regions::model -- --ignored`.

#[test]
#[ignore = "minutes in a debug build; run with --release"]
fn deep_two_regions_any_demand() {
    deep(Run::two(1, 0).requests(&[2, 2]).horizon(4));
    deep(Run::two(3, 0).requests(&[3, 2]).horizon(3));
    deep(Run::two(2, 0).requests(&[3, 2]).horizon(4));
}

fn deep(run: Run) {
    let started = std::time::Instant::now();
    let states = holds(&run);
    eprintln!(
        "instances {:?}, requests {:?}, horizon {}, lease {} margin {}, restarts {}, steps back {}, losses {}, joining {:?}: {states} states in {:?}",
        run.instances,
        run.requests,
        run.horizon,
        run.settings.lease_us,
        run.settings.margin_us,
        run.restarts,
        run.steps_back,
        run.region_losses,
        run.joining,
        started.elapsed()
    );
}

#[test]
#[ignore = "minutes in a debug build; run with --release"]
fn deep_faults_any_demand() {
    deep(Run::two(1, 0).requests(&[2, 1]).horizon(3).restarts(1));
    deep(Run::two(1, 1).requests(&[2, 2]).horizon(3).steps_back(1));
    deep(Run::two(1, 0).requests(&[2, 2]).horizon(3).region_losses(1));
    deep(Run::two(1, 0).requests(&[1, 2]).horizon(3).joining(1));
    deep(Run::three(1, 0).requests(&[2, 1, 1]).horizon(3));
}

#[test]
#[ignore = "minutes in a debug build; run with --release"]
fn deep_instances() {
    let two = |instances: &[usize]| Run::two(1, 0).instances(instances).demand(2);
    deep(two(&[2, 1]).requests(&[2, 1]).horizon(3).restarts(1));
    deep(two(&[2, 2]).requests(&[1, 1]).horizon(3).restarts(1));
    deep(two(&[1, 2]).requests(&[1, 1]).horizon(3).joining(1));
    deep(two(&[2, 2]).requests(&[1, 2]).horizon(3).joining(1));
    deep(two(&[3, 1]).requests(&[2, 1]).horizon(3).region_losses(1));
    let three = Run::three(1, 0).instances(&[2, 1, 1]).demand(2);
    deep(three.requests(&[1, 0, 1]).horizon(3).restarts(1));
}
