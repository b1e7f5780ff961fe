"""Who may do what: API keys for creating sessions, capability tokens per session.

- **API keys** (server-wide) let a connection create sessions. They come from the server's
  configuration or a keys file and are presented on the websocket handshake
  (`Authorization: Bearer <key>`, `X-API-Key: <key>`, or `?api_key=<key>` for browsers).
  With no keys configured the server is open (the embedded default, on loopback). Each key has
  a role (`KEY_ROLES`): an `operator` lists and watches every session; a `tenant` lists and
  watches only the sessions its own key created. A key without a role is a tenant (the least
  privilege: a keys file written before roles existed gives no key a view of the others').
- **Capability tokens** (per session) are minted when a session is created and returned once,
  in `session.created`. Each carries one role:
  - `producer`: everything on that session (input, questions, flash, actions, close), and
    taking the session over from a new connection;
  - `subscriber`: read-only events (flash answers, reasoning, actions) and state;
  - `dashboard`: the same read-only view, for dashboard pages.
  A token opens its own session only: presenting it for another session id fails exactly
  like a wrong token.

Secrets are kept only as SHA-256 digests and compared with `hmac.compare_digest`, checking
every candidate so timing does not tell which one matched; they never reach a log line (the
digests are what a persistent store may hold).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from pathlib import Path

ROLES = ("producer", "subscriber", "dashboard")
KEY_ROLES = ("operator", "tenant")
DEFAULT_KEY_ROLE = "tenant"


ALL_SESSIONS = object()  # ApiKeys.viewer: every session (an operator, or a server without keys)
NO_SESSIONS = object()  # ApiKeys.viewer: no session (no key on a keyed server)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def _match(candidate: str, digests: dict[str, str]) -> str | None:
    """The name whose digest equals the candidate's, comparing against all of them."""
    found = None
    want = digest(candidate).encode()
    for name, d in digests.items():
        if hmac.compare_digest(want, d.encode()):
            found = name
    return found


class KeysFileError(ValueError):
    pass


class ApiKeys:
    """Server-wide API keys, by name (the name is what logs and limits see, never the key)."""

    def __init__(self, keys: dict[str, str] | None = None, roles: dict[str, str] | None = None) -> None:
        """`keys`: name -> key; `roles`: name -> `operator` or `tenant` (a name not in it: tenant)."""
        self._digests = {name: digest(key) for name, key in (keys or {}).items()}
        roles = roles or {}
        if unknown := set(roles) - set(self._digests):
            raise ValueError(f"roles name keys that do not exist: {sorted(unknown)}")
        if bad := {r for r in roles.values() if r not in KEY_ROLES}:
            raise ValueError(f"unknown key roles {sorted(bad)}; a key is one of {KEY_ROLES}")
        self._roles = {name: roles.get(name, DEFAULT_KEY_ROLE) for name in self._digests}

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, key: str | None) -> str | None:
        """The key's name, or None when it is missing or unknown."""
        if not key:
            return None
        return _match(key, self._digests)

    def role(self, name: str | None) -> str | None:
        """The role of the key with this name (`operator` or `tenant`), or None for no key."""
        return self._roles.get(name) if name is not None else None

    def viewer(self, key: str | None) -> "str | None | object":
        """Whose sessions a request presenting `key` may see: `ALL_SESSIONS` (an operator key, or
        any request on a server without keys), a tenant key's name (its own sessions),
        `NO_SESSIONS` (no key), or None for a key that is presented but unknown."""
        if not self.enabled:
            return ALL_SESSIONS
        if not key:
            return NO_SESSIONS
        name = self.check(key)
        if name is None:
            return None
        return ALL_SESSIONS if self.role(name) == "operator" else name

    def roles(self) -> dict[str, int]:
        """How many keys hold each role (for the start-up log line)."""
        return {role: sum(1 for r in self._roles.values() if r == role) for role in KEY_ROLES}

    @classmethod
    def from_file(cls, path: str | Path) -> "ApiKeys":
        """One key per line, `name:key` or a bare key (named key1, key2...), optionally followed
        by whitespace and `role=operator` or `role=tenant` (without it: tenant); `#` comments and
        blank lines are skipped. Keys shorter than 16 characters are refused, and so are a name
        given twice and one key under two names (which name would a request be? the error names
        both names and lines, never the key)."""
        keys: dict[str, str] = {}
        roles: dict[str, str] = {}
        lines_of: dict[str, int] = {}  # name -> its line
        names_of: dict[str, str] = {}  # digest of a key -> its name
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise KeysFileError(f"cannot read API keys file {path}: {exc.strerror}") from None
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            role = None
            parts = line.rsplit(None, 1)
            if len(parts) == 2 and parts[1].startswith("role="):
                line, role = parts[0], parts[1].removeprefix("role=")
                if role not in KEY_ROLES:
                    raise KeysFileError(f"{path}:{number}: unknown role {role!r}; use role=operator or role=tenant")
            name, sep, key = line.partition(":")
            if not sep:
                name, key = f"key{len(keys) + 1}", line
            name, key = name.strip(), key.strip()
            if not name or len(key) < 16:
                raise KeysFileError(f"{path}:{number}: expected 'name:key' with a key of 16+ characters")
            if name in keys:
                raise KeysFileError(f"{path}:{number}: key name {name!r} appears twice (first on line "
                                    f"{lines_of[name]}): give each key its own name")
            if (other := names_of.get(digest(key))) is not None:
                raise KeysFileError(f"{path}:{number}: the key of {name!r} is the key of {other!r} (line "
                                    f"{lines_of[other]}): one key, one name; give {name!r} a key of its own")
            keys[name] = key
            lines_of[name] = number
            names_of[digest(key)] = name
            if role is not None:
                roles[name] = role
        if not keys:
            raise KeysFileError(f"{path}: no keys in the file")
        return cls(keys, roles)


class SessionTokens:
    """Capability tokens of live sessions: session id -> role -> token digest. Thread-safe."""

    def __init__(self) -> None:
        self._digests: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def issue(self, session_id: str) -> dict[str, str]:
        """Mint one token per role for a new session; the plain tokens are returned only here."""
        tokens = {role: secrets.token_urlsafe(24) for role in ROLES}
        with self._lock:
            self._digests[session_id] = {role: digest(tok) for role, tok in tokens.items()}
        return tokens

    def role_of(self, session_id: str, token: str | None) -> str | None:
        """The role the token grants on this session, or None (unknown session or token)."""
        with self._lock:
            digests = self._digests.get(session_id)
        if digests is None or not token:
            return None
        return _match(token, digests)

    def revoke(self, session_id: str) -> None:
        with self._lock:
            self._digests.pop(session_id, None)

    def export(self, session_id: str) -> dict[str, str] | None:
        """The digests of a session's tokens, for a persistent store (no secret leaves)."""
        with self._lock:
            d = self._digests.get(session_id)
            return dict(d) if d is not None else None

    def restore(self, session_id: str, digests: dict[str, str]) -> None:
        """Re-install digests saved by `export` (a session recovered after a restart)."""
        if set(digests) != set(ROLES):
            raise ValueError(f"token digests must name the roles {ROLES}")
        with self._lock:
            self._digests[session_id] = dict(digests)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._digests


def key_from_request(headers, path: str) -> str | None:
    """The API key a handshake presents, from its headers or its query string."""
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    if headers.get("X-API-Key"):
        return headers["X-API-Key"].strip() or None
    if "?" in path:
        from urllib.parse import parse_qs

        values = parse_qs(path.split("?", 1)[1]).get("api_key")
        if values:
            return values[0] or None
    return None
