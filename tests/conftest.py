"""Suite-wide hooks: the session fails if a process a test started outlives the tests
(harness/process_leaks.py)."""

from harness.process_leaks import pytest_configure, pytest_runtest_protocol, pytest_sessionfinish

__all__ = ["pytest_configure", "pytest_runtest_protocol", "pytest_sessionfinish"]  # pytest finds hooks by name
