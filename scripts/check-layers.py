#!/usr/bin/env python3
"""Checks the layering of src/: every folder's README.md ends its contract
with a line "May include: a, b, ..." naming the folders (and "proto" for the
generated protobuf-c header, "public" for include/cohort.h) its files may
include. This script fails when a file includes outside that list, when an
include names no folder, when the allowed folders form a circle, or when
the modules' own include graph does. make test runs it.

    scripts/check-layers.py [ROOT]
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), ".."))
SRC = os.path.join(ROOT, "src")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
PSEUDO = {"cohort.pb-c.h": "proto", "cohort.h": "public"}


def contracts():
    allowed = {}
    for layer in sorted(os.listdir(SRC)):
        readme = os.path.join(SRC, layer, "README.md")
        if not os.path.isdir(os.path.join(SRC, layer)):
            continue
        if not os.path.exists(readme):
            yield f"src/{layer}/ has no README.md stating its contract"
            continue
        m = re.search(r"^May include: (.*)$", open(readme).read(), re.M)
        if not m:
            yield f"src/{layer}/README.md has no 'May include:' line"
            continue
        words = m.group(1).strip()
        allowed[layer] = set() if words == "nothing of cohort's" else \
            {w.strip() for w in words.split(",")}
    contracts.allowed = allowed


def cycle(graph):
    """One cycle of graph (node -> set of nodes) as a list, or None."""
    state = {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                c = visit(m, path + [m])
                if c:
                    return c
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n, [n])
            if c:
                return c
    return None


def main():
    errors = list(contracts())
    allowed = contracts.allowed
    for layer, deps in allowed.items():
        for d in deps - set(allowed) - {"proto", "public"}:
            errors.append(f"src/{layer}/README.md names '{d}', which is no folder of src/")
    c = cycle(allowed)
    if c:
        errors.append("the folders' contracts form a circle: " + " -> ".join(c))
    modules = {}
    for layer in allowed:
        for name in sorted(os.listdir(os.path.join(SRC, layer))):
            if not name.endswith((".c", ".h")):
                continue
            path = f"{layer}/{name}"
            text = open(os.path.join(SRC, path)).read()
            mod = path[:-2]
            for inc in INCLUDE.findall(text):
                if inc in PSEUDO:
                    target = PSEUDO[inc]
                    if target not in allowed[layer]:
                        errors.append(f"src/{path} includes {inc}, but src/{layer}/ may not")
                    continue
                if "/" not in inc:
                    errors.append(f"src/{path} includes \"{inc}\" without its folder")
                    continue
                to = inc.split("/")[0]
                if not os.path.exists(os.path.join(SRC, inc)):
                    errors.append(f"src/{path} includes {inc}, which does not exist")
                    continue
                if to != layer and to not in allowed[layer]:
                    errors.append(f"src/{path} includes {inc}: src/{layer}/ may include only "
                                  + (", ".join(sorted(allowed[layer])) or "itself"))
                if inc[:-2] != mod:
                    modules.setdefault(mod, set()).add(inc[:-2])
    c = cycle(modules)
    if c:
        errors.append("the modules include each other in a circle: " + " -> ".join(c))
    for e in errors:
        print("check-layers: " + e, file=sys.stderr)
    if errors:
        return 1
    print(f"check-layers: {len(modules)} modules in {len(allowed)} folders, no upward include, "
          "no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
