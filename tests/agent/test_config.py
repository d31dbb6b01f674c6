import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmon.agent.config import ConfigError, load_config, parse_listen
from tests.support.parser_properties import mutated


def test_no_file_no_environment_gives_defaults():
    config = load_config(environ={})
    assert config.listen == "127.0.0.1:9787"
    assert config.interval_seconds == 1.0
    assert config.paths.procfs == "/proc"
    assert config.collector("gpu").enabled


def test_flags_beat_environment_beat_file(tmp_path):
    path = tmp_path / "hybridmon.toml"
    path.write_text('listen = "127.0.0.1:1111"\ninterval_seconds = 2\n[paths]\nprocfs = "/file/proc"\n')
    config = load_config(
        path,
        environ={"HYBRIDMON_LISTEN": "127.0.0.1:2222", "HYBRIDMON_PATHS__SYSFS": "/env/sys"},
        overrides={"listen": "127.0.0.1:3333", "paths.procfs": None},
    )
    assert config.listen == "127.0.0.1:3333"
    assert config.interval_seconds == 2
    assert config.paths.procfs == "/file/proc"
    assert config.paths.sysfs == "/env/sys"


def test_environment_lists_are_json():
    config = load_config(environ={"HYBRIDMON_PROCESS__PIDS": "[10, 20]"})
    assert config.process.pids == (10, 20)


@pytest.mark.parametrize(
    "toml, expected",
    [
        ("interval_seconds = -1", "interval_seconds = -1: Input should be greater than or equal to 0.1"),
        ("intervl_seconds = 1", "intervl_seconds: unknown key"),
        ('listen = "9787"', "listen = '9787'"),
        ('listen = "127.0.0.1:70000"', "port 70000 is outside 1-65535"),
        ('[process]\ncmdline_patterns = ["vllm("]', "is not a regular expression"),
        ("[collectors.gpu]\ninterval_seconds = 0", "collectors.gpu.interval_seconds = 0"),
    ],
)
def test_bad_values_name_the_key_value_and_file(tmp_path, toml, expected):
    path = tmp_path / "bad.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert expected in str(caught.value)
    assert str(path) in str(caught.value)


