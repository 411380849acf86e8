"""python3 -m cohort.launch ARGS: `python -m torch.distributed.launch ARGS`, run by cohort.

It runs the environment's `cohort launch ARGS` (docs/launcher.md, "torch.distributed.launch's line"):
the same flags, every worker given --local_rank=N (torch 2.x: --local-rank=N) unless --use_env. As
torch.distributed.launch runs the script with the interpreter that runs it (sys.executable), so does
this one, unless COHORT_PYTHON or --python names another.
"""
import os
import shutil
import sys


def cohort_tool():
    """The `cohort` tool: the wheel installs it as bin/cohort beside this interpreter, else PATH's."""
    beside = os.path.join(os.path.dirname(sys.executable), "cohort")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("cohort")
    if found:
        return found
    sys.exit(f"cohort.launch: no cohort tool beside {sys.executable} nor on PATH (pip install the cohort wheel)")


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    tool = cohort_tool()
    os.environ.setdefault("COHORT_PYTHON", sys.executable)
    os.execv(tool, [tool, "launch", *args])


if __name__ == "__main__":
    main()
