"""The run's secret, and the store its processes sign every value in.

The controller's TCPStore answers whoever connects (torch's store has no authentication, nor any TLS),
so on one machine any local user, and on a job network any host, can write under the runtime's own keys. Every value
the runtime writes there is therefore signed: an HMAC-SHA256 of the key and the value under a secret the controller
makes for the run (`new_secret`) and gives the processes it spawns through their environment (`SECRET_ENV`), never
through a file. A value that does not verify is never acted on: `SignedStore` reports it (`on_forged`: a
`forged_value` event) and raises `Forged`. The groups' own rendezvous (gloo's addresses, NCCL's unique id) goes
through the same store, so a process without the secret cannot take a rank in a generation's group or a heal's.

What a signature cannot stop, an unauthenticated store cannot: a writer without the secret can still erase or
overwrite a key. The runtime then sees a forged value where it needs a real one, and the run stops with its give-up
checkpoint and a message naming the key (or, in a group's rendezvous, abandons that formation and forms the next).
Counters (`add`) carry no signature: the runtime keeps them only where a forged count can make it look sooner, or a
lost host's loss be noticed later, never decide (`Key.stalled`, the appended reports' counts, the host watchers'
beats).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Callable

import torch.distributed as dist

from monarch_plugin.errors import ProtocolError

__all__ = ["Forged", "SECRET_ENV", "SignedStore", "forged_reporter", "new_secret", "secret_from_env"]

SECRET_ENV = "MONARCH_PLUGIN_SECRET"
"""The environment variable that carries the run's secret (hex) to the processes the controller spawns."""

_TAG = 64  # the length of a hex HMAC-SHA256

_UNSET = b"\0monarch-plugin: not set\0"
"""What `SignedStore._read` compares a key with: no signed value ever equals it (each ends in a hex tag)."""


def new_secret() -> str:
    """A fresh run secret: 32 random bytes, in hex (what `SECRET_ENV` carries)."""
    return secrets.token_hex(32)


def secret_from_env() -> bytes:
    """This process's run secret, from the environment the controller spawned it with."""
    value = os.environ.get(SECRET_ENV, "")
    if not value:
        raise ProtocolError("store", f"{SECRET_ENV} is not set: this process was not spawned by a monarch-plugin "
                            "controller, and cannot sign what it writes to the run's store")
    return bytes.fromhex(value)


class Forged(ProtocolError):
    """A value in the run's store does not carry the run's signature: a process without the run's secret wrote it."""

    def __init__(self, key: str):
        super().__init__("store", f"the value under {key!r} in the run's store does not carry the run's signature: "
                                  "a process without the run's secret wrote it")
        self.key = key


def forged_reporter(events) -> Callable[[str, bytes], None]:
    """An `on_forged` that reports each forged value as a `forged_value` event of `events` (an `EventLog`)."""

    seen: set[tuple[str, bytes]] = set()

    def report(key: str, raw: bytes) -> None:
        if (key, raw) in seen:  # a reader that polls finds the same one again
            return
        seen.add((key, raw))
        events.emit("forged_value", key=key, value=raw[:120].decode(errors="replace"), pid=os.getpid())

    return report


def _bytes(value: str | bytes | list[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(dist.Store):
    """The run's store, signing every value set through it and verifying every value read.

    A `dist.Store` itself, so the groups' constructors (through `PrefixStore`) sign and verify their rendezvous too.
    `add` and `check` pass through: a count or a key's presence is never trusted here, only what a verified value
    says. `on_forged(key, raw)` is told of every value that fails, before `Forged` is raised."""

    def __init__(self, inner: dist.Store, secret: bytes, on_forged: Callable[[str, bytes], None] | None = None):
        super().__init__()
        self._inner = inner
        self._secret = secret
        self._on_forged = on_forged

    def like(self, inner: dist.Store) -> "SignedStore":
        """Another connection to the same run, signing with the same secret."""
        return SignedStore(inner, self._secret, self._on_forged)

    @property
    def port(self) -> int:
        return self._inner.port

    def _tag(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()

    def _open(self, key: str, raw: bytes) -> bytes:
        payload, tag = raw[:-_TAG], raw[-_TAG:]
        if len(raw) < _TAG or not hmac.compare_digest(tag, self._tag(key, payload)):
            if self._on_forged is not None:
                self._on_forged(key, raw)
            raise Forged(key)
        return payload

    def set(self, key: str, value) -> None:
        payload = _bytes(value)
        self._inner.set(key, payload + self._tag(key, payload))

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(key))

    def peek(self, key: str) -> bytes | None:
        """The key's verified value, or None while it is not set (never blocks)."""
        raw = self._read(key)
        return None if raw is None else self._open(key, raw)

    def _read(self, key: str) -> bytes | None:
        """The key's raw value, or None while it is not set, in one request that never waits: a compare-and-set that
        can never match (`_UNSET`) answers the value, and leaves a missing key missing. A `check` then `get` would wait
        the store's whole timeout for a key that anyone who reaches the store deleted between the two."""
        raw = self._inner.compare_set(key, _UNSET, _UNSET)
        return None if raw == _UNSET else raw

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Set `desired` if the key holds `expected` (b"": is not set); returns the verified value it now holds."""
        expected = _bytes(expected)
        signed = expected + self._tag(key, expected) if expected else b""
        desired = _bytes(desired)
        return self._open(key, self._inner.compare_set(key, signed, desired + self._tag(key, desired)))

    def append(self, key: str, line: str) -> None:
        """Append one signed line (a report) to the key's value: `lines` reads them back."""
        payload = line.strip("\n").encode()
        # A newline before it too: a fragment someone appended unterminated stays a line of its own.
        self._inner.append(key, b"\n" + self._tag(key, payload) + payload + b"\n")

    def lines(self, key: str) -> list[str]:
        """Every signed line appended under the key, in order, each once; a line that does not verify is reported
        (`on_forged`) and left out."""
        found: list[str] = []
        for raw in (self._read(key) or b"").split(b"\n"):
            if not raw.strip():
                continue
            payload, tag = raw[_TAG:], raw[:_TAG]
            if not hmac.compare_digest(tag, self._tag(key, payload)):
                if self._on_forged is not None:
                    self._on_forged(key, raw)
                continue
            line = payload.decode()
            if line not in found:
                found.append(line)
        return found

    def verified(self, keys: list[str]) -> bool:
        """Every key is set, each to a value that verifies (`Forged` if one does not); never blocks."""
        if not self._inner.check(keys):
            return False
        return all(self.peek(key) is not None for key in keys)

    def member_token(self, group: str, rank: int) -> bytes:
        """What the member of rank `rank` of the group named `group` shows the others once the group is built
        (`collectives.new_group`): only a holder of the secret can make it."""
        return hmac.new(self._secret, f"member\0{group}\0{rank}".encode(), hashlib.sha256).digest()

    def is_member_token(self, group: str, rank: int, token: bytes) -> bool:
        return hmac.compare_digest(token, self.member_token(group, rank))

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout=None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout) -> None:
        self._inner.set_timeout(timeout)
