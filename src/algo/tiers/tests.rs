use super::*;

/// The drained state is what a fresh key holds once its whole capacity was granted: nothing
/// more is granted until the tiers' own times say so.
#[test]
fn a_drained_state_is_a_fresh_key_after_its_whole_capacity() {
    let limit = TieredLimit::new([
        Tier::from_micros(5, 1_000_000, 1_000_000, 0),
        Tier::from_micros(50, 5_000_000, 5_000_000, 15_000_000),
    ])
    .unwrap();
    let now = 7_000_000_000;
    let mut spent = TierState::new();
    spend(&limit, &mut spent, now, 55, 55).unwrap();
    let drained = drained(&limit, now);
    assert_eq!(drained, spent);
    let (d, _) = decide(&limit, &drained, now, 1, 1).unwrap();
    assert!(!d.allowed);
    assert_eq!(
        d.retry_after_us, 5_000_001,
        "tier 2 active for 5 s, then tier 1 serves"
    );
}

#[test]
fn validation_names_the_tier_and_field() {
    let t = |l, w, a, c| Tier::from_micros(l, w, a, c);
    assert_eq!(TieredLimit::new([]), Err(TierError::NoTiers));
    assert_eq!(
        TieredLimit::new([t(1, 1, 1, 0), t(1, 0, 1, 0)]),
        Err(TierError::Zero {
            tier: 2,
            field: "window"
        })
    );
    assert_eq!(
        TieredLimit::new([t(1, 1, 0, 0)]),
        Err(TierError::Zero {
            tier: 1,
            field: "active"
        })
    );
    assert!(matches!(
        TieredLimit::new([t(MAX_TIER_LIMIT + 1, 1, 1, 0)]),
        Err(TierError::TooLarge {
            tier: 1,
            field: "limit",
            ..
        })
    ));
    assert!(matches!(
        TieredLimit::new([t(1, 1, 1, MAX_TIER_DURATION_US + 1)]),
        Err(TierError::TooLarge {
            field: "cooldown",
            ..
        })
    ));
    assert_eq!(
        TieredLimit::new([t(0, 1, 1, 0)]),
        Err(TierError::NoCapacity)
    );
    assert_eq!(
        TieredLimit::new(std::iter::repeat_n(t(1, 1, 1, 0), 9)),
        Err(TierError::TooManyTiers(9))
    );
    assert_eq!(
        TieredLimit::new([t(0, 1, 1, 0), t(3, 1, 1, 0)])
            .unwrap()
            .capacity(),
        3
    );
}
