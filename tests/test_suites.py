"""The two suites: the default (fast) run keeps the representatives conftest.SLOW_SWEEPS
names, so a misspelt id cannot silently move a whole sweep out of it."""
import pytest

from conftest import SLOW_SWEEPS


def test_slow_sweeps_keep_their_representatives(request):
    if request.config.getoption("keyword") or request.config.getoption("markexpr"):
        pytest.skip("a -k / -m selection: the session holds a subset")
    ids = {item.nodeid.split("/")[-1] for item in request.session.items}
    checked = 0
    for test, keep in SLOW_SWEEPS.items():
        cases = {i for i in ids if i.startswith(test + "[") or i == test}
        if not cases and not keep:
            continue                 # wholly slow (default run) or its file not collected
        if not any(i.startswith(test.split("::")[0] + "::") for i in ids):
            continue                 # its file is not in this session
        assert {f"{test}[{k}]" for k in keep} <= cases, (test, keep, sorted(cases)[:5])
        checked += 1
    assert checked or len(ids) < 100, "no sweep's file was collected in a full session"
