#!/usr/bin/env python3
"""The crate's import arrows, checked (docs/design.md, "Arrows"): every `crate::` and `super::`
path of a source file under src/ (its `use` lines and paths written inline, tests and comments
left out)
is followed to the file that defines the name, through lib.rs's re-exports, so that an import
through the crate root draws the same arrow as one from the name's home. Fails (exit 1) on

  - a circle: files that import each other, directly or round a loop;
  - an arrow up the stack: a file of a room (a folder or file at the top of src/) that names
    one of a room drawn above it in design.md's stack;
  - an import through the crate root (`crate::Limit` where lib.rs re-exports `Limit`): import
    from the name's home module (doc links, being comments, may use the public path).

Usage: python3 scripts/imports.py [src]   (from the repository's root; .ci/run runs it)
"""
import os
import re
import sys

# Imports through the crate root allowed in code compiled outside tests.
CRATE_ROOT_ALLOWED = 0

SRC = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "src")
DESIGN = os.path.join(os.path.dirname(SRC), "docs", "design.md")


def read_files():
    files = {}
    for d, _, fs in os.walk(SRC):
        for f in fs:
            if f.endswith(".rs"):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8", errors="replace") as h:
                    files[os.path.relpath(path, SRC)] = h.read()
    return files


def module_of(rel):
    parts = rel[:-3].split("/")
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def without_tests(text):
    """The text without comments, string literals and `#[cfg(test)]` items."""
    text = re.sub(r"//[^\n]*", "", text)
    # A quote as a character (b'"', '"') opens no string.
    text = re.sub(r"b?'(\\.|[^'\\])'", "' '", text)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    out, i = [], 0
    pattern = r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?(mod\s+\w+\s*(\{|;)|use\s[^;]*;|fn\s+\w+[^{]*\{)"
    for m in re.finditer(pattern, text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        if m.group(0).endswith("{"):
            depth, j = 1, m.end()
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            i = j
        else:
            i = m.end()
    out.append(text[i:])
    return "".join(out)


def expand(tree):
    """`a::{b, c::{d, e}}` as the paths it names."""
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", re.sub(r"\s+", " ", tree)).strip()
    m = re.match(r"^(.*?)\{(.*)\}$", tree)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    items, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    items.append(cur)
    return [prefix + e for it in items if it for e in expand(it)]


def paths_of(text, module):
    """Every crate path the text names: (path as a list, written through the crate root)."""
    found = []
    for m in re.finditer(r"\b(pub(\([^)]*\))?\s+)?use\s+([^;]+);", text):
        for p in expand(m.group(3)):
            p = re.sub(r" as \w+$", "", p).rstrip(":")
            parts = [x for x in p.split("::") if x]
            if not parts:
                continue
            if parts[0] == "crate":
                found.append(parts[1:])
            elif parts[0] in ("super", "self"):
                base = list(module)
                while parts and parts[0] in ("super", "self"):
                    if parts.pop(0) == "super" and base:
                        base.pop()
                found.append(base + parts)
    for m in re.finditer(r"\bcrate((?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
        found.append(m.group(1).split("::")[1:])
    # Paths written inline from the module's parent (`super::gcra::read_entry(...)`), which
    # draw the same arrow as a `use` of them.
    for m in re.finditer(r"(?<![\w:])((?:super::)+)((?:[A-Za-z_][A-Za-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*)", text):
        base = list(module)
        for _ in range(m.group(1).count("super")):
            if base:
                base.pop()
        found.append(base + m.group(2).split("::"))
    return found


def main():
    files = read_files()
    modules = {module_of(r): r for r in files}
    lib = without_tests(files["lib.rs"])
    # Names lib.rs re-exports, and the path each comes from.
    reexports = {}
    for m in re.finditer(r"\bpub\s+use\s+([^;]+);", lib):
        for p in expand(m.group(1)):
            alias = re.search(r" as (\w+)$", p)
            p = re.sub(r" as \w+$", "", p)
            parts = [x for x in p.split("::") if x and x != "crate"]
            if parts and parts[-1] != "*":
                reexports[alias.group(1) if alias else parts[-1]] = parts

    def home(path, seen=0):
        """The file defining what `path` names (the longest module prefix that is a file)."""
        if path and path[0] in reexports and len(path) >= 1 and seen < 4 and (path[0],) not in modules:
            return home(reexports[path[0]] + path[1:], seen + 1)
        for n in range(len(path), 0, -1):
            if tuple(path[:n]) in modules:
                return modules[tuple(path[:n])]
        return None

    # Files compiled only for tests (`#[cfg(test)] mod name;`), and every file under them.
    test_only = set()
    for rel, text in files.items():
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text):
            test_only.add(module_of(rel) + (m.group(3),))
    tested = lambda rel: any(module_of(rel)[: len(t)] == t for t in test_only)
    files = {rel: text for rel, text in files.items() if not tested(rel)}
    edges, through_root = {}, []
    for rel, text in files.items():
        if rel == "lib.rs":
            continue
        body = without_tests(text)
        for path in paths_of(body, module_of(rel)):
            if path and path[0] in reexports and (path[0],) not in modules:
                through_root.append((rel, path[0]))
            target = home(path)
            if target and target != rel and target != "lib.rs":
                edges.setdefault(rel, {}).setdefault(target, set()).add("::".join(path))
    failures = []

    # Circles: strongly connected files (Tarjan).
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    sys.setrecursionlimit(10000)
    for v in sorted(files):
        if v not in index:
            connect(v)
    for scc in sccs:
        failures.append("a circle of %d files: %s" % (len(scc), ", ".join(scc)))
        for a in scc:
            for b, names in sorted(edges.get(a, {}).items()):
                if b in scc:
                    failures.append("    %s -> %s: %s" % (a, b, ", ".join(sorted(names))))

    # The stack, as design.md draws it: "<!-- stack: room room | room ... -->", top first;
    # rooms between two bars are on one floor (they may name each other).
    with open(DESIGN, encoding="utf-8") as h:
        drawn = re.search(r"<!-- stack: ([^>]*) -->", h.read())
    if not drawn:
        failures.append("docs/design.md draws no stack (<!-- stack: ... -->)")
        floor = {}
    else:
        floor = {}
        for level, rooms in enumerate(drawn.group(1).split("|")):
            for room in rooms.split():
                floor[room] = level
    room = lambda rel: rel.split("/")[0][:-3] if "/" not in rel else rel.split("/")[0]
    for rel in sorted(files):
        if rel == "lib.rs":
            continue
        r = room(rel)
        if floor and r not in floor:
            failures.append("%s: its room %s is not in design.md's stack" % (rel, r))
            continue
        for target, names in sorted(edges.get(rel, {}).items()):
            t = room(target)
            if t in floor and r in floor and floor[t] < floor[r]:
                failures.append(
                    "an arrow up the stack: %s (%s) -> %s (%s): %s"
                    % (rel, r, target, t, ", ".join(sorted(names)))
                )

    if len(through_root) > CRATE_ROOT_ALLOWED:
        failures.append(
            "%d imports through the crate root, %d allowed: import from the name's home module"
            % (len(through_root), CRATE_ROOT_ALLOWED)
        )
        for rel, name in sorted(through_root)[:20]:
            failures.append("    %s: crate::%s" % (rel, name))
    print(
        "imports: %d files, %d arrows, %d circles, %d imports through the crate root (%d allowed)"
        % (len(files), sum(len(v) for v in edges.values()), len(sccs), len(through_root), CRATE_ROOT_ALLOWED)
    )
    if "--why" in sys.argv:
        a, b = sys.argv[sys.argv.index("--why") + 1 :][:2]
        for x, ts in sorted(edges.items()):
            for y, names in sorted(ts.items()):
                if room(x) == a and room(y) == b:
                    print("%s -> %s: %s" % (x, y, ", ".join(sorted(names))))
    if "--rooms" in sys.argv:
        pairs = {}
        for a, ts in edges.items():
            for b in ts:
                if room(a) != room(b):
                    pairs.setdefault((room(a), room(b)), []).append("%s -> %s" % (a, b))
        for (a, b), v in sorted(pairs.items()):
            print("%s -> %s (%d)" % (a, b, len(v)))
    for f in failures:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
