//! A capacity shared by an adaptive limit's keys (`docs/adaptive-concurrency.md`, "A global
//! capacity"): fair shares (`docs/fair-share.md`) with slots for tokens, as pure functions.
//!
//! The keys active now (holding a slot, or refused under their share and still waiting) share
//! the capacity equally: a key's share is `capacity / active`, at least 1. A key under its
//! share takes a slot while any is free; a key at or over its share takes one only beyond the
//! slots kept for the waiting keys (each waiter's share it does not hold). So the slots held
//! never exceed the capacity, no slot stays idle while no key under its share waits, and a key
//! that holds many cannot take the slots a key under its share is waiting for.

/// The most slots a capacity shares (the keys holding slots are counted on every decision).
pub const MAX_CAPACITY: u64 = 4_096;

/// What a limit's keys hold, as the rule reads it for one key's decision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// The slots every key of the limit holds (live leases).
    pub total: u64,
    /// The slots the deciding key holds.
    pub own: u64,
    /// The keys active now, the deciding key included: holding a slot or waiting.
    pub active: u64,
    /// The slots kept for the other keys waiting under their share (each one's share it does
    /// not hold).
    pub reserve: u64,
}

/// A key's share of `capacity` among `active` keys: at least one slot.
pub fn share(capacity: u64, active: u64) -> u64 {
    (capacity / active.max(1)).max(1)
}

/// What a waiting key that holds `own` slots keeps back from keys over their share.
pub fn kept_for(capacity: u64, active: u64, own: u64) -> u64 {
    share(capacity, active).saturating_sub(own)
}

/// The slots the deciding key may still take now: what is free of its share, then what is
/// free beyond the reserve.
pub fn room(capacity: u64, held: &Held) -> u64 {
    let free = capacity.saturating_sub(held.total);
    let under = share(capacity, held.active)
        .saturating_sub(held.own)
        .min(free);
    under + free.saturating_sub(under).saturating_sub(held.reserve)
}

/// Whether the deciding key is under its share (a refusal then makes it a waiter).
pub fn under_share(capacity: u64, held: &Held) -> bool {
    held.own < share(capacity, held.active)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(total: u64, own: u64, active: u64, reserve: u64) -> Held {
        Held {
            total,
            own,
            active,
            reserve,
        }
    }

    #[test]
    fn a_share_is_the_capacity_over_the_active_keys_and_at_least_one() {
        assert_eq!(share(20, 2), 10);
        assert_eq!(share(20, 3), 6);
        assert_eq!(share(2, 5), 1);
        assert_eq!(share(7, 0), 7);
    }

    #[test]
    fn a_key_under_its_share_takes_any_free_slot() {
        // Two keys, shares of 10: the other holds 19, the reserve is the other's.
        assert_eq!(room(20, &held(19, 0, 2, 5)), 1);
        assert!(under_share(20, &held(19, 0, 2, 5)));
        assert_eq!(room(20, &held(20, 0, 2, 0)), 0);
    }

    #[test]
    fn a_key_over_its_share_takes_only_what_lies_beyond_the_reserve() {
        // It holds 12 of 20 with a share of 10; 8 free, 5 kept for a waiter.
        assert_eq!(room(20, &held(12, 12, 2, 5)), 3);
        assert!(!under_share(20, &held(12, 12, 2, 5)));
        // No one waits: every free slot.
        assert_eq!(room(20, &held(12, 12, 2, 0)), 8);
        // The reserve takes all that is free.
        assert_eq!(room(20, &held(15, 12, 2, 5)), 0);
    }

    #[test]
    fn under_its_share_a_key_then_goes_on_beyond_the_reserve() {
        // Holds 8 of a share of 10, 10 free, 5 kept: 2 of its share, then 3 more.
        assert_eq!(room(20, &held(10, 8, 2, 5)), 5);
    }

    #[test]
    fn the_room_never_passes_the_capacity() {
        for total in 0..=12 {
            for own in 0..=total {
                for active in 1..=4 {
                    for reserve in 0..=12 {
                        let r = room(10, &held(total, own, active, reserve));
                        assert!(
                            total + r <= 10.max(total),
                            "{total} {own} {active} {reserve}"
                        );
                    }
                }
            }
        }
    }
}
