"""Manifest signatures: an HMAC-SHA256 over a manifest's content, with a key the user holds.

With a key configured (`Checkpointer(signing_key=...)`, else the file named by
`CKPT_SIGNING_KEY_FILE`, else `CKPT_SIGNING_KEY`), rank 0 signs every manifest it commits or
drafts. The signature covers every field but itself, each file's size and checksum
included, so it covers `.metadata` and the data too. A node agent commits a signed draft
exactly as it was signed: the key never leaves the training processes. With a key, restore
and `ckpt verify` trust only checkpoints whose signature matches; without one, signatures are
not checked. The key is never logged, stored or shown: a `SigningKey` shows only its id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os

from ckpt.format.manifest import Manifest
from ckpt.redact import remember_secrets

ALG = "hmac-sha256"
KEY_FILE_ENV = "CKPT_SIGNING_KEY_FILE"
KEY_ENV = "CKPT_SIGNING_KEY"
MIN_KEY_BYTES = 16
SIGNED_OK, UNSIGNED, BAD = "signed-ok", "unsigned", "BAD"


class SigningKey:
    """A secret key for manifest signatures; `key_id` names it (it reveals nothing of it)."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes | str) -> None:
        raw = key.encode() if isinstance(key, str) else bytes(key)
        if len(raw) < MIN_KEY_BYTES:
            raise ValueError(
                f"a signing key must be at least {MIN_KEY_BYTES} bytes (this one has {len(raw)}); "
                "make one with `openssl rand -hex 32`"
            )
        self._key = raw
        remember_secrets({"signing_key": raw.decode(errors="replace")})  # masked in any error text
        self.key_id = hmac.new(raw, b"ckpt signing key id", hashlib.sha256).hexdigest()[:12]

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r})"

    def __reduce__(self) -> None:  # type: ignore[override]
        raise TypeError("a SigningKey is not pickled: the key stays in the process that holds it")

    @classmethod
    def from_file(cls, path: str) -> SigningKey:
        """The key held in a file (surrounding whitespace, a trailing newline, dropped)."""
        try:
            with open(os.path.expanduser(path), "rb") as f:
                raw = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the signing key file {path}: {e.strerror or type(e).__name__}") from None
        if not raw:
            raise ValueError(f"the signing key file {path} is empty")
        return cls(raw)

    @classmethod
    def resolve(cls, key: SigningKey | bytes | str | None = None) -> SigningKey | None:
        """`key`, else the environment's (`CKPT_SIGNING_KEY_FILE`, then `CKPT_SIGNING_KEY`),
        else None: no signing."""
        if isinstance(key, SigningKey):
            return key
        if key is not None:
            return cls(key)
        path = os.environ.get(KEY_FILE_ENV)
        if path:
            return cls.from_file(path)
        value = os.environ.get(KEY_ENV)
        return cls(value) if value else None

    def _mac(self, manifest: Manifest) -> str:
        return hmac.new(self._key, manifest.signed_content(), hashlib.sha256).hexdigest()

    def sign(self, manifest: Manifest) -> Manifest:
        """`manifest` with its signature block."""
        return dataclasses.replace(manifest, signature={"alg": ALG, "key_id": self.key_id, "mac": self._mac(manifest)})

    def check(self, manifest: Manifest) -> tuple[str, str]:
        """(SIGNED_OK, "") for a manifest signed with this key, else (UNSIGNED or BAD, why it
        is not to be trusted)."""
        sig = manifest.signature
        if not sig:
            return UNSIGNED, f"unsigned, and a signing key (id {self.key_id}) is configured: not trusted"
        if sig.get("alg") != ALG:
            return BAD, f"signed with {sig.get('alg')!r}, not {ALG}: not trusted"
        # IMPORTANT: compared in constant time, whatever the key id says.
        if not hmac.compare_digest(str(sig.get("mac", "")).encode(), self._mac(manifest).encode()):
            other = sig.get("key_id") != self.key_id
            how = f"signed with another key (id {sig.get('key_id')!r}, not {self.key_id})" if other else "its signature does not match its content (tampered with)"
            return BAD, f"{how}: not trusted"
        return SIGNED_OK, ""
