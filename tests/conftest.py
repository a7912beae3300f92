"""Every test process keeps remat's on-disk caches (the backend's plans, the command line's
least-peak plans) in a folder of its own, not in the user's ~/.cache: a test must not read what
an earlier run left there, nor leave files behind. A test that sets XDG_CACHE_HOME itself (with
monkeypatch) gets its own value, and this one back afterwards."""

from __future__ import annotations

import os
import shutil
import tempfile

_CACHE = tempfile.mkdtemp(prefix="remat-test-cache-")


def pytest_configure(config):
    os.environ["XDG_CACHE_HOME"] = _CACHE


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
