"""Contributions bound to the learner that wrote them (docs/wire-format.md, "Signatures").

With `run.signing_secret_env` set, every frame a learner writes to its region topic carries two
Kafka record headers: `diloco-learner` (its id) and `diloco-sig` (HMAC-SHA256 of the whole frame's
bytes under that learner's key). A learner's key is derived from the run's secret, which only the
runner and the syncer hold; each learner is given its own key alone (a file, `key_path`), so it can
sign as itself and as nobody else. The syncer checks the signature of every frame before it reads
anything in it.

Pure functions; the publisher signs, the syncer verifies, the runner writes the key files.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

SIGNER_HEADER = "diloco-learner"
SIGNATURE_HEADER = "diloco-sig"
KEY_BYTES = 32
_LABEL = b"diloco learner key v1"


class SigningError(ValueError):
    """A key that cannot be read or a frame whose signature does not hold."""


def learner_key(secret: bytes, run: str, learner: str) -> bytes:
    """Learner `learner`'s key in run `run`: HMAC-SHA256(secret, label 0 run 0 learner). Whoever holds
    one learner's key learns nothing of another's."""
    return hmac.new(secret, b"\0".join((_LABEL, run.encode(), learner.encode())), hashlib.sha256).digest()


def sign(key: bytes, frame: bytes | memoryview) -> bytes:
    """The 32-byte signature of a frame's bytes (prefix, header and payload, as written to the log)."""
    return hmac.new(key, frame, hashlib.sha256).digest()


def headers(learner: str, key: bytes, frame: bytes) -> list[tuple[str, bytes]]:
    """The Kafka record headers that sign `frame` as learner `learner`'s."""
    return [(SIGNER_HEADER, learner.encode()), (SIGNATURE_HEADER, sign(key, frame))]


def signer_of(record_headers: Sequence[tuple[str, bytes]] | None, frame: bytes | memoryview, key_of) -> str:
    """The learner whose key signed `frame`, from its record headers; `key_of(learner)` gives a
    learner's key, or None for an id that has none (not of this run). Raises SigningError saying what
    is wrong: no or repeated headers, an unknown signer, a signature that does not hold."""
    found: dict[str, list[bytes]] = {}
    for name, value in record_headers or ():
        if name in (SIGNER_HEADER, SIGNATURE_HEADER):
            found.setdefault(name, []).append(bytes(value or b""))
    if any(len(found.get(h, ())) != 1 for h in (SIGNER_HEADER, SIGNATURE_HEADER)):
        raise SigningError(f"a signed run's frames carry one {SIGNER_HEADER} and one {SIGNATURE_HEADER} header; "
                           f"this one has {sorted((k, len(v)) for k, v in found.items())}")
    try:
        learner = found[SIGNER_HEADER][0].decode()
    except UnicodeDecodeError:
        raise SigningError(f"{SIGNER_HEADER} header is not UTF-8") from None
    key = key_of(learner)
    if key is None:
        raise SigningError(f"signer {learner[:64]!r} is no learner of this run")
    if not hmac.compare_digest(sign(key, frame), found[SIGNATURE_HEADER][0]):
        raise SigningError(f"signature does not hold for signer {learner[:64]!r}")
    return learner


def key_path(keys_dir: str | os.PathLike, learner: str) -> Path:
    return Path(keys_dir) / f"{learner}.key"


def write_keys(secret: bytes, run: str, learners: Iterable[str], keys_dir: str | os.PathLike) -> None:
    """One key file per learner (hex, readable by its owner only), for the local runner's learners."""
    d = Path(keys_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for lid in learners:
        path = key_path(d, lid)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(learner_key(secret, run, lid).hex() + "\n")


def read_key(path: str | os.PathLike) -> bytes:
    """A learner's key from its file (64 hex digits). Raises SigningError naming the file."""
    try:
        text = Path(path).read_text().strip()
    except OSError as err:
        raise SigningError(f"cannot read the learner key {path}: {err.strerror or err}; with run.signing_secret_env "
                           "set every learner needs its key file (the runner writes it; see docs/operations.md)") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise SigningError(f"learner key {path} must hold {2 * KEY_BYTES} hex digits")
    return key
