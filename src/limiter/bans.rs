//! The keys a limit's penalty ladder holds, a page at a time (`docs/penalties.md`): the admin
//! API's ban list, read from the store without deciding anything; and the bans a layer's
//! in-memory fallback starts from (what the store answered before it failed).

use super::{Limiter, LimiterError};
use crate::algo::penalty::PenaltyStanding;
use crate::backend::MemoryBackend;
use crate::config::Limits;
use crate::key::BucketKey;

/// The most keys a page looks at ([`Limiter::penalties`]' `count` is held to it).
pub(crate) const MOST_PER_PAGE: usize = 1_000;

/// One page of the keys a limit's penalty ladder holds ([`Limiter::penalties`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PenaltyPage {
    /// The keys on this page that are banned now or whose level is above 0.
    pub keys: Vec<PenaltyStanding>,
    /// The cursor of the next page (`None`: this was the last). A page may hold no key while
    /// more follow.
    pub next: Option<String>,
}

impl Limiter {
    /// One page of the keys limit `limit`'s penalty ladder holds: those banned now or with a
    /// level above 0, read from the store as they stand (nothing is decided or written). The
    /// first page has no `cursor` (or an empty one); each page gives the next one's. `count` (1 to
    /// 1,000) is how many keys a page looks at: on memory, the `count` least ids
    /// after the cursor, by their text; on Redis, one `SCAN` call of `count` keys on one
    /// master (a page may hold none while more follow, and a key written during the walk may
    /// be missed or seen twice, as `SCAN` promises).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_ratelimits::{Id, Ladder, Limit, Limiter, Limits, MemoryBackend, Transaction};
    /// let ladder = Ladder::new(1, 60_000_000, 10_000_000, 2, 3_600_000_000)?;
    /// let limits = Limits::builder()
    ///     .limit("Login", Limit::from_micros(100, 100, 1_000_000)?)
    ///     .penalty("Login", ladder)
    ///     .build()?;
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// let key = limiter.key("Login", Id::from(7u64))?;
    /// limiter.spend(&[Transaction::new(key)]).await?; // one counted event: banned for 10 s
    /// let page = limiter.penalties("Login", None, 100).await?;
    /// assert_eq!((page.keys[0].id.as_str(), page.keys[0].level), ("7", 1));
    /// assert!(page.keys[0].banned_for.is_some());
    /// assert_eq!(page.next, None);
    /// # Ok(()) }
    /// ```
    pub async fn penalties(
        &self,
        limit: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<PenaltyPage, LimiterError> {
        let (name, state, ladder) = {
            let limits = self.load();
            let unknown = || LimiterError::UnknownName(limit.chars().take(80).collect());
            let name = limits.name(limit).ok_or_else(unknown)?;
            let entry = limits.entry(name).ok_or_else(unknown)?;
            let penalty = entry
                .penalty
                .as_ref()
                .ok_or(LimiterError::NoPenaltyLadder(name))?;
            (name, penalty.state, penalty.ladder)
        };
        let count = count.clamp(1, MOST_PER_PAGE);
        // An empty cursor is the first page's (`?cursor=`).
        let cursor = cursor.filter(|c| !c.is_empty());
        let bad_cursor =
            || LimiterError::BadCursor(cursor.unwrap_or("").chars().take(80).collect());
        let page = self
            .inner
            .backend
            .penalty_page(name, state, cursor, count)
            .await?
            .ok_or_else(bad_cursor)?;
        let now = page.now_us;
        let keys = page
            .states
            .into_iter()
            .filter_map(|(id, mut s)| s.standing_of(&ladder, id, now))
            .collect();
        Ok(PenaltyPage {
            keys,
            next: page.next,
        })
    }
}

/// The memory of a layer's in-memory fallback ([`Limiter::fallback`]), where a key the store
/// answered banned starts banned (`layer/charge.rs`).
pub(crate) struct FallbackBans(pub(super) MemoryBackend);

impl FallbackBans {
    /// Starts `key` (of a limit of `limits` with a penalty ladder) banned until `until`,
    /// whatever its ladder held in the fallback. Whether it was (not in a full table, not of a
    /// limit without a ladder).
    pub(crate) fn start(&self, limits: &Limits, key: &BucketKey, until: u64, now: u64) -> bool {
        let Some(penalty) = limits.entry(key.name()).and_then(|e| e.penalty.as_ref()) else {
            return false;
        };
        self.0
            .start_banned(key, penalty, until, now)
            .unwrap_or(false)
    }
}