def test_malformed_toml_and_missing_file_are_clear(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("listen = \n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


def test_bad_environment_value_says_it_came_from_the_environment():
    with pytest.raises(ConfigError, match=r"history_seconds = 'soon'.*\(from environment\)"):
        load_config(environ={"HYBRIDMON_HISTORY_SECONDS": "soon"})


@pytest.mark.parametrize(
    "listen, expected",
    [("127.0.0.1:9787", ("127.0.0.1", 9787)), ("[::1]:9000", ("::1", 9000)), ("localhost:80", ("localhost", 80))],
)
def test_parse_listen(listen, expected):
    assert parse_listen(listen) == expected


# Too small an interval or timeout is a busy loop, not a faster agent (issue 11, item 12): each
# key with a value just under its bound, and 1e-9, is refused with the key and the bound named.
TOO_SMALL = [
    ("interval_seconds", "", "interval_seconds", 0.1),
    ("collectors.gpu.interval_seconds", "[collectors.gpu]\n", "interval_seconds", 0.1),
    ("collectors.process_numa.interval_seconds", "[collectors.process_numa]\n", "interval_seconds", 0.1),
    ("process.discovery_interval_seconds", "[process]\n", "discovery_interval_seconds", 1),
    ("inference.discovery_interval_seconds", "[inference]\n", "discovery_interval_seconds", 1),
    ("inference.timeout_seconds", "[inference]\n", "timeout_seconds", 0.1),
    ("detectors.evaluation_interval_seconds", "[detectors]\n", "evaluation_interval_seconds", 1),
    ("alerting.push_interval_seconds", "[alerting]\n", "push_interval_seconds", 1),
    ("alerting.push_timeout_seconds", "[alerting]\n", "push_timeout_seconds", 0.1),
    ("bench.max_seconds", "[bench]\n", "max_seconds", 1),
]


@pytest.mark.parametrize("dotted, table, leaf, bound", TOO_SMALL, ids=[row[0] for row in TOO_SMALL])
@pytest.mark.parametrize("how_small", [1e-9, "just under"])
def test_too_small_intervals_and_timeouts_are_refused_with_the_key(tmp_path, dotted, table, leaf, bound,
                                                                    how_small):
    value = bound * 0.99 if how_small == "just under" else how_small
    path = tmp_path / "fast.toml"
    path.write_text(f"{table}{leaf} = {value!r}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert f"{dotted} = {value!r}: Input should be greater than or equal to {bound}" in str(caught.value)
    assert str(path) in str(caught.value)
    path.write_text(f"{table}{leaf} = {bound!r}\n")  # the bound itself is allowed
    config = load_config(path, environ={})
    node = config.model_dump()
    for part in dotted.split("."):
        node = node[part]
    assert node == bound


def test_non_utf8_config_file_says_so_without_a_traceback(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[alerting]\nlabels = { site = "Düsseldorf" }\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.toml is not UTF-8 text, which TOML requires: byte 0xfc at line 2, column 21"):
        load_config(path, environ={})


def test_deeply_nested_values_are_refused_clearly(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("[process]\npids = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match="nests arrays or tables too deeply"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match="HYBRIDMON_PROCESS__PIDS: its JSON value is nested too deeply"):
        load_config(environ={"HYBRIDMON_PROCESS__PIDS": "[" * 50_000 + "]" * 50_000})


@pytest.mark.parametrize("order", ["table key first", "value first"])
def test_a_key_given_as_both_value_and_table_is_one_clear_error_in_any_order(order):
    items = [("HYBRIDMON_PATHS__PROCFS", "/host/proc"), ("HYBRIDMON_PATHS", "x")]
    environ = dict(items if order == "table key first" else items[::-1])
    with pytest.raises(ConfigError) as caught:
        load_config(environ=environ)
    assert str(caught.value) == (
        "environment: HYBRIDMON_PATHS gives paths a value while HYBRIDMON_PATHS__PROCFS sets a key "
        "inside it; paths is either a value or a table, set one of them")


def test_environment_names_that_differ_in_case_only_are_refused():
    with pytest.raises(ConfigError, match="HYBRIDMON_PATHS__PROCFS and HYBRIDMON_paths__procfs both set paths.procfs"):
        load_config(environ={"HYBRIDMON_paths__procfs": "/a", "HYBRIDMON_PATHS__PROCFS": "/b"})


@pytest.mark.parametrize("name", ["HYBRIDMON_PATHS____PROCFS", "HYBRIDMON_", "HYBRIDMON___PROCFS"])
def test_an_environment_name_with_an_empty_key_is_refused(name):
    with pytest.raises(ConfigError, match=f"environment variable {name}: not HYBRIDMON_<KEY>"):
        load_config(environ={name: "/a"})


def test_a_huge_bad_value_is_shortened_in_the_message():
    with pytest.raises(ConfigError) as caught:
        load_config(environ={"HYBRIDMON_LOG_LEVEL": "x" * 1_000_000})
    assert len(str(caught.value)) < 400 and "(1000002 characters)" in str(caught.value)


# Property tests (issue 11, item 13): whatever the environment or the file holds, loading ends in a
# config or a ConfigError, and the same environment in another order ends the same way.
_KEY_PARTS = st.sampled_from(["paths", "procfs", "sysfs", "interval_seconds", "process", "pids", "collectors",
                              "gpu", "enabled", "alerting", "labels", "inference", "endpoints", "listen",
                              "log_level", "PATHS", "x", "", "_"])
_ENV_NAMES = st.lists(_KEY_PARTS, min_size=1, max_size=3).map(lambda parts: "HYBRIDMON_" + "__".join(parts))
_JSON = st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=10),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=10)
_ENV_VALUES = st.one_of(st.text(max_size=30), _JSON.map(json.dumps),
                        st.sampled_from(["NaN", "Infinity", "-Infinity", "1e-9", "1e308", "[", "{}", "/proc",
                                         '["http://127.0.0.1:9093"]', "\udcff"]))


def _outcome(load) -> tuple[str, object]:
    try:
        return "config", load().model_dump()
    except ConfigError as error:
        return "error", str(error)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_ENV_NAMES, _ENV_VALUES, max_size=6))
def test_any_environment_gives_a_config_or_a_config_error_whatever_its_order(environ):
    forward = _outcome(lambda: load_config(environ=environ))
    backward = _outcome(lambda: load_config(environ=dict(reversed(list(environ.items())))))
    assert forward == backward


_VALID_FILE = (
    'listen = "127.0.0.1:9787"\ninterval_seconds = 1.0\n[paths]\nprocfs = "/proc"\n[process]\npids = [1, 2]\n'
    '[alerting]\nlabels = { site = "a" }\n[collectors.gpu]\ninterval_seconds = 2\n'
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), mutated(_VALID_FILE).map(lambda text: text.encode("utf-8", "surrogatepass")),
                 st.tuples(st.just(_VALID_FILE.encode()), st.binary(min_size=1, max_size=4), st.integers(0, len(_VALID_FILE)))
                 .map(lambda parts: parts[0][:parts[2]] + parts[1] + parts[0][parts[2]:])))
def test_any_file_gives_a_config_or_a_config_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("fuzz") / "hybridmon.toml"
    path.write_bytes(content)
    kind, _ = _outcome(lambda: load_config(path, environ={}))
    assert kind in ("config", "error")
