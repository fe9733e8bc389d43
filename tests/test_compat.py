import warnings

import pytest
import trl

from trl_costaware import TESTED_TRL_RANGE, check_trl_version


def test_installed_trl_is_in_the_tested_range():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_trl_version(trl.__version__)


@pytest.mark.parametrize("version", ["1.15.0", "1.17.0", "2.0.0"])
def test_untested_trl_warns_naming_the_range(version):
    with pytest.warns(UserWarning, match="tested with trl>=1.16.0,<1.17.0") as record:
        assert not check_trl_version(version)
    assert version in str(record[0].message)
    assert TESTED_TRL_RANGE == (">=1.16.0", "<1.17.0")
