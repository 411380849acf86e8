"""Horovod's API served by cohort: `cohort.horovod.torch` is Horovod's `horovod.torch` (docs/horovod.md)."""
