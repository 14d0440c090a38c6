"""What hvdp.spark and hvdp.ray do on the driver before any cluster is involved, in-process."""

from __future__ import annotations

import functools
import os

import pytest

import hvdp.spark
from hvdp._launch import call_by_name, check_main_guard, training_function
from hvdp.core.errors import ConfigError


def test_a_function_goes_to_the_workers_as_it_is():
    assert training_function(len, "x") is len


def test_a_name_is_imported_only_when_the_worker_calls_it():
    fn = training_function("os.path:join", "x")
    assert isinstance(fn, functools.partial) and fn("a", "b") == os.path.join("a", "b")


@pytest.mark.parametrize("bad", ["os.path.join", "os:", ":join", "a:b:c", 3, None])
def test_a_train_fn_that_is_neither_is_refused(bad):
    with pytest.raises(ConfigError, match=rf"hvdp.ray.run: train_fn={bad!r} is neither a function nor"):
        training_function(bad, "hvdp.ray.run")


@pytest.mark.parametrize("target", ["no_such_module_here:train", "os.path:no_such_function"])
def test_a_name_the_worker_cannot_import_says_where_it_must_be(target):
    with pytest.raises(ConfigError, match=rf"train_fn='{target}': cannot import it on this worker .*PYTHONPATH"):
        call_by_name(target)


def test_a_launch_from_a_function_or_from_pytest_passes_the_guard_check():
    # pytest's own __main__ calls it under a main guard, and this test is not module-level code
    check_main_guard("hvdp.spark.run", "why", always=True)


def test_java_is_java_home_first_then_path(tmp_path):
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "java").write_text("#!/bin/sh\n")
    (home / "bin" / "java").chmod(0o755)
    assert hvdp.spark.java({"JAVA_HOME": str(home), "PATH": ""}) == str(home / "bin" / "java")
    assert hvdp.spark.java({"JAVA_HOME": str(tmp_path / "none"), "PATH": str(home / "bin")}) is None
    assert hvdp.spark.java({"PATH": str(home / "bin")}) == str(home / "bin" / "java")
    assert hvdp.spark.java({"PATH": str(tmp_path)}) is None
