"""Redis adapter: the client built from config, its optimistic transaction, and the names of its
errors, so that nothing outside `infra/` imports redis. What the syncer keeps in Redis, and under
which keys, is `syncer/state.py`'s."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError, ClusterDownError, RedisClusterException, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from diloco.infra.services import up_hint
from diloco.config import StateConfig, redact_url, resolve_secret

log = logging.getLogger(__name__)

Client = redis.Redis | RedisCluster

ServiceError = RedisError
"""Any error of a call to Redis (the service away, or refusing a command): what a caller catches to
say "the state service failed" without importing the client."""

OUTAGES: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError)
"""The errors of a Redis that is away for now (a cluster mid-failover says CLUSTERDOWN or TRYAGAIN):
to be waited out."""


class StateError(RuntimeError):
    pass


def connect(cfg: StateConfig, timeout_s: float | None = None) -> Client:
    """A client for the config's URL and ACL credentials, once the server answers (within `timeout_s`,
    default state.connect_timeout_s). With state.cluster it is a cluster client: the URL names any one
    node and the client finds the others."""
    kind = RedisCluster if cfg.cluster else redis.Redis
    password = resolve_secret(cfg.password_env, "state.password_env")

    def attempt():
        r = kind.from_url(cfg.redis_url, username=cfg.username, password=password,
                          socket_timeout=10, socket_connect_timeout=5, decode_responses=True)
        r.ping()
        return r
    return wait_until_up(attempt, cfg, cfg.connect_timeout_s if timeout_s is None else timeout_s)


def wait_until_up(attempt, cfg: StateConfig, timeout_s: float):
    """attempt() (a ping, say) once Redis answers it, retried with backoff for up to timeout_s."""
    url = redact_url(cfg.redis_url)  # only for the messages
    deadline = time.time() + timeout_s
    delay = 0.2
    while True:
        try:
            return attempt()
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException) as err:
            # the cluster client raises its own exception, caused by what the nodes it tried said
            why = err.__cause__ if isinstance(err, RedisClusterException) else err
            if isinstance(why, AuthenticationError):  # redis-py says the same for a missing and for a wrong password
                if cfg.password_env is None:
                    raise StateError(f"Redis at {url} requires a password: set state.password_env") from None
                raise StateError(f"Redis at {url} refused the credentials (state.username / state.password_env)") from None
            if not isinstance(why, (RedisConnectionError, RedisTimeoutError)):
                raise StateError(f"state.redis_url {url} (state.cluster: {cfg.cluster}): {err}") from None
            if time.time() > deadline:
                raise StateError(f"Redis not reachable at {url} ({why.__class__.__name__}); "
                                 + up_hint("state.redis_url")) from None
            log.warning("redis not reachable, retrying", extra={"url": url, "retry_in_s": delay})
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def transact(r: Client, watch: Iterable[str], prepare: Callable, build: Callable, attempts: int) -> bool:
    """One optimistic transaction: WATCH `watch`, `prepare(p)` (its reads run at once and may raise to
    refuse), then MULTI, `build(p)` (the writes, queued) and EXEC. A watched key changed before EXEC
    aborts it: then all of it runs again, up to `attempts` times. Whether it committed."""
    keys = list(watch)
    for _ in range(attempts):
        with r.pipeline(transaction=True) as p:
            try:
                if keys:
                    p.watch(*keys)
                prepare(p)
                p.multi()
                build(p)
                p.execute()
                return True
            except WatchError:
                continue
    return False
