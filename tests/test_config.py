import pytest

from agent.config import ConfigError, load_config, parse_listen


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
        ("interval_seconds = -1", "interval_seconds = -1: Input should be greater than 0"),
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
