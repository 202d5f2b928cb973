"""Which host agents a multi-host run attaches: only those its hosts file vouches for, before any contact.

Attaching an agent is trusting it: the run talks to it over Monarch's plain `tcp` transport, its replies are pickled (an attached agent can run code
in the controller), and an attached host receives the training code, the settings (their `env` included) and a seat
in every all-reduce. So a line of `hosts_file` is used only if

- the file is the run's user's own and no one else can write it (`hosts_file_unsafe`: owned by this user, not
  writable by group or others); else it is refused whole, before anything is spawned (`check_hosts_file`) or, read
  again mid-run, with a `host_refused` event;
- with a per-job token (`token_file`, made once by `monarch-plugin token F`, mode 0600), the line carries an
  HMAC-SHA256 of its address under the token (`host_line`), which `monarch-plugin host --token-file F` writes and
  only a holder of the token can (`admit`). Any other line is refused, and its address never contacted.

Without a token every line of a safe hosts file is trusted: who can write the file chooses the machines.

The functions here touch nothing but the files they are given; the controller's side is `procs.hosts`, the agent's
`procs.agent`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat

from monarch_plugin.net import parse_host
from monarch_plugin.errors import ConfigError

__all__ = ["MAC_PREFIX", "admit", "check_hosts_file", "host_line", "hosts_file_unsafe", "make_token", "new_token",
           "read_hosts_file", "read_token", "sign"]

MAC_PREFIX = "hmac="
"""How a hosts-file line carries its HMAC: ``tcp://IP:PORT hmac=<64 hex digits>``."""

_CONTEXT = b"monarch-plugin hosts-file line v1\n"
"""What every signed address is prefixed with: a token's HMAC of an address means this, and nothing else."""

_MIN_TOKEN = 32
"""The fewest characters a token file holds (`new_token` writes 64 hex digits: 256 bits)."""

_MAC = re.compile(r"[0-9a-f]{64}")


def new_token() -> str:
    """A fresh job token: 32 random bytes, in hex."""
    return secrets.token_hex(32)


