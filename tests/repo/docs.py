#!/usr/bin/env python3
"""The docs describe today's tree, and a reader finds every one of them from README.md.

  - Every file in docs/ is reachable from README.md's Documentation table: named there, or named in
    a doc that is reachable (the perf-*.md notes through docs/performance.md, say).
  - Every repository path a doc names in backquotes (`src/...`, `tests/...`, `tools/...`, ...) exists,
    as a file or folder, or as the source of a built program (`tests/comm/comm_worker` is built from
    tests/comm/comm_worker.cc); a pytest id (`tests/python/x.py::test_y`) names a test that is in the
    file. Paths with placeholders (<...>, *, {...}) are not checked.

  tests/repo/docs.py SOURCE_DIR
Every problem is one line naming file:line and exits 1.
"""
import os
import re
import sys

TOPS = "src|tests|tools|scripts|bench|examples|include|integrations|docs|fuzz|cmake"
PATH = re.compile(r"`((?:%s)/[^`\s]*)`" % TOPS)


def main():
    root = sys.argv[1]
    os.chdir(root)
    errors = []
    docs = sorted(f for f in os.listdir("docs") if os.path.isfile(os.path.join("docs", f)))
    texts = {f: open(os.path.join("docs", f), encoding="utf-8", errors="replace").read()
             for f in docs if f.endswith(".md")}

    # Reachability: README's table, then whatever the reached docs name, until nothing new.
    readme = open("README.md", encoding="utf-8").read()
    table = readme.split("## Documentation", 1)[1].split("\n## ", 1)[0] if "## Documentation" in readme else ""
    if not table:
        errors.append("README.md: no '## Documentation' section (the table of docs)")
    reached, todo = set(), [table]
    while todo:
        text = todo.pop()
        for f in docs:
            if f not in reached and re.search(r"(?<![A-Za-z0-9_.-])" + re.escape(f) + r"(?![A-Za-z0-9_-])", text):
                reached.add(f)
                if f in texts:
                    todo.append(texts[f])
    for f in docs:
        if f not in reached:
            errors.append(f"docs/{f}: not reachable from README.md's Documentation table (name it there, or in a "
                          "doc that is)")

    for f, text in texts.items():
        for lineno, line in enumerate(text.split("\n"), 1):
            for m in PATH.finditer(line):
                path = m.group(1).rstrip(".,:;)")
                if any(c in path for c in "<>*{}$") or "..." in path:
                    continue
                path = path.split("#", 1)[0].rstrip("/")
                if "::" in path:  # a pytest node id: the file, and the test in it
                    path, name = path.split("::", 1)
                    if os.path.isfile(path) and name.split("::")[-1] not in open(path, errors="replace").read():
                        errors.append(f"docs/{f}:{lineno}: names {name} in {path}, which has no such test")
                        continue
                if os.path.exists(path) or os.path.exists(path + ".cc") or os.path.exists(path + ".py"):
                    continue
                errors.append(f"docs/{f}:{lineno}: names {path}, which is not in the tree")

    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} problem(s) in docs/")
        return 1
    print(f"all {len(docs)} files in docs/ are reachable from README.md, and every path they name exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
