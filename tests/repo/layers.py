#!/usr/bin/env python3
"""The layers say what they are: code, CMake and README agree.

Each folder under src/ is one layer, a static library made by cohort_layer() (CMakeLists.txt) with
  DEPS            the layers it uses: a dependency points down only;
  API             the installed headers (include/cohort/...) it implements;
  PUBLIC_HEADERS  its headers (globs under src/<layer>/) that code outside the layer may include.
A layer's header that is not in its PUBLIC_HEADERS is private to it.

Every `#include "..."` under src/, tools/ and integrations/ is checked:
  - a layer includes only its own headers and those of the layers its DEPS reach (directly or
    through their DEPS); anything else is an upward (or sideways) edge;
  - a header of another layer must be one of that layer's public headers;
  - an include/cohort header belongs to the layer whose API names it, and counts as that layer.
tools/ and integrations/ link cohort::cohort (every layer), so only the private-header rule applies.
README.md's "Layout" table lists the layers bottom-up with the layers each depends on, as the
layers' DEPS do.

  tests/repo/layers.py SOURCE_DIR MANIFEST
MANIFEST is written at configure time (tests/repo/CMakeLists.txt), one line per layer:
  name|deps|api|public headers   (each field space-separated)
Every problem is one line naming file:line and exits 1.
"""
import fnmatch
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def read_manifest(path):
    layers = {}
    for line in open(path, encoding="utf-8"):
        line = line.rstrip("\n")
        if not line:
            continue
        name, deps, api, public = line.split("|")
        layers[name] = {
            "deps": [d.split("::", 1)[1] for d in deps.split() if d.startswith("cohort::")],
            "api": api.split(),
            "public": public.split(),
        }
    return layers


def reach(layers):
    """For each layer, every layer its DEPS reach (itself excluded)."""
    out = {}

    def walk(name, seen):
        for dep in layers[name]["deps"]:
            if dep not in seen:
                seen.add(dep)
                if dep in layers:
                    walk(dep, seen)
        return seen

    for name in layers:
        out[name] = walk(name, set())
    return out


def source_files(root, folders):
    for folder in folders:
        for base, dirs, files in os.walk(os.path.join(root, folder)):
            dirs.sort()
            for f in sorted(files):
                if f.endswith((".h", ".cc", ".cpp", ".hpp")):
                    yield os.path.relpath(os.path.join(base, f), root)


def check_readme(root, layers, errors):
    """README.md's Layout table: the layers bottom-up, each row's 'depends on' = its DEPS."""
    lines = open(os.path.join(root, "README.md"), encoding="utf-8").read().split("\n")
    try:
        start = lines.index("## Layout")
    except ValueError:
        errors.append("README.md: no '## Layout' section (the table of layers)")
        return
    rows = []
    for n in range(start + 1, len(lines)):
        if lines[n].startswith("## "):
            break
        m = re.match(r"^\|\s*`src/([a-z_]+)/`\s*\|(.*)\|(.*)\|\s*$", lines[n])
        if m:
            rows.append((n + 1, m.group(1), m.group(3)))
    listed = [name for _, name, _ in rows]
    for name in sorted(set(layers) - set(listed)):
        errors.append(f"README.md:{start + 1}: the Layout table has no row for src/{name}/")
    placed = set()
    for lineno, name, deps_cell in rows:
        if name not in layers:
            errors.append(f"README.md:{lineno}: the Layout table lists src/{name}/, which is no layer")
            continue
        said = set(re.findall(r"`?([a-z_]+)`?", deps_cell)) & set(layers)
        want = set(layers[name]["deps"]) & set(layers)
        if said != want:
            errors.append(f"README.md:{lineno}: src/{name}/ depends on {', '.join(sorted(want)) or 'no layer'} "
                          f"(DEPS in src/{name}/CMakeLists.txt), the table says {', '.join(sorted(said)) or 'none'}")
        for dep in sorted(want - placed):
            errors.append(f"README.md:{lineno}: src/{name}/ is listed below src/{dep}/, which it depends on "
                          "(the table lists the layers bottom-up)")
        placed.add(name)


def main():
    root, manifest = sys.argv[1], sys.argv[2]
    layers = read_manifest(manifest)
    below = reach(layers)
    errors = []

    # Every public-header glob names at least one header (a stale list says nothing true).
    for name, info in layers.items():
        for pattern in info["public"]:
            folder = os.path.join(root, "src", name)
            found = any(fnmatch.fnmatch(os.path.relpath(os.path.join(b, f), folder), pattern)
                        for b, _, fs in os.walk(folder) for f in fs)
            if not found:
                errors.append(f"src/{name}/CMakeLists.txt: PUBLIC_HEADERS names {pattern}, which matches no header "
                              f"in src/{name}/")

    def api_owner(path):
        for name, info in layers.items():
            if any(fnmatch.fnmatch(path, p) for p in info["api"]):
                return name
        return None

    checked = 0
    for rel in source_files(root, ["src", "tools", "integrations"]):
        parts = rel.split(os.sep)
        own = parts[1] if parts[0] == "src" and len(parts) > 2 else None  # None: tools/, integrations/
        for lineno, text in enumerate(open(os.path.join(root, rel), encoding="utf-8", errors="replace"), 1):
            m = INCLUDE.match(text)
            if not m:
                continue
            inc = m.group(1)
            checked += 1
            where = f"{rel}:{lineno}"
            first, _, rest = inc.partition("/")
            if rest and first in layers and os.path.exists(os.path.join(root, "src", inc)):
                layer, header = first, rest
                if layer == own:
                    continue
                if own is not None and layer not in below[own]:
                    errors.append(f"{where}: {own} includes {inc}, but {layer} is not below {own} "
                                  f"(src/{own}/CMakeLists.txt DEPS reach {', '.join(sorted(below[own] & set(layers))) or 'no layer'})")
                elif not any(fnmatch.fnmatch(header, p) for p in layers[layer]["public"]):
                    errors.append(f"{where}: includes {inc}, private to {layer} (not in PUBLIC_HEADERS of "
                                  f"src/{layer}/CMakeLists.txt; expose what is needed through a public header)")
                continue
            if first == "cohort":  # an installed header (include/cohort, or generated like cohort/version.h)
                owner = api_owner(inc)
                if owner is None and own is not None and os.path.exists(os.path.join(root, "include", inc)):
                    errors.append(f"{where}: {own} includes {inc}, which no layer's API names "
                                  "(the umbrella header is for code above every layer)")
                elif owner is not None and own is not None and owner != own and owner not in below[own]:
                    errors.append(f"{where}: {own} includes {inc}, the API of {owner}, which is not below {own} "
                                  f"(src/{own}/CMakeLists.txt DEPS reach {', '.join(sorted(below[own] & set(layers))) or 'no layer'})")
                continue
            # Anything else is beside the including file (tools/, integrations/): not a layer's header.

    check_readme(root, layers, errors)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} layering problem(s) (tests/repo/layers.py says what the rules are)")
        return 1
    print(f"{checked} includes in src/, tools/ and integrations/ follow the {len(layers)} layers, "
          "and README.md's Layout table agrees with their DEPS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
