//! The memory backend's roads: one GCRA transaction by compare-and-swap, a batch of GCRA
//! words, and the general road of any shape through the kit (`decide_mixed`), with refunds.

use super::buckets::*;
use super::*;

/// What one read of a bucket's word decides ([`MemoryBackend::on_word`]).
pub(super) enum WordStep<T> {
    /// The answer; nothing to write.
    Answer(T),
    /// The answer, once the bucket holds this word.
    Write(T, u64),
}

impl MemoryBackend {
    /// Replaces `expected` (0: missing) by `new` if the bucket still holds `expected`.
    pub(super) fn compare_and_set(
        &self,
        key: &BucketKey,
        expected: u64,
        new: u64,
        now: u64,
    ) -> Result<bool, BackendError> {
        let place = Buckets::place(key);
        if let Some(v) = self.inner.map.get(place) {
            return Ok(v
                .compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire)
                .is_ok());
        }
        self.insert_new(place, expected, new, now)
    }

    /// Inserts a bucket found missing, holding `new`, if `expected` (the TAT read, 0: missing)
    /// still describes it: whether it was written.
    pub(super) fn insert_new(
        &self,
        place: Place<'_>,
        expected: u64,
        new: u64,
        now: u64,
    ) -> Result<bool, BackendError> {
        if kit::gcra_unword(expected).0 > now {
            // We read a live bucket that has since gone: someone reset it. Decide again.
            return Ok(false);
        }
        self.reserve(now)?;
        let inserted = self.inner.map.insert_new(place, new);
        if inserted {
            self.inner.len.fetch_add(1, Ordering::Relaxed);
        }
        Ok(inserted)
    }

    /// Takes back a write this batch made (words), as a refund of the time it added (none for
    /// a foreign value it replaced: that changed no decision).
    pub(super) fn roll_back(&self, key: &BucketKey, before: u64, written: u64, now: u64) {
        let (tat_before, _) = kit::gcra_unword(before);
        let (tat_written, _) = kit::gcra_unword(written);
        let added = tat_written.saturating_sub(tat_before.max(now));
        if let Some(v) = self.inner.map.get(Buckets::place(key)) {
            let _ = v.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                Some(if cur == written {
                    before
                } else {
                    // The same bits less the time: a TAT field never borrows from the bound.
                    let (tat, _) = kit::gcra_unword(cur);
                    cur - (tat - tat.saturating_sub(added))
                })
            });
        }
    }

    /// The one compare-and-swap loop on a bucket's word, made under the map's shard read
    /// guard: `step` decides from the word read (0: none), the loop writes what it says if the
    /// bucket still holds that word (inserting a missing one), and on a lost race `step`
    /// decides again from the word found.
    #[inline(always)]
    pub(super) fn on_word<T>(
        &self,
        key: &BucketKey,
        now: u64,
        mut step: impl FnMut(u64) -> WordStep<T>,
    ) -> Result<T, BackendError> {
        let place = Buckets::place(key);
        loop {
            let held = self.inner.map.get(place);
            let mut cur = held
                .as_ref()
                .map_or(0, |entry| entry.load(Ordering::Acquire));
            loop {
                let (answer, new) = match step(cur) {
                    WordStep::Answer(answer) => return Ok(answer),
                    WordStep::Write(answer, new) => (answer, new),
                };
                let Some(entry) = &held else {
                    if self.insert_new(place, 0, new, now)? {
                        return Ok(answer);
                    }
                    break;
                };
                match entry.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Ok(answer),
                    Err(actual) => cur = actual,
                }
            }
        }
    }

    /// Decides and spends one transaction without an allocation: the path
    /// [`Backend::spend`] takes for a one-transaction batch, answering with the `Spend` itself
    /// (built where it is returned: no copy of the outcome on the way out).
    ///
    /// [`on_word`](Self::on_word)'s loop written out with this step inside (measured: through
    /// the helper this path took 371 instructions instead of 343, `benches/instructions.sh`
    /// `ours_spend_one`), the one copy of it.
    pub(super) fn spend_one_at(&self, tx: &BucketTx<'_>, now: u64) -> Spend {
        let limit = match tx.quota {
            Quota::Gcra(limit) => limit,
            Quota::Calendar(quota) => return self.spend_one_calendar(tx, quota, now),
            _ => return Spend::Ready(self.spend_batch(std::slice::from_ref(tx), now)),
        };
        if tx.floor.is_some() {
            // A share bucket (a limit across regions): the batch road.
            return self.spend_share_one(tx, now);
        }
        let answer = |d: &kit::GcraDecision| Spend::Ready(Ok(Outcomes::one(d.outcome())));
        let place = Buckets::place(tx.key);
        loop {
            let held = self.inner.map.get(place);
            let mut cur = held
                .as_ref()
                .map_or(0, |entry| entry.load(Ordering::Acquire));
            loop {
                // The kit's step (`kit::gcra_step`), written out for the common case: a TAT
                // within what this limit writes. One beyond it (a bucket drained under a larger
                // limit, or foreign) takes a road of its own, out of line.
                let tat = kit::gcra_tat(cur);
                let stored = (tat != 0).then_some(tat);
                if limit.is_foreign(stored, now) {
                    drop(held);
                    return self.spend_one_beyond(tx, limit, now);
                }
                let decision = match crate::backend::gcra_decide(tx, limit, stored, now) {
                    Ok(d) => d,
                    Err(e) => return Spend::Ready(Err(e.into())),
                };
                let new = match crate::backend::gcra_write(tx.mode, &decision.out, tat, now) {
                    None => return answer(&decision),
                    Some(t) => match kit::gcra_word(t, limit) {
                        Ok(w) => w,
                        Err(e) => return Spend::Ready(Err(e.into())),
                    },
                };
                let Some(entry) = &held else {
                    match self.insert_new(place, 0, new, now) {
                        Ok(true) => return answer(&decision),
                        Ok(false) => break,
                        Err(e) => return Spend::Ready(Err(e)),
                    }
                };
                match entry.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return answer(&decision),
                    Err(actual) => cur = actual,
                }
            }
        }
    }

    /// [`spend_one_at`](Self::spend_one_at) on a bucket whose TAT runs beyond what `limit`
    /// writes: the kit's step, which reads it under its writer's bound or as foreign (then the
    /// drained TAT it is read as replaces it, whatever the decision).
    #[cold]
    #[inline(never)]
    pub(super) fn spend_one_beyond(
        &self,
        tx: &BucketTx<'_>,
        limit: &gcra::Limit,
        now: u64,
    ) -> Spend {
        let decided = self.on_word(tx.key, now, |cur| {
            match kit::gcra_step(tx, limit, cur, now) {
                Err(e) => WordStep::Answer(Err(e)),
                Ok(step) => match step.write.or(step.repair) {
                    None => WordStep::Answer(Ok(step.decision)),
                    Some(new) => WordStep::Write(Ok(step.decision), new),
                },
            }
        });
        match decided {
            Ok(Ok(d)) => Spend::Ready(Ok(Outcomes::one(d.outcome()))),
            Ok(Err(e)) => Spend::Ready(Err(e.into())),
            Err(e) => Spend::Ready(Err(e)),
        }
    }

    /// One calendar transaction (a calendar quota's request, alone in its batch): its slot
    /// locked under its shard's read guard (no reference counted: the slot cannot leave the
    /// map meanwhile, and every lock of a slot under a guard takes the shard first), the kit's
    /// decision of one transaction (`kit::calendar_spend_one`), its write. A key without a
    /// slot yet takes the general road, which inserts it.
    #[inline(never)]
    fn spend_one_calendar(&self, tx: &BucketTx<'_>, quota: &CalendarQuota, now: u64) -> Spend {
        if let Some(slot) = self.inner.tiers.get(tx.key) {
            let mut guard = lock(slot.value());
            if !guard.removed {
                let (outcome, write) = {
                    let stored = guard.state.as_ref().map(kit::Stored::read);
                    kit::calendar_spend_one(tx, quota, stored, now)
                };
                if let Some(state) = write {
                    guard.write(tx, state, now);
                }
                return Spend::Ready(Ok(Outcomes::one(outcome)));
            }
        }
        Spend::Ready(self.spend_mixed(std::slice::from_ref(tx), now))
    }

    /// The tier slot of a key, inserted when missing unless `create` is false.
    pub(super) fn tier_slot(
        &self,
        key: &BucketKey,
        create: bool,
        now: u64,
    ) -> Result<Option<SharedSlot>, BackendError> {
        if let Some(s) = self.inner.tiers.get(key) {
            return Ok(Some(s.clone()));
        }
        if !create {
            return Ok(None);
        }
        self.reserve(now)?;
        let slot = self
            .inner
            .tiers
            .entry(key.clone())
            .or_insert_with(|| {
                self.inner.len.fetch_add(1, Ordering::Relaxed);
                SharedSlot::default()
            })
            .clone();
        Ok(Some(slot))
    }

    /// A share bucket alone, off the one-transaction road.
    #[cold]
    #[inline(never)]
    fn spend_share_one(&self, tx: &BucketTx<'_>, now: u64) -> Spend {
        Spend::Ready(self.spend_batch(std::slice::from_ref(tx), now))
    }

    /// Any batch: GCRA buckets by compare-and-swap (rolled back and decided again when a race
    /// is lost), tiered keys under their slot's lock, taken in address order (so two batches
    /// never wait for each other) and held until the batch is written. A key named twice is
    /// locked once (for its first transaction) and decided in order by the kit.
    pub(crate) fn spend_mixed(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Result<Outcomes, BackendError> {
        // A batch of GCRA buckets only (a request's usual rules) locks nothing: no slots, and
        // it is decided from the words alone unless one of them needs a repair.
        if batch.iter().all(|tx| tx.word_limit().is_some()) {
            if let Some(decided) = self.spend_words(batch, now) {
                return decided;
            }
            return self.decide_mixed(batch, now, &mut []);
        }
        // The working vectors of a batch live on the stack up to `BATCH` transactions.
        let mut slots: SmallVec<[Option<SharedSlot>; BATCH]> = SmallVec::with_capacity(batch.len());
        'slots: loop {
            slots.clear();
            for (i, tx) in batch.iter().enumerate() {
                slots.push(match tx.word_limit() {
                    Some(_) => None,
                    // A key named again is under its first transaction's lock: a second
                    // lock of the same mutex on this thread would never return.
                    None if kit::earlier(batch, i).is_some() => None,
                    None => self.tier_slot(&kit::state_key(tx), kit::may_write(tx), now)?,
                });
            }
            let mut order: SmallVec<[usize; BATCH]> =
                (0..batch.len()).filter(|&i| slots[i].is_some()).collect();
            order.sort_by_key(|&i| slots[i].as_ref().map(Arc::as_ptr));
            let mut guards: SmallVec<[(usize, MutexGuard<'_, TierSlot>); BATCH]> =
                SmallVec::with_capacity(order.len());
            for &i in &order {
                if let Some(slot) = &slots[i] {
                    let g = lock(slot);
                    if g.removed {
                        continue 'slots;
                    }
                    guards.push((i, g));
                }
            }
            return self.decide_mixed(batch, now, &mut guards);
        }
    }

    /// Decides a batch with the kit from the states read (GCRA TATs loaded, tiered and
    /// concurrency states under their locked slots) and writes what it says: GCRA buckets by
    /// compare-and-swap (a lost race rolls back what was written and decides again), the rest
    /// under their locks, which cannot fail.
    pub(super) fn decide_mixed(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
        guards: &mut [(usize, MutexGuard<'_, TierSlot>)],
    ) -> Result<Outcomes, BackendError> {
        'retry: loop {
            let mut tats: SmallVec<[u64; BATCH]> = SmallVec::with_capacity(batch.len());
            // The GCRA buckets held (their shards' read guards) from the read to the write: one
            // lookup per key. Read guards of one shard may be held together (the lock lets
            // readers in while a writer waits), but no bucket may be inserted while any is held.
            let mut held: SmallVec<[Option<Held<'_>>; BATCH]> =
                SmallVec::with_capacity(batch.len());
            let spent = {
                let mut read: SmallVec<[Option<kit::Read<'_>>; BATCH]> =
                    SmallVec::with_capacity(batch.len());
                for (i, tx) in batch.iter().enumerate() {
                    if let Some(k) = kit::earlier(batch, i) {
                        // A key named again: the kit reads what its earlier transaction
                        // leaves, and its write is compared with what the first one read.
                        held.push(None);
                        tats.push(tats[k]);
                        read.push(None);
                        continue;
                    }
                    let slot = guards.iter().find(|(j, _)| *j == i).map(|(_, g)| &**g);
                    let bucket = match tx.word_limit() {
                        Some(_) => self.inner.map.get(Buckets::place(tx.key)),
                        None => None,
                    };
                    let cur = bucket.as_ref().map_or(0, |b| b.load(Ordering::Acquire));
                    held.push(bucket);
                    tats.push(cur);
                    read.push(match (tx.word_limit(), slot) {
                        (Some(_), _) => Some(kit::Read::Tat(stored(cur).unwrap_or(0))),
                        (None, Some(g)) => g.state.as_ref().map(kit::Stored::read),
                        (None, None) => None,
                    });
                }
                kit::spend(batch, &read, now)?
            };
            if !spent.allowed {
                // Nothing spent; what replaces a foreign value is written all the same.
                if spent.writes.iter().any(Option::is_some) {
                    drop(held);
                    self.write_repairs(batch, &tats, spent.writes, guards, now);
                }
                return Ok(spent.outcomes);
            }
            let word = |i: usize| match spent.writes[i] {
                Some(kit::Stored::Tat(new)) => new,
                _ => 0,
            };
            if !self.write_words(batch, &mut held, &tats, word, now)? {
                continue 'retry;
            }
            // The GCRA part is written; the tiered and concurrency parts cannot fail (their
            // slots are locked).
            for (i, write) in spent.writes.into_iter().enumerate() {
                if let Some(state) = write.filter(|w| !matches!(w, kit::Stored::Tat(_)))
                    && let Some(g) = guard_of(batch, guards, i)
                {
                    g.write(&batch[i], state, now);
                }
            }
            return Ok(spent.outcomes);
        }
    }
}

/// The locked slot of `batch[i]`'s key: its first transaction's.
pub(super) fn guard_of<'g, 'm>(
    batch: &[BucketTx<'_>],
    guards: &'g mut [(usize, MutexGuard<'m, TierSlot>)],
    mut i: usize,
) -> Option<&'g mut MutexGuard<'m, TierSlot>> {
    while let Some(k) = kit::earlier(batch, i) {
        i = k;
    }
    guards.iter_mut().find(|(j, _)| *j == i).map(|(_, g)| g)
}

impl MemoryBackend {
    /// A batch of GCRA buckets, each within what its limit writes or drained under a larger
    /// one (a request's usual rules): decided by the kit's GCRA step and batch rule from the
    /// words read, written by [`write_words`](Self::write_words), with no state of the kit's
    /// built on the way. `None` when a bucket holds a foreign value: the general road
    /// ([`decide_mixed`](Self::decide_mixed)) writes what replaces it.
    pub(super) fn spend_words(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Option<Result<Outcomes, BackendError>> {
        let n = batch.len();
        if n > WORDS {
            return None;
        }
        loop {
            // Plain arrays: a small vector checks where it lives on every access (it cost 4
            // rules 291 instructions more, `benches/instructions.sh 20000 1000 http_ours_4_rules`).
            let mut held: [Option<Held<'_>>; WORDS] = Default::default();
            let mut read = [0u64; WORDS];
            let mut words = [0u64; WORDS];
            let mut places = [Place::Packed(0); WORDS];
            let mut outcomes = Outcomes::with_capacity(n);
            for (i, tx) in batch.iter().enumerate() {
                let limit = tx.word_limit()?;
                // A key named twice (GCRA keys share no state otherwise): the general road
                // decides it in order. Found by the keys' places (one word each for most).
                let place = Buckets::place(tx.key);
                if places[..i].iter().any(|p| p.same(place)) {
                    return None;
                }
                places[i] = place;
                let bucket = self.inner.map.get(place);
                let cur = bucket.as_ref().map_or(0, |b| b.load(Ordering::Acquire));
                let step = match kit::gcra_step(tx, limit, cur, now) {
                    Ok(step) => step,
                    Err(e) => return Some(Err(e.into())),
                };
                if step.repair.is_some() {
                    return None;
                }
                held[i] = bucket;
                read[i] = cur;
                words[i] = step.write.unwrap_or(0);
                outcomes.push(step.decision.outcome());
            }
            if !kit::batch_allowed(batch.iter().zip(&outcomes)) {
                return Some(Ok(outcomes));
            }
            match self.write_words(batch, &mut held[..n], &read[..n], |i| words[i], now) {
                Ok(true) => return Some(Ok(outcomes)),
                Ok(false) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Writes the GCRA words of an allowed batch: `word(i)` (0: nothing) over `read[i]`, the
    /// word read, by compare-and-swap on the bucket `held[i]` still holds (or, where a bucket
    /// must be inserted, after letting go of every bucket: an insert takes its shard's write
    /// lock). `Ok(false)`: a race was lost, and what was written is rolled back (decide again).
    pub(super) fn write_words(
        &self,
        batch: &[BucketTx<'_>],
        held: &mut [Option<Held<'_>>],
        read: &[u64],
        word: impl Fn(usize) -> u64,
        now: u64,
    ) -> Result<bool, BackendError> {
        if (0..batch.len()).any(|i| word(i) != 0 && held[i].is_none()) {
            held.fill_with(|| None);
        }
        for (i, tx) in batch.iter().enumerate() {
            let new = word(i);
            if new == 0 {
                continue;
            }
            let swapped = match held.get(i).and_then(Option::as_ref) {
                Some(tat) => Ok(tat
                    .compare_exchange(read[i], new, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()),
                None => self.compare_and_set(tx.key, read[i], new, now),
            };
            if let Ok(true) = swapped {
                continue;
            }
            // Every word before this one was written: each is rolled back.
            for (j, earlier) in batch[..i].iter().enumerate() {
                let new_j = word(j);
                if new_j != 0 {
                    self.roll_back(earlier.key, read[j], new_j, now);
                }
            }
            return swapped;
        }
        Ok(true)
    }

    /// Writes what replaces the foreign values a denied batch read (each GCRA word only if the
    /// bucket still holds what was read: a lost race leaves the newer state, which the next
    /// read judges again; leases under their locked slots).
    #[cold]
    pub(super) fn write_repairs(
        &self,
        batch: &[BucketTx<'_>],
        read: &[u64],
        mut writes: smallvec::SmallVec<[Option<kit::Stored>; 4]>,
        guards: &mut [(usize, MutexGuard<'_, TierSlot>)],
        now: u64,
    ) {
        for (i, tx) in batch.iter().enumerate() {
            match writes[i].take() {
                Some(kit::Stored::Tat(new)) => {
                    let _ = self.compare_and_set(tx.key, read[i], new, now);
                }
                Some(state) => {
                    if let Some(g) = guard_of(batch, guards, i) {
                        g.write(tx, state, now);
                    }
                }
                None => {}
            }
        }
    }

    /// Refunds one transaction with the kit: a GCRA bucket by compare-and-swap, a tiered or
    /// concurrency key under its slot's lock (a key never stored is refunded as a fresh one and
    /// nothing is written).
    pub(crate) fn refund_one(
        &self,
        tx: &BucketTx<'_>,
        now: u64,
    ) -> Result<(Outcome, Option<TierGrant>), BackendError> {
        if tx.word_limit().is_some() {
            let out = self.on_word(tx.key, now, |cur| {
                match kit::refund(tx, Some(kit::Read::Tat(cur)), now) {
                    Ok(kit::Refunded {
                        outcome,
                        write: Some(kit::Stored::Tat(new)),
                        ..
                    }) => WordStep::Write(Ok(outcome), new),
                    answer => WordStep::Answer(answer.map(|r| r.outcome)),
                }
            })??;
            return Ok((out, None));
        }
        loop {
            let Some(slot) = self.tier_slot(&kit::state_key(tx), false, now)? else {
                let r = kit::refund(tx, None, now)?;
                return Ok((r.outcome, r.tiers));
            };
            let mut g = lock(&slot);
            if g.removed {
                continue;
            }
            let r = kit::refund(tx, g.state.as_ref().map(kit::Stored::read), now)?;
            if let Some(state) = r.write {
                g.write(tx, state, now);
            }
            return Ok((r.outcome, r.tiers));
        }
    }

    /// The live leases of a concurrency key, adaptive or not (for tests and diagnostics).
    pub fn leases(&self, key: &BucketKey) -> usize {
        let now = self.now();
        self.inner.tiers.get(key).map_or(0, |slot| {
            let s = lock(&slot);
            match &s.state {
                Some(kit::Stored::Leases(leases)) if !s.removed => leases
                    .iter()
                    .filter(|&&(_, d)| concurrency::live(d, now))
                    .count(),
                Some(kit::Stored::Adaptive(a)) if !s.removed => a
                    .leases
                    .iter()
                    .filter(|&&(_, d)| concurrency::live(d, now))
                    .count(),
                _ => 0,
            }
        })
    }
}
