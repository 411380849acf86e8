"""Stand-in for the `expecttest` package, which Debian 12 does not package and torch.testing imports.

torch.testing._internal.common_utils needs `expecttest.TestCase` (a unittest.TestCase with
assertExpectedInline) and `expecttest.ACCEPT`. The distributed suite never calls assertExpectedInline;
if a test ever does, it fails with this message rather than passing.
"""
import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):  # noqa: N802 (the upstream name)
        raise AssertionError("assertExpectedInline needs the real expecttest package, which is not installed")
