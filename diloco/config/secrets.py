"""Credentials in config values: redacting URLs for logs and errors, and reading secrets from the environment."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from diloco.config.sections import ConfigError

# query parameters whose values are secrets: password, pwd, token, secret, signature, credential, api/access keys
_SECRET_PARAM = re.compile(r"(^|&)([^&=]*(?:pass|pwd|token|secret|sig|credential|api_?key|access_?key)[^&=]*)=[^&]*",
                           re.IGNORECASE)


def redact_url(url: str) -> str:
    """`url` as logs and errors may show it: the password of its user info (or a user info with no
    password, which may be a token) and the values of secret-like query parameters become ***.
    A URL with none of these comes back unchanged, character for character."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, _SECRET_PARAM.sub(r"\1\2=***", parts.query)
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"***@{host}"
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return parts._replace(netloc=netloc, query=query).geturl()


def _without_credentials(url: str, instead: str) -> str:
    if redact_url(url) != url:
        raise ValueError(f"carries a credential (user info or a password/token parameter); no secret goes in a "
                         f"config: {instead}")
    return url


def resolve_secret(env_var: str | None, key: str) -> str | None:
    """A secret from the environment variable the config names: configs, logs and events never hold it."""
    if env_var is None:
        return None
    value = os.environ.get(env_var)
    if value is None:
        raise ConfigError(f"{key} names ${env_var}, which is not set in the environment")
    return value
