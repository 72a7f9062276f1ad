"""The shared output-path checks (``output_paths.py``) and the one-line flag warnings
(``flag_warnings.py``) that every entry point uses."""

from __future__ import annotations

import io
import os
import warnings

import pytest

from megatron_auto.utils.flag_warnings import FlagWarning, one_line_flag_warnings, warn_flag
from megatron_auto.utils.output_paths import (OutputPathError, check_output_dir,
                                              check_output_file, refuse_existing,
                                              refuse_non_empty_dir)

pytestmark = pytest.mark.pure


def test_output_dir_checks_create_nothing_unless_asked(tmp_path):
    new = tmp_path / "a" / "b"
    assert check_output_dir(new, "--save") == str(new)
    assert not (tmp_path / "a").exists()  # checked through its nearest existing ancestor
    check_output_dir(new, "--save", create=True)
    assert new.is_dir() and os.listdir(new) == []  # the probe file is gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=r"^--save=.*/f: is a file, not a directory"):
        check_output_dir(tmp_path / "f", "--save")
    with pytest.raises(OutputPathError, match=r"cannot create the directory \(.*/f is a file\)"):
        check_output_dir(tmp_path / "f" / "sub", "--save")
    if os.path.isdir("/proc"):  # not writable even for root (os.access would say it is)
        with pytest.raises(OutputPathError, match="cannot create the directory"):
            check_output_dir("/proc/megatron_auto_test/x", "--save")
        with pytest.raises(OutputPathError, match="the directory is not writable"):
            check_output_dir("/proc", "--save")


def test_output_file_checks(tmp_path):
    assert check_output_file(tmp_path / "plan.json", "--plan-out") == str(tmp_path / "plan.json")
    with pytest.raises(OutputPathError, match="is a directory; give a file path"):
        check_output_file(tmp_path, "--plan-out")
    with pytest.raises(OutputPathError, match=r"the directory .*/nope does not exist; create it"):
        check_output_file(tmp_path / "nope" / "plan.json", "--plan-out")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=r"the directory .*/f is a file"):
        check_output_file(tmp_path / "f" / "plan.json", "--plan-out")
    check_output_file(tmp_path / "f", "--metrics-file", append=True)
    assert (tmp_path / "f").read_text() == "x"  # the append probe changes nothing
    if os.path.isdir("/proc"):
        with pytest.raises(OutputPathError, match="cannot write in /proc"):
            check_output_file("/proc/plan.json", "--plan-out")
    with pytest.raises(KeyError):  # the caller's error class
        check_output_file(tmp_path, "--x", KeyError)


def test_existing_outputs_need_overwrite(tmp_path):
    (tmp_path / "out.bin").write_text("x")
    refuse_existing([tmp_path / "new.bin"], "--output-prefix", overwrite=False)
    with pytest.raises(OutputPathError, match="out.bin already exists; add --overwrite to "
                                              "replace it"):
        refuse_existing([tmp_path / "out.bin"], "--output-prefix", overwrite=False)
    refuse_existing([tmp_path / "out.bin"], "--output-prefix", overwrite=True)
    refuse_non_empty_dir(tmp_path / "absent", "--save-dir", overwrite=False)
    with pytest.raises(OutputPathError, match=r"not empty \(out.bin\); add --overwrite"):
        refuse_non_empty_dir(tmp_path, "--save-dir", overwrite=False)
    refuse_non_empty_dir(tmp_path, "--save-dir", overwrite=True)


def test_flag_warnings_print_once_as_one_line():
    out = io.StringIO()
    with one_line_flag_warnings(stream=out):
        for _ in range(2):
            warn_flag("--x=1: ignored without --y")
        warn_flag("--z=2: ignored")
    assert out.getvalue() == "warning: --x=1: ignored without --y\nwarning: --z=2: ignored\n"
    hidden = io.StringIO()
    with one_line_flag_warnings(show=False, stream=hidden):  # a rank other than 0
        warn_flag("--x=1: ignored without --y")
    assert hidden.getvalue() == ""
    again = io.StringIO()
    with one_line_flag_warnings(stream=again):  # a second run in the process warns again
        warn_flag("--x=1: ignored without --y")
    assert again.getvalue() == "warning: --x=1: ignored without --y\n"
    with pytest.warns(FlagWarning, match="--x=1"):  # outside the block: an ordinary warning
        warn_flag("--x=1: ignored without --y")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with one_line_flag_warnings(stream=io.StringIO()):
            warnings.warn("other", DeprecationWarning)
    assert [str(w.message) for w in caught] == ["other"]  # other warnings pass through
