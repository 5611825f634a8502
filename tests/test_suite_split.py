"""How the suite splits over pytest-xdist workers (tests/conftest.py): the tests that share an
expensive fixture carry one xdist group, and under `--dist loadgroup` (make test) their ids carry
it too, which is what keeps them on one worker."""

import pytest

from conftest import xdist_group_of


def test_tests_sharing_an_expensive_fixture_share_a_group(request):
    items = request.session.items
    smollm2 = [i for i in items if "smollm2" in i.fixturenames]
    dpo = [i for i in items if i.module.__name__ == "test_dpo" and "run_a" in i.fixturenames]
    plain = [i for i in items if i.name == "test_tests_sharing_an_expensive_fixture_share_a_group"]
    if not (smollm2 and dpo):
        pytest.skip("needs tests/test_import_model.py and tests/test_dpo.py collected beside it")
    assert {xdist_group_of(i) for i in smollm2} == {"smollm2"}
    assert {xdist_group_of(i) for i in dpo} == {"test_dpo"}  # a module-scoped fixture of its own
    assert len(plain) == 1 and xdist_group_of(plain[0]) is None  # conftest's cheap session fixtures group nothing
    for item in smollm2 + dpo:
        assert [m.args for m in item.iter_markers("xdist_group")] == [(xdist_group_of(item),)]
        assert (item.get_closest_marker("real_model") is not None) == (item in smollm2)  # -m "not real_model"
        if request.config.getoption("loadgroup", False):  # on an xdist worker under --dist loadgroup
            assert item.nodeid.endswith(f"@{xdist_group_of(item)}"), item.nodeid
