//! Grants ahead: units a stream took from the store before its messages need them, so that a
//! message of a stream whose grant covers it costs no round trip. The store spent every unit
//! granted (it never admits more than the limit); what a stream did not use goes back to the
//! store when its meter is dropped.

use crate::key::BucketKey;
use crate::limiter::{BatchDecision, Limiter, Transaction};
use crate::mode::Mode;

/// A stream's grants: per key of its batch, the units it holds, and whether the key takes
/// grants (a GCRA limit: a partial grant takes what fits; the other shapes are decided per
/// message).
#[derive(Debug)]
pub(crate) struct Grants {
    /// Messages' worth asked for beyond the one being decided.
    ahead: u64,
    keys: Vec<BucketKey>,
    held: smallvec::SmallVec<[u64; 4]>,
    takes: smallvec::SmallVec<[bool; 4]>,
}

impl Grants {
    /// Grants of `ahead` messages' worth on those of `keys` whose limit is a GCRA limit now.
    pub(crate) fn new(limiter: &Limiter, keys: Vec<BucketKey>, ahead: u64) -> Self {
        let limits = limiter.limits();
        let takes = keys
            .iter()
            .map(|k| limits.resolve(k).is_some_and(|q| q.as_gcra().is_some()))
            .collect();
        Self {
            ahead,
            held: smallvec::smallvec![0; keys.len()],
            keys,
            takes,
        }
    }

    /// Takes `need` (each key's cost of the message) from what is held, when every key holds
    /// enough: the message passes without a decision.
    pub(crate) fn take(&mut self, need: impl Fn(usize) -> u64) -> bool {
        let covered = (0..self.held.len()).all(|i| self.held[i] >= need(i));
        if covered {
            for (i, held) in self.held.iter_mut().enumerate() {
                *held -= need(i);
            }
        }
        covered
    }

    /// Sets key `i`'s transaction for a message needing `need` of it: nothing sent where its
    /// holding covers it (decided only, never written); else what it lacks at least, and up to
    /// `ahead` messages' worth more where the key takes grants.
    pub(crate) fn ask(&self, i: usize, need: u64, tx: &mut Transaction) {
        let held = self.held[i];
        if held >= need {
            return tx.set(0, 0, Mode::Observe);
        }
        let lack = need - held;
        let more = if self.takes[i] {
            need.max(1).saturating_mul(self.ahead)
        } else {
            0
        };
        tx.set(lack, lack.saturating_add(more), Mode::CheckAndSpend);
    }

    /// What an allowed decision granted, kept, and the message's `need` taken from it.
    pub(crate) fn granted(&mut self, decision: &BatchDecision, need: impl Fn(usize) -> u64) {
        for (i, d) in decision.decisions().iter().enumerate() {
            let Some(held) = self.held.get_mut(i) else {
                break;
            };
            let got = if d.mode() == Mode::Observe {
                0
            } else {
                d.granted()
            };
            *held = held.saturating_add(got).saturating_sub(need(i));
        }
    }

    /// The units still held, as refunds to send (none when nothing is held).
    pub(crate) fn unused(&mut self) -> Vec<Transaction> {
        let held = std::mem::take(&mut self.held);
        self.keys
            .iter()
            .zip(held)
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| Transaction::new(k.clone()).cost(n))
            .collect()
    }
}
