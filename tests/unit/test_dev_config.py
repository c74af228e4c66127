"""``epp dev --config FILE`` (``make run CONFIG=FILE``): a file's sections laid over the local
stack's configuration, refused with the key path before anything starts when invalid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from epp.config import ConfigError, parse_config
from epp.devstack import Stack, dev_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_sections_merge_over_the_stack(tmp_path: Path) -> None:
    path = tmp_path / "extra.yaml"
    path.write_text("routing: {explain: true}\nserver: {log_level: debug}\n")
    stack = Stack(tmp_path, config_extra=dev_overrides(path))
    config = stack.epp_config()
    assert config["routing"] == {"explain": True}
    # A mapping is merged key by key: the stack's own server keys stay.
    assert config["server"]["log_level"] == "debug"
    assert config["server"]["host"] == "127.0.0.1"
    assert config["models"] == {"tiny": {"pools": ["main"]}}
    assert parse_config(config).routing.explain is True


def test_the_shipped_example_turns_explain_on(tmp_path: Path) -> None:
    overrides = dev_overrides(ROOT / "deploy" / "dev" / "explain.yaml")
    assert parse_config(Stack(tmp_path, config_extra=overrides).epp_config()).routing.explain


@pytest.mark.parametrize(
    ("text", "expected"),
    [("[1, 2]\n", "must be a mapping"), ("routing: {explain: [\n", "not valid YAML")],
)
def test_a_file_that_is_no_configuration_is_refused(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        dev_overrides(path)
    assert expected in raised.value.errors[0]


def test_epp_dev_refuses_an_invalid_section_before_starting(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("routing: {explain: 3}\n")
    run = subprocess.run(
        [sys.executable, "-m", "epp", "dev", "--config", str(path), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "routing.explain" in run.stderr
    assert not (tmp_path / "epp.yaml").exists()  # nothing was started or written
