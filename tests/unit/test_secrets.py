"""Secrets from the environment and from files: epp.secrets, the configuration keys that use it
(``*_file`` twins, ``${NAME}``, ``request.api_keys_file``) and ``epp serve``'s Redis URL."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.connection import parse_url

from epp.cli import _redis_url, build_parser
from epp.config import ConfigError, StoreConfig, parse_config
from epp.secrets import MAX_SECRET_BYTES, SecretError, expand, read_file

BASE: dict[str, Any] = {
    "models": {"m": {"pools": ["p"]}},
    "pools": {"p": {"endpoints": ["10.0.0.1:8000"]}},
}
SECRET = "s3cr:t/@%pw"


def config(**sections: Any) -> Any:
    return parse_config({**BASE, **sections}, source="epp.yaml")


def errors(**sections: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config(**sections)
    return info.value.errors


def secret_file(tmp_path: Path, text: str, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- epp.secrets


def test_expand_replaces_each_reference() -> None:
    env = {"USER_": "epp", "PW": SECRET}
    assert (
        expand("redis://${USER_}:${PW}@redis:6379/0", env) == f"redis://epp:{SECRET}@redis:6379/0"
    )
    assert expand("no $reference {here} $", env) == "no $reference {here} $"


def test_expand_refuses_unset_variables_and_bad_names() -> None:
    with pytest.raises(SecretError, match="environment variable A, B is not set"):
        expand("${A}${B}", {})
    with pytest.raises(SecretError, match="not an environment variable reference"):
        expand("${1X}", {"1X": "v"})


def test_expand_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_TEST_SECRET", SECRET)
    assert expand("${EPP_TEST_SECRET}") == SECRET


def test_read_file_drops_one_trailing_newline(tmp_path: Path) -> None:
    assert read_file(secret_file(tmp_path, SECRET + "\n")) == SECRET
    assert read_file(secret_file(tmp_path, SECRET + "\r\n")) == SECRET
    assert read_file(secret_file(tmp_path, SECRET)) == SECRET
    assert read_file(secret_file(tmp_path, " a b \n\n")) == " a b \n"


@pytest.mark.parametrize(
    ("content", "problem"),
    [("", "is empty"), ("\n", "is empty"), ("x" * (MAX_SECRET_BYTES + 1), "larger than")],
)
def test_read_file_refuses_what_is_no_secret(tmp_path: Path, content: str, problem: str) -> None:
    with pytest.raises(SecretError, match=problem):
        read_file(secret_file(tmp_path, content))


def test_read_file_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match=r"cannot read .*nope: No such file"):
        read_file(str(tmp_path / "nope"))


# ------------------------------------------------------------------- configuration keys


@pytest.mark.parametrize(
    ("section", "key"), [("server", "debug_token"), ("routing", "explain_token")]
)
def test_tokens_come_from_env_or_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str, key: str
) -> None:
    monkeypatch.setenv("EPP_TEST_TOKEN", SECRET)
    from_env = config(**{section: {key: "${EPP_TEST_TOKEN}"}})
    from_file = config(**{section: {f"{key}_file": secret_file(tmp_path, SECRET + "\n")}})
    inline = config(**{section: {key: SECRET}})
    for loaded in (from_env, from_file, inline):
        assert getattr(getattr(loaded, section), key) == SECRET
    # Nothing prints a token by accident (a log line with the whole section, say).
    assert SECRET not in repr(from_file)


def test_a_key_and_its_file_twin_together_are_an_error(tmp_path: Path) -> None:
    path = secret_file(tmp_path, SECRET)
    found = errors(server={"debug_token": "x", "debug_token_file": path})
    assert found == ["epp.yaml: server.debug_token_file: must not be set together with debug_token"]


def test_unresolvable_secrets_are_reported_without_the_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPP_TEST_UNSET", raising=False)
    found = errors(
        server={"debug_token": "${EPP_TEST_UNSET}"},
        routing={"explain_token_file": str(tmp_path / "missing")},
        store={"redis_password_file": secret_file(tmp_path, "")},
    )
    assert found == [
        "epp.yaml: server.debug_token: environment variable EPP_TEST_UNSET is not set",
        f"epp.yaml: routing.explain_token_file: cannot read {tmp_path / 'missing'}: "
        "No such file or directory",
        f"epp.yaml: store.redis_password_file: {tmp_path / 'secret'} is empty",
    ]


def test_a_secret_of_the_wrong_type_is_not_echoed() -> None:
    (problem,) = errors(store={"backend": "redis", "redis_password": 987654321})
    assert problem == "epp.yaml: store.redis_password: must be a string, got int"


def test_redis_credentials_from_files_are_merged_into_the_url(tmp_path: Path) -> None:
    loaded = config(
        store={
            "backend": "redis",
            "redis_url": "rediss://redis:6380/2?ssl_ca_certs=/etc/epp/redis/ca.pem",
            "redis_username_file": secret_file(tmp_path, "epp\n", "user"),
            "redis_password_file": secret_file(tmp_path, SECRET + "\n", "password"),
        }
    )
    # As redis-py reads the URL: what the client authenticates and verifies with.
    options = parse_url(loaded.store.redis_url)
    assert (options["username"], options["password"]) == ("epp", SECRET)
    assert (options["host"], options["port"], options["db"]) == ("redis", 6380, 2)
    assert options["ssl_ca_certs"] == "/etc/epp/redis/ca.pem"
    assert SECRET not in repr(loaded.store)


def test_redis_password_alone_authenticates_the_default_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EPP_TEST_REDIS_PASSWORD", SECRET)
    loaded = config(store={"backend": "redis", "redis_password": "${EPP_TEST_REDIS_PASSWORD}"})
    options = parse_url(loaded.store.redis_url)
    assert "username" not in options
    assert options["password"] == SECRET


def test_redis_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a URL the password is percent-encoded; redis_password takes it as it is.
    monkeypatch.setenv("EPP_TEST_REDIS_URL", "redis://:s3cr%3At%2F%40%25pw@redis:6379/0")
    loaded = config(store={"backend": "redis", "redis_url": "${EPP_TEST_REDIS_URL}"})
    assert parse_url(loaded.store.redis_url)["password"] == SECRET


@pytest.mark.parametrize(
    ("store", "problem"),
    [
        (
            {"redis_url": "redis://:pw@redis:6379/0", "redis_password": "other"},
            "store.redis_password: must not be set when redis_url carries a password",
        ),
        (
            {"redis_url": "redis://redis:6379/0?password=pw", "redis_password": "other"},
            "store.redis_password: must not be set when redis_url carries a password",
        ),
        ({"redis_username": "epp"}, "store.redis_username: needs redis_password"),
        ({"redis_url": "http://redis"}, "store.redis_url: must start with one of"),
    ],
)
def test_contradicting_redis_credentials_are_refused(store: dict[str, str], problem: str) -> None:
    (found,) = errors(store={"backend": "redis", **store})
    assert problem in found
    assert "pw" not in found


def test_api_keys_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_TEST_KEY_B", "key-b")
    path = secret_file(
        tmp_path,
        "key-a: {tenant: team-a, objective: batch}\n${EPP_TEST_KEY_B}: {tenant: team-b}\n",
    )
    request = {"objectives": {"batch": 0}, "api_keys_file": path}
    keys = config(request=request).request.api_keys
    assert {k: (v.tenant, v.objective) for k, v in keys.items()} == {
        "key-a": ("team-a", "batch"),
        "key-b": ("team-b", None),
    }


def test_api_key_problems_never_echo_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPP_TEST_UNSET", raising=False)
    path = secret_file(
        tmp_path, "sk-first: {tenant: a}\n${EPP_TEST_UNSET}: {tenant: b}\nsk-third: {}\n"
    )
    found = errors(request={"api_keys_file": path})
    assert found == [
        "epp.yaml: request.api_keys[1]: environment variable EPP_TEST_UNSET is not set",
        "epp.yaml: request.api_keys[2].tenant: must be a non-empty string (the key's fairness id)",
    ]
    broken = secret_file(tmp_path, "sk-first: {tenant: a}\nsk-second: [unclosed\n", "broken")
    (problem,) = errors(request={"api_keys_file": broken})
    assert problem == f"epp.yaml: request.api_keys_file: {broken} is not valid YAML (line 2)"
    assert "sk-" not in problem


def test_api_keys_inline_and_from_a_file_together_are_an_error(tmp_path: Path) -> None:
    path = secret_file(tmp_path, "k: {tenant: a}\n")
    (problem,) = errors(request={"api_keys": {"k2": {"tenant": "b"}}, "api_keys_file": path})
    assert problem == "epp.yaml: request.api_keys_file: must not be set together with api_keys"


# ------------------------------------------------------------------ epp serve --redis-url


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--config", "epp.yaml", *argv])


def test_redis_url_from_flag_file_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EPP_REDIS_URL", "redis://from-env:6379/0")
    assert _redis_url(serve_args()) == "redis://from-env:6379/0"
    path = secret_file(tmp_path, f"redis://:{SECRET}@from-file:6379/0\n")
    assert _redis_url(serve_args("--redis-url-file", path)) == f"redis://:{SECRET}@from-file:6379/0"
    assert _redis_url(serve_args("--redis-url", "redis://flag:6379/0")) == "redis://flag:6379/0"
    assert capsys.readouterr().err == ""
    # A password on the command line works, with a warning: the process list shows it.
    assert _redis_url(serve_args("--redis-url", "redis://:pw@flag:6379/0"))
    assert "process list" in capsys.readouterr().err
    monkeypatch.delenv("EPP_REDIS_URL")
    assert _redis_url(serve_args()) is None
    with pytest.raises(SystemExit):
        serve_args("--redis-url", "redis://a", "--redis-url-file", path)


def test_a_command_line_url_keeps_the_configured_credentials() -> None:
    store = config(
        store={"backend": "memory", "redis_username": "epp", "redis_password": SECRET}
    ).store
    moved = store.with_url("rediss://elsewhere:6380/1")
    assert moved.backend == "redis"
    options = parse_url(moved.redis_url)
    assert (options["host"], options["username"], options["password"]) == (
        "elsewhere",
        "epp",
        SECRET,
    )
    # A URL with its own password keeps it.
    own = store.with_url("redis://:own@elsewhere:6379/0")
    assert parse_url(own.redis_url)["password"] == "own"
    assert StoreConfig().with_url("redis://x:1/0").redis_url == "redis://x:1/0"
