"""Suite-wide hooks: the session fails if a process a test started outlives the tests
(tests/process_leaks.py)."""

from tests.process_leaks import pytest_configure, pytest_runtest_protocol, pytest_sessionfinish

__all__ = ["pytest_configure", "pytest_runtest_protocol", "pytest_sessionfinish"]  # pytest finds hooks by name