def make_token(path: str) -> bool:
    """Write a new token to `path`, created 0600 (never over an existing file); True if written, False if `path` was
    there already (then it must be a token file `read_token` takes: ConfigError otherwise)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        read_token(path)
        return False
    try:
        os.write(fd, (new_token() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def read_token(path: str, option: str = "token_file") -> bytes:
    """The token in the file `path`; ConfigError, naming `option` and the fix, if it is missing, readable by group or
    others, or holds no token."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"`{option}` {path} does not exist: make the job's token once, before the agents and the "
                          f"run start, with `monarch-plugin token {path}`", option) from None
    except OSError as e:
        raise ConfigError(f"`{option}` {path} cannot be read ({e.strerror}): give a token file of this user's "
                          f"(`monarch-plugin token {path}` makes one)", option) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"`{option}` {path} is not a file: give the job's token file (`monarch-plugin token "
                              f"{path}` makes one)", option)
        if st.st_mode & 0o077:
            raise ConfigError(f"`{option}` {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                              f"whoever reads it can admit any machine to the run; `chmod 600 {path}`", option)
        token = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(token) < _MIN_TOKEN or any(c <= 32 or c >= 127 for c in token):
        raise ConfigError(f"`{option}` {path} holds no token ({_MIN_TOKEN} or more printable characters, no spaces): "
                          f"remove it and make one with `monarch-plugin token {path}`", option)
    return token


def sign(token: bytes, address: str) -> str:
    """The HMAC-SHA256 (hex) of the agent address `address` under `token`."""
    return hmac.new(token, _CONTEXT + address.encode(), hashlib.sha256).hexdigest()


def host_line(address: str, token: bytes | None) -> str:
    """The hosts-file line of the agent at `address` (no newline): the address, and its HMAC under `token` if any."""
    return f"{address} {MAC_PREFIX}{sign(token, address)}" if token is not None else address


def admit(line: str, token: bytes | None) -> tuple[str | None, str | None]:
    """(address, None) if the hosts-file line `line` (its comment stripped) admits its agent; (address or None, why)
    if it is refused. Without `token` a well-formed address is enough (its HMAC, if any, is not checked); with it,
    the line must carry the address's HMAC under `token`."""
    fields = line.split()
    if not fields:
        return None, "an empty line"
    address = fields[0]
    try:
        parse_host(address)
    except ConfigError as e:
        return None, str(e)
    macs = [f for f in fields[1:] if f.startswith(MAC_PREFIX)]
    other = [f for f in fields[1:] if not f.startswith(MAC_PREFIX)]
    if other or len(macs) > 1:
        return address, (f"unexpected {' '.join(fields[1:])!r} after the address: a line is `tcp://IP:PORT`, or "
                         f"`tcp://IP:PORT {MAC_PREFIX}<HMAC>` as `monarch-plugin host --token-file` writes it")
    if token is None:
        return address, None
    if not macs:
        return address, ("the line carries no HMAC of its address under the run's token (`token_file`): only an "
                         "agent started with `monarch-plugin host --token-file` and the run's token file is attached")
    mac = macs[0][len(MAC_PREFIX):]
    if not _MAC.fullmatch(mac) or not hmac.compare_digest(mac, sign(token, address)):
        return address, ("its HMAC does not verify under the run's token (`token_file`): the line was written with "
                         "another token, or by someone without it")
    return address, None


def hosts_file_unsafe(st: os.stat_result, path: str, uid: int | None = None) -> str | None:
    """Why the hosts file `path`, of status `st`, may not be used by a run of user `uid` (this process's effective
    user by default), naming the fix; None if it may: a file of that user's that no one else can write."""
    uid = os.geteuid() if uid is None else uid
    if not stat.S_ISREG(st.st_mode):
        return f"`hosts_file` {path} is not a file: give a file of agent addresses, one a line"
    if st.st_uid != uid:
        return (f"`hosts_file` {path} is owned by {_user(st.st_uid)}, not by this run's user ({_user(uid)}): whoever "
                f"writes it chooses the machines the run sends its code and data to; give a hosts file of your own "
                f"(remove this one: the agents make it again), or as root `chown {_user(uid)} {path}`")
    if st.st_mode & 0o022:
        writers = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "others")) if st.st_mode & bit)
        return (f"`hosts_file` {path} is writable by {writers} (mode {stat.S_IMODE(st.st_mode):o}): whoever writes it "
                f"chooses the machines the run sends its code and data to; `chmod go-w {path}`")
    return None


def check_hosts_file(path: str) -> None:
    """Before anything is spawned: ConfigError, naming the fix, if the hosts file at `path` may not be used (a file
    not there yet is fine: the agents make it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    why = hosts_file_unsafe(st, path)
    if why:
        raise ConfigError(why, "hosts_file")


def read_hosts_file(path: str, token: bytes | None) -> tuple[list[str], list[tuple[str, str | None, str]]]:
    """The addresses the hosts file `path` admits now, and each refusal as (line, address, why): the whole file
    (line "") if others may write it; with `token`, each line that does not carry the HMAC of its address. A file
    not there yet admits none. The status is the file's as read, never blocking on a FIFO."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)) as f:
            why = hosts_file_unsafe(os.fstat(f.fileno()), path)
            lines = [] if why else [line.split("#")[0].strip() for line in f]
    except FileNotFoundError:
        return [], []
    if why:
        return [], [("", None, why)]
    addresses, refused = [], []
    for line in filter(None, lines):
        address, why = admit(line, token)
        if why:
            refused.append((line, address, why))
        else:
            addresses.append(address)
    return addresses, refused


def _user(uid: int) -> str:
    """A user's name, or `uid N` if it has none here."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
