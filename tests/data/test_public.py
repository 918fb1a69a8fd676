"""Pins fsg.data's public names."""

import fsg
import fsg.data


def test_data_public_names():
    assert sorted(fsg.data.__all__) == sorted(
        ["DataError", "Loader", "TokenFile", "Tokens", "permute", "prepare", "read_layout", "write_tokens"]
    )
    for name in fsg.data.__all__:
        assert getattr(fsg.data, name) is not None
    assert issubclass(fsg.data.DataError, fsg.FsgError) and issubclass(fsg.data.DataError, ValueError)
