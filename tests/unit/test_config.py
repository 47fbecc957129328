from __future__ import annotations

import argparse

import pytest

from kafscale import config


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p.parse_args(argv)


def test_file_then_env_then_flags(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('bucket = "from-file"\nlinger_ms = 7\nauto_create_topics = true\n')
    cfg = config.load(parse(["--config", str(f)]), environ={})
    assert (cfg.bucket, cfg.linger_ms, cfg.auto_create_topics) == ("from-file", 7, True)
    cfg = config.load(parse(["--config", str(f)]), environ={"KAFSCALE_BUCKET": "from-env"})
    assert cfg.bucket == "from-env"
    cfg = config.load(parse(["--config", str(f), "--bucket", "from-flag", "--no-auto-create-topics"]),
                      environ={"KAFSCALE_BUCKET": "from-env"})
    assert (cfg.bucket, cfg.auto_create_topics) == ("from-flag", False)


def test_defaults_and_addresses():
    cfg = config.load(parse([]), environ={})
    assert cfg.auto_create_topics is False
    assert cfg.advertised_addr() == ("127.0.0.1", 9092)
    cfg = config.load(parse(["--advertised", "b1.example:19092"]), environ={})
    assert cfg.advertised_addr() == ("b1.example", 19092)


def test_unknown_file_key(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text("no_such_option = 1\n")
    with pytest.raises(ValueError, match="no_such_option"):
        config.load(parse(["--config", str(f)]), environ={})


def test_receive_buffer_is_minus_one_or_a_socket_option_int():
    assert config.load(environ={"KAFSCALE_SOCKET_RECEIVE_BUFFER_BYTES": "-1"}).socket_receive_buffer_bytes == -1
    for bad in ("0", "-2", str(2**31)):
        with pytest.raises(config.ConfigError, match="socket_receive_buffer_bytes"):
            config.load(environ={"KAFSCALE_SOCKET_RECEIVE_BUFFER_BYTES": bad})


def test_configuration_reference_lists_every_field():
    """docs/configuration.md names every flag and variable with its default."""
    import dataclasses
    from pathlib import Path

    from kafscale.config import Config

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for f in dataclasses.fields(Config):
        row = f"| `--{f.name.replace('_', '-')}` | `KAFSCALE_{f.name.upper()}` | `{f.default!r}` |"
        assert row in doc, f"docs/configuration.md is missing or out of date for {f.name}"
