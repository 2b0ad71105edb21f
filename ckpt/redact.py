"""Credentials kept out of logs, errors and stored text: `redact` masks them in any text, and
the S3 stack's request logs are masked before a handler sees them."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

_SECRET_PATTERNS = [
    # user:password@ in a URL, or as a backend quotes it without the scheme
    (re.compile(r"(?<=://)[^/\s]*@|[^\s/@'\":]+:[^\s/'\"]*@(?=[\w.-]+)"), "***@"),
    # presigned-URL and token query parameters
    (re.compile(r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|token|access_token|key)=)[^&\s\"']+"), r"\1***"),
    (re.compile(r"(?i)(bearer\s+)[\w.~+/=-]+"), r"\1***"),
    # secret=..., "password": "...", api_key: ...
    # (a header dict's value may be bytes: b'...', as botocore logs a request it sends)
    (re.compile(r"(?i)((?:secret|token|api[_-]?key|access[_-]?key|signature|credential)s?[\"']?\s*[=:]\s*(?:b?[\"'])?)[^\s\"',}&]+"), r"\1***"),
    # (a password after a colon and a space only when quoted: "…/etc/passwd: not listed" is prose)
    (re.compile(r"(?i)((?:password|passwd)s?[\"']?\s*(?:=\s*|:(?=\S)|:\s*(?=b?[\"']))(?:b?[\"'])?)[^\s\"',}&]+"), r"\1***"),
]
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "CKPT_SIGNING_KEY")
# Storage options whose values are credentials (s3fs' key/secret/token, Azure's account_key
# and sas_token, client_kwargs' aws_*), by their names.
_SECRET_OPTION = re.compile(r"(?i)secret|token|password|passwd|key|credential|signature|sas")
_KNOWN_SECRETS: set[str] = set()  # credentials this process was given: masked like the environment's


def remember_secrets(options: Any) -> None:
    """Have `redact` mask the credentials among `options` (storage options, nested too)."""
    for k, v in (options or {}).items() if isinstance(options, dict) else ():
        if isinstance(v, dict):
            remember_secrets(v)
        elif isinstance(v, str) and len(v) >= 4 and _SECRET_OPTION.search(str(k)):
            _KNOWN_SECRETS.add(v)


def redact(text: str) -> str:
    """`text` (a URL, an error message) with credentials masked, safe to log or store:
    `user:password@` parts, signature and token parameters, bearer tokens, `secret=...`
    pairs, the values of the credential variables of this process's environment and the
    credentials it was given (`remember_secrets`)."""
    out = str(text)
    for value in [os.environ.get(name) for name in _SECRET_ENV] + sorted(_KNOWN_SECRETS, key=len, reverse=True):
        if value and len(value) >= 4:
            out = out.replace(value, "***")
    for pattern, repl in _SECRET_PATTERNS:
        out = pattern.sub(repl, out)
    return out


# The S3 stack's loggers that print whole requests at DEBUG (headers with the session token
# and the access key): their records are masked before any handler sees them.
_REQUEST_LOGGERS = ("botocore.auth", "botocore.endpoint", "aiobotocore.endpoint", "botocore.credentials", "aiobotocore.credentials", "botocore.parsers", "s3fs")


class _RedactRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        masked = redact(text)
        if masked != text:
            record.msg, record.args = masked, None
        return True


def redact_request_logs() -> None:
    """Mask credentials in what the S3 stack logs (only records that are emitted pay)."""
    for name in _REQUEST_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactRecords) for f in logger.filters):
            logger.addFilter(_RedactRecords())
