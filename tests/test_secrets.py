"""No secret in a config or a URL, and no URL in a message without its secrets redacted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from diloco.config import ConfigError, StateConfig, build_config, redact_url
from diloco.infra import services
from diloco.infra.store import StoreError, kvstore_spec
from diloco.ops import OpsError
from diloco.ops.ckpt import open_checkpoint, open_url
from diloco.syncer import state as state_mod

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("rediss://diloco:hunter2@redis.example:6380/0", "rediss://diloco:***@redis.example:6380/0"),
    ("redis://:hunter2@h/0", "redis://:***@h/0"),
    ("redis://hunter2@h/0", "redis://***@h/0"),                 # a lone user info may be a token
    ("redis://h/0?password=hunter2&db=1", "redis://h/0?password=***&db=1"),
    ("gs://bucket/run?X-Goog-Signature=hunter2&access_token=hunter2&alt=media",
     "gs://bucket/run?X-Goog-Signature=***&access_token=***&alt=media"),
    ("redis://h/0?q=mypassword=x", "redis://h/0?q=mypassword=x"),   # a value is not a parameter name
    ("file:///tmp/store?", "file:///tmp/store?"),                 # nothing to redact: unchanged to the character
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("key, url", [
    ("state.redis_url", "rediss://diloco:hunter2@redis.example:6380/0"),
    ("state.redis_url", "redis://redis.example:6379/0?password=hunter2"),
    ("store.url", "gs://diloco:hunter2@bucket/path"),
    ("transport.bootstrap_servers", "diloco:hunter2@broker-1:9093"),
])
def test_a_url_with_a_credential_is_refused_without_echoing_it(key, url):
    section, field = key.split(".")
    with pytest.raises(ConfigError) as err:
        build_config({section: {field: url}})
    assert key in str(err.value) and "hunter2" not in str(err.value)
    if section == "state":
        assert "state.username" in str(err.value) and "state.password_env" in str(err.value)


def test_the_readmes_redis_urls_pass_the_config_check():
    urls = re.findall(r"state\.redis_url: (\S+?)`", (ROOT / "README.md").read_text())
    assert urls
    for url in urls:
        assert build_config({"state": {"redis_url": url}}).state.redis_url == url


def test_redis_errors_redact_the_url():
    port = services.free_port()  # nothing listens there
    url = f"redis://:hunter2@127.0.0.1:{port}/0?password=hunter2"
    with pytest.raises(state_mod.StateError) as err:
        cfg = StateConfig.model_construct(redis_url=url, username=None, password_env=None, cluster=False)  # unchecked
        state_mod.wait_until_up(redis.Redis(port=port, socket_connect_timeout=0.2).ping, cfg, timeout_s=0.3)
    assert f"redis://:***@127.0.0.1:{port}/0?password=***" in str(err.value) and "hunter2" not in str(err.value)


def test_store_urls_with_credentials_are_refused_redacted(tmp_path):
    with pytest.raises(StoreError) as err:
        kvstore_spec("gs://bucket/runs?access_token=hunter2")
    assert "access_token=***" in str(err.value) and "hunter2" not in str(err.value)
    for bad in ("gs://u:hunter2@bucket/runs/r1", "s3://u:hunter2@bucket/runs/r1", "gs://u:hunter2@bucket/"):
        for opener in (open_url, open_checkpoint):
            with pytest.raises(OpsError) as err:
                opener(bad)
            assert "hunter2" not in str(err.value), (opener.__name__, bad, str(err.value))
