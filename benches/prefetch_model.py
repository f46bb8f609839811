#!/usr/bin/env python3
"""A model of issue 32's refill rule for prefetched tokens (not the crate's code): one key,
GCRA burst B and rate R per second, I instances each with a local pool. A request finding its
pool empty sends a refill, a partial grant of MIN..=SIZE units; when fewer than MIN fit, the
store denies with the time MIN fits and the instance denies locally (no call) until then.
Unused tokens go back (one call) at the TTL. SIZE is N, or with --adaptive the instance's own
rate (an EWMA of its arrivals) x TTL, capped at N; MIN is given, or half of SIZE.
Uniform arrivals over T, spread at random over the instances. Integer microseconds.

    python3 benches/prefetch_model.py        # the tables of the issue-31 note
"""
import random


def run(I, rate_total, B=500, R=300, N=50, TTL=1_000_000, T=3_000_000, seed=1, min_units=None,
        adaptive=False):
    rnd = random.Random(seed)
    EI = 1_000_000 // R
    BO = EI * B
    tat = 0
    calls = admitted = 0
    pools = [dict(tokens=0, expiry=0, until=0, last=None, rate=0.0) for _ in range(I)]
    n = int(rate_total * T / 1_000_000)
    for t in sorted(rnd.randrange(T) for _ in range(n)):
        p = pools[rnd.randrange(I)]
        if p['last'] is not None:
            inst = 1_000_000 / max(t - p['last'], 1)
            p['rate'] = 0.9 * p['rate'] + 0.1 * inst if p['rate'] else inst
        p['last'] = t
        for q in pools:  # refunds at the TTL
            if q['tokens'] and t >= q['expiry']:
                calls += 1
                tat = max(tat - q['tokens'] * EI, t)
                q['tokens'] = 0
        if p['tokens'] == 0:
            if t < p['until']:
                continue  # denied locally
            size = max(1, min(N, int(p['rate'] * TTL / 1_000_000))) if adaptive else N
            least = min_units if min_units is not None else max(1, size // 2)
            calls += 1
            base = max(tat, t)
            free = (t - (base - BO)) // EI
            if free >= least:
                k = min(size, free)
                tat = base + k * EI
                p['tokens'] = k
                p['expiry'] = t + TTL
            else:
                p['until'] = base + least * EI - BO
                continue
        p['tokens'] -= 1
        admitted += 1
    cap = min(n, B + R * T // 1_000_000)  # offered, or burst + rate x elapsed
    return admitted, cap, calls


if __name__ == '__main__':
    print('fixed size N = 50, MIN given')
    for I in (1, 2, 4, 8, 50):
        for load in (2.0, 1.0, 0.5):
            for least in (10, 25):
                a, cap, c = run(I, 300 * load, min_units=least)
                print(f'  I={I:2} load={load}x MIN={least:2}: admitted {a}/{cap} ({a / cap:.0%}), '
                      f'calls per admitted {c / max(a, 1):.3f}')
    print('MIN = half the size; size N or the instance rate x TTL (adaptive)')
    for I in (2, 8, 50):
        for load in (2.0, 0.5):
            for adaptive in (False, True):
                a, cap, c = run(I, 300 * load, adaptive=adaptive)
                print(f'  I={I:2} load={load}x adaptive={adaptive!s:5}: admitted {a}/{cap} '
                      f'({a / cap:.0%}), calls per admitted {c / max(a, 1):.3f}')
