"""The exception family: one root, exported whole from the bottom layer and from offload."""
import inspect

import csrc
import csrc.errors
import offload


def _family():
    return {name for name, obj in inspect.getmembers(csrc.errors, inspect.isclass)
            if issubclass(obj, csrc.errors.OffloadError)}


def test_every_error_is_exported_from_csrc_and_offload():
    family = _family()
    assert {"OffloadError", "ConfigError", "TierFullError", "ProtocolError"} <= family
    assert family <= set(csrc.__all__)
    assert family <= set(offload.__all__)
    for name in family:
        assert getattr(offload, name) is getattr(csrc.errors, name)


def test_errno_becomes_oserror_naming_the_call():
    try:
        csrc.raise_errno(-28, "ofl_aio_submit")
    except OSError as exc:
        assert exc.errno == 28 and "ofl_aio_submit" in str(exc)
    else:
        raise AssertionError("raise_errno(-28) did not raise")
    csrc.raise_errno(0, "fine")
