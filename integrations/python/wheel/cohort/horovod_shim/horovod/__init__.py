"""`import horovod.torch as hvd` served by cohort where Horovod itself is not installed (docs/horovod.md).

This package never shadows a real Horovod: when another `horovod` package is on sys.path (before or
after this one), that one is loaded in this one's place and `import horovod.torch` gets Horovod's own.
Only where none is found does `horovod.torch` name cohort's implementation, `cohort.horovod.torch`.
COHORT_HOROVOD=1 asks for cohort's even when a real Horovod is installed (and COHORT_HOROVOD=0 refuses
cohort's: `import horovod` then fails as it would without this package).
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))


def _other_horovod():
    """The spec of the first `horovod` package on sys.path that is not this one (the build tree and the
    source folder may both be on the path, one through a link: real paths are compared), or None."""
    for entry in sys.path:
        spec = importlib.machinery.PathFinder.find_spec(__name__, [entry or os.getcwd()])
        if spec is None or spec.loader is None or not spec.submodule_search_locations:
            continue  # not there, or a namespace portion (a folder without __init__.py)
        if any(os.path.realpath(p) == _HERE for p in spec.submodule_search_locations):
            continue
        return spec
    return None


_choice = os.environ.get("COHORT_HOROVOD", "")
if _choice not in ("", "0", "1"):
    raise ImportError(f"COHORT_HOROVOD={_choice}: expected 1 (cohort's horovod even where Horovod is installed) "
                      "or 0 (never cohort's)")
_real = None if _choice == "1" else _other_horovod()
if _real is not None:
    # Horovod is installed: it takes this module's place, so that horovod.torch, horovod.runner, ... are its own.
    _module = importlib.util.module_from_spec(_real)
    sys.modules[__name__] = _module
    try:
        _real.loader.exec_module(_module)
    except BaseException:
        sys.modules.pop(__name__, None)
        raise
elif _choice == "0":
    sys.modules.pop(__name__, None)
    raise ImportError("COHORT_HOROVOD=0: cohort's horovod is not used, and no other horovod package is on sys.path")
else:
    # cohort's: horovod.torch is cohort.horovod.torch (horovod/torch/__init__.py).
    __version__ = "cohort"
    SERVED_BY = "cohort"
