"""Horovod's `horovod.torch`, served by cohort: the same module as `cohort.horovod.torch` (docs/horovod.md).

Reached only where no real Horovod is installed (horovod/__init__.py says how that is decided). The
module object is cohort.horovod.torch itself, so `horovod.torch.X` and `cohort.horovod.torch.X` are one
object, with one state (init, process sets, handles).
"""
import sys

import cohort.horovod.torch as _served

sys.modules[__name__] = _served
