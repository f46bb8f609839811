//! A capacity shared by an adaptive limit's keys (`docs/adaptive-concurrency.md`, "A global
//! capacity"): fair shares (`docs/fair-share.md`) with slots for tokens, as pure functions.
//!
//! The keys active now (holding a slot, or refused under their share and still waiting) share
//! the capacity equally: a key's share is `capacity / active`, at least 1. A key under its
//! share takes a slot while any is free; a key at or over its share takes one only beyond the
//! slots kept for the waiting keys (each waiter's share it does not hold). So the slots held
//! never exceed the capacity, no slot stays idle while no key under its share waits, and a key
//! that holds many cannot take the slots a key under its share is waiting for.
//!
//! Slots are not taken back: a key whose requests never end keeps what it holds. So the last
//! `headroom` free slots are lent only to keys that hold none (each key's first slot): a key
//! that holds a slot takes another only while `headroom` slots stay free after it. Whatever
//! the others hold and however long they hold it, the slots held beyond each holder's first
//! never pass `capacity - headroom` ([`room`] keeps it so), so while fewer than `headroom`
//! keys hold slots, at least one is free, and a key that holds none is admitted at once.

/// The most slots a capacity shares (the keys holding slots are counted on every decision).
pub const MAX_CAPACITY: u64 = 4_096;

/// The headroom a capacity keeps when none is set: a fifth of it, at least one slot.
pub fn default_headroom(capacity: u64) -> u64 {
    (capacity / 5).max(1)
}

/// A capacity shared by a limit's keys, and the headroom it lends only to keys that hold no
/// slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capacity {
    /// The slots all the keys hold together at most.
    pub slots: u64,
    /// Free slots only a key holding none may take (at most `slots`).
    pub headroom: u64,
}

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

/// The slots the deciding key may still take now, one after another: a key holding none its
/// first from any free slot; beyond it, what is free of its share and then what is free beyond
/// the reserve, both outside the headroom.
pub fn room(capacity: Capacity, held: &Held) -> u64 {
    let free = capacity.slots.saturating_sub(held.total);
    if held.own == 0 && free > 0 {
        let first = Held {
            total: held.total + 1,
            own: 1,
            ..*held
        };
        return 1 + lent(capacity, &first, free - 1);
    }
    lent(capacity, held, free)
}

/// What a key holding `held.own` slots may take of `free`: its share's part, then what lies
/// beyond the reserve, never the headroom.
fn lent(capacity: Capacity, held: &Held, free: u64) -> u64 {
    let lendable = free.saturating_sub(capacity.headroom);
    let under = share(capacity.slots, held.active)
        .saturating_sub(held.own)
        .min(lendable);
    under + lendable.saturating_sub(under).saturating_sub(held.reserve)
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

    fn cap(slots: u64, headroom: u64) -> Capacity {
        Capacity { slots, headroom }
    }

    #[test]
    fn a_share_is_the_capacity_over_the_active_keys_and_at_least_one() {
        assert_eq!(share(20, 2), 10);
        assert_eq!(share(20, 3), 6);
        assert_eq!(share(2, 5), 1);
        assert_eq!(share(7, 0), 7);
    }

    #[test]
    fn a_key_under_its_share_takes_any_free_slot_outside_the_headroom() {
        // Two keys, shares of 10: the other holds 19, the reserve is the other's.
        assert_eq!(room(cap(20, 0), &held(19, 0, 2, 5)), 1);
        assert!(under_share(20, &held(19, 0, 2, 5)));
        assert_eq!(room(cap(20, 0), &held(20, 0, 2, 0)), 0);
        // Holding 3, 8 free, 2 of them the headroom: 6.
        assert_eq!(room(cap(20, 2), &held(12, 3, 2, 0)), 6);
    }

    #[test]
    fn a_key_over_its_share_takes_only_what_lies_beyond_the_reserve() {
        // It holds 12 of 20 with a share of 10; 8 free, 5 kept for a waiter.
        assert_eq!(room(cap(20, 0), &held(12, 12, 2, 5)), 3);
        assert!(!under_share(20, &held(12, 12, 2, 5)));
        // No one waits: every free slot, or all but the headroom.
        assert_eq!(room(cap(20, 0), &held(12, 12, 2, 0)), 8);
        assert_eq!(room(cap(20, 4), &held(12, 12, 2, 0)), 4);
        // The reserve takes all that is free.
        assert_eq!(room(cap(20, 0), &held(15, 12, 2, 5)), 0);
    }

    #[test]
    fn under_its_share_a_key_then_goes_on_beyond_the_reserve() {
        // Holds 8 of a share of 10, 10 free, 5 kept: 2 of its share, then 3 more.
        assert_eq!(room(cap(20, 0), &held(10, 8, 2, 5)), 5);
    }

    #[test]
    fn the_headroom_goes_only_to_a_key_that_holds_no_slot() {
        // 17 held of 20, headroom 4: a key holding none takes one, a key holding one none.
        assert_eq!(room(cap(20, 4), &held(17, 0, 3, 0)), 1);
        assert_eq!(room(cap(20, 4), &held(17, 1, 3, 0)), 0);
        assert_eq!(room(cap(20, 4), &held(17, 16, 3, 0)), 0);
        // Alone, a key takes its first slot and then all but the headroom: 16 of 20.
        assert_eq!(room(cap(20, 4), &held(0, 0, 1, 0)), 16);
        // Nothing free: nothing, first slot or not.
        assert_eq!(room(cap(20, 4), &held(20, 0, 3, 0)), 0);
    }

    #[test]
    fn the_room_never_passes_the_capacity() {
        for headroom in 0..=10 {
            for total in 0..=12 {
                for own in 0..=total {
                    for active in 1..=4 {
                        for reserve in 0..=12 {
                            let r = room(cap(10, headroom), &held(total, own, active, reserve));
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

    /// Every sequence of takes and gives back by up to 4 keys (each taking whatever `room`
    /// allows), exhaustively to a depth of 7: the slots held beyond each holder's first never
    /// pass `capacity - headroom`, so while fewer keys than the headroom hold slots a key
    /// holding none always finds room.
    #[test]
    fn while_fewer_keys_than_the_headroom_hold_slots_a_new_key_is_admitted() {
        fn walk(c: Capacity, held: &mut [u64; 4], depth: u32) {
            let holders = held.iter().filter(|&&n| n > 0).count() as u64;
            let total: u64 = held.iter().sum();
            assert!(total - holders <= c.slots - c.headroom, "{held:?}");
            if holders < c.headroom {
                let newcomer = Held {
                    total,
                    own: 0,
                    active: holders + 1,
                    reserve: 0,
                };
                assert!(room(c, &newcomer) >= 1, "{held:?}");
            }
            if depth == 0 {
                return;
            }
            for k in 0..held.len() {
                let h = Held {
                    total,
                    own: held[k],
                    active: holders + u64::from(held[k] == 0),
                    reserve: 0,
                };
                if room(c, &h) > 0 {
                    held[k] += 1;
                    walk(c, held, depth - 1);
                    held[k] -= 1;
                }
                if held[k] > 0 {
                    held[k] -= 1;
                    walk(c, held, depth - 1);
                    held[k] += 1;
                }
            }
        }
        for (slots, headroom) in [(6, 2), (6, 3), (5, 5), (7, 1)] {
            walk(cap(slots, headroom), &mut [0; 4], 7);
        }
    }
}
