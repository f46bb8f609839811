#!/usr/bin/env python3
"""Ratio tables from criterion's saved estimates (target/criterion), in Markdown.

Run after the criterion benches (`benches/run-all.sh` does both). Uses each benchmark's
median, the estimate least moved by a noisy neighbour."""
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "criterion")


def median_ns(*parts):
    path = os.path.join(ROOT, *parts, "new", "estimates.json")
    try:
        with open(path) as f:
            return json.load(f)["median"]["point_estimate"]
    except (OSError, KeyError, ValueError):
        return None


def fmt(ns):
    if ns is None:
        return "–"
    if ns >= 1000:
        return f"{ns / 1000:.2f} µs"
    return f"{ns:.1f} ns"


def ratio(a, b):
    return "–" if a is None or b is None else f"{a / b:.2f}"


def memory():
    print("### In-memory decision vs governor (median time per operation)\n")
    print("| keys / threads | governor `check_key` | ours `spend_one` | ratio | ours `Backend::spend` | ratio | ours `Limiter::spend` | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for keys in ("1000keys", "1000000keys"):
        for threads in ("1t", "2t"):
            p = f"{keys}_{threads}"
            g = median_ns("memory_spend", "governor", p)
            one = median_ns("memory_spend", "ours_spend_one", p)
            backend = median_ns("memory_spend", "ours_backend", p)
            lim = median_ns("memory_spend", "ours_limiter", p)
            label = f"{keys.replace('000000keys', 'M').replace('000keys', 'k')} / {threads[0]}"
            print(f"| {label} | {fmt(g)} | {fmt(one)} | **{ratio(one, g)}** | {fmt(backend)} | {ratio(backend, g)} | {fmt(lim)} | {ratio(lim, g)} |")
    print()


def middleware():
    print("### Middleware in process (median time per request, request building included)\n")
    bare = median_ns("middleware", "bare")
    gov = median_ns("middleware", "tower_governor")
    print("| variant | time | vs bare | vs tower_governor |")
    print("|---|---:|---:|---:|")
    for name in ("bare", "ours_1_rule", "ours_1_rule_no_headers", "ours_3_rules", "tower_governor"):
        t = median_ns("middleware", name)
        print(f"| {name} | {fmt(t)} | {ratio(t, bare)} | {ratio(t, gov)} |")
    print()


def others():
    print("### Other criterion groups (median)\n")
    print("| benchmark | time |")
    print("|---|---:|")
    for group in sorted(os.listdir(ROOT)) if os.path.isdir(ROOT) else []:
        if group in ("memory_spend", "middleware", "report"):
            continue
        for dirpath, dirnames, _ in sorted(os.walk(os.path.join(ROOT, group))):
            if "new" in dirnames:
                rel = os.path.relpath(dirpath, ROOT)
                print(f"| {rel} | {fmt(median_ns(rel))} |")
    print()


if __name__ == "__main__":
    if not os.path.isdir(ROOT):
        sys.exit("no criterion results: run the benches first")
    memory()
    middleware()
    others()
