"""The flags that name where users come from, and the cache salt option.

Three flags join the plugin's group (API server side, not in
``additional_config``): the gateway header that names the end user, the
body fields that may name it, and per-user prefix-cache isolation. Each
needs limiting on and the HTTP part, which applies them
(trusted_identity.py). With API keys, a header or body fields need a key
marked ``gateway: true`` (else nothing could assert them), and such a key
needs one of them (else it would be an ordinary key): both are refused at
start-up rather than left without effect.
"""

from __future__ import annotations

import argparse
import os
import re

from vllm_output_rate.config import API_KEYS_FLAG, DEFAULT_FLAG
from vllm_output_rate.identity import BODY_FIELDS
from vllm_output_rate.integration.cli_flags import plugin_group
from vllm_output_rate.integration.flag_types import config_arg
from vllm_output_rate.validation import OutputRateConfigError

USER_HEADER_FLAG = "--output-rate-user-header"
USER_FIELDS_FLAG = "--output-rate-user-fields"
CACHE_SALT_FLAG = "--output-rate-cache-salt"
CACHE_SALT_SCOPES = ("user",)
HTTP_PLUGIN = "output_rate_http"
# RFC 9110 field name characters.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Headers that carry something else: credentials, framing, the host.
_RESERVED = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "host",
        "connection",
        "content-length",
        "content-type",
        "transfer-encoding",
        "te",
        "upgrade",
    }
)


def parse_header_name(text: str) -> str:
    """A header name (lower case) that may carry the end user."""
    name = text.strip().lower()
    if not _TOKEN.fullmatch(name):
        raise OutputRateConfigError(
            f"{USER_HEADER_FLAG}: {text!r} is not an HTTP header name"
        )
    if name in _RESERVED:
        raise OutputRateConfigError(
            f"{USER_HEADER_FLAG}: {name!r} carries something else; name a "
            "header of its own, such as x-litellm-end-user-id"
        )
    return name


def parse_body_fields(text: str) -> tuple[str, ...]:
    """Comma-separated body fields, from ``BODY_FIELDS``, each once."""
    fields = tuple(part.strip() for part in text.split(","))
    unknown = [field for field in fields if field not in BODY_FIELDS]
    if unknown or len(set(fields)) != len(fields):
        raise OutputRateConfigError(
            f"{USER_FIELDS_FLAG}: expected a comma-separated list of "
            f"{', '.join(BODY_FIELDS)}, each once; got {text!r}"
        )
    return fields


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the identity flags to the plugin's group (once)."""
    if USER_HEADER_FLAG in parser._option_string_actions:
        return
    group = plugin_group(parser)
    group.add_argument(
        USER_HEADER_FLAG,
        type=config_arg(parse_header_name),
        default=None,
        metavar="NAME",
        help="Trusted gateway: the request header that names the end user, "
        "e.g. x-litellm-end-user-id. Counted from gateway keys (gateway: true "
        f"in {API_KEYS_FLAG}); without keys, from any caller. It wins over "
        "every other source; a malformed value gets HTTP 400.",
    )
    group.add_argument(
        USER_FIELDS_FLAG,
        type=config_arg(parse_body_fields),
        default=None,
        metavar="FIELDS",
        help="Body fields that may name the user when the header does not, "
        f"first present wins: {', '.join(BODY_FIELDS)} (comma-separated). "
        "Same trust as the header.",
    )
    group.add_argument(
        CACHE_SALT_FLAG,
        choices=CACHE_SALT_SCOPES,
        default=None,
        help="Per-user prefix-cache isolation: every request's cache_salt is "
        "set from its user, replacing any salt the client sent, so no user "
        "can detect or reuse another's cached prompts.",
    )


def given_flags(args: argparse.Namespace) -> list[str]:
    return [
        flag
        for flag, name in (
            (USER_HEADER_FLAG, "output_rate_user_header"),
            (USER_FIELDS_FLAG, "output_rate_user_fields"),
            (CACHE_SALT_FLAG, "output_rate_cache_salt"),
        )
        if getattr(args, name, None) is not None
    ]


def check_identity_options(args: argparse.Namespace, limiting: bool) -> None:
    """Refuse identity options that nothing would apply, at start-up."""
    from vllm_output_rate.api_keys import ApiKeys

    given = given_flags(args)
    keys_file = getattr(args, "output_rate_api_keys", None)
    if given:
        if not limiting:
            raise OutputRateConfigError(f"{', '.join(given)} need {DEFAULT_FLAG}")
        plugins = os.environ.get("VLLM_PLUGINS")
        if plugins is None or HTTP_PLUGIN not in plugins.split(","):
            raise OutputRateConfigError(
                f"{', '.join(given)} need the HTTP plugin: start with "
                "VLLM_PLUGINS=output_rate,output_rate_http"
            )
    if not keys_file or not limiting:
        return
    asserting = [f for f in given if f in (USER_HEADER_FLAG, USER_FIELDS_FLAG)]
    gateway = ApiKeys.load(keys_file).has_gateway
    if asserting and not gateway:
        raise OutputRateConfigError(
            f"{' and '.join(asserting)} with {API_KEYS_FLAG}: no key in "
            f"{keys_file} is marked 'gateway: true', so no request could name "
            "its user that way; mark the gateway's key"
        )
    if gateway and not asserting:
        raise OutputRateConfigError(
            f"{API_KEYS_FLAG} {keys_file} marks a gateway key, but neither "
            f"{USER_HEADER_FLAG} nor {USER_FIELDS_FLAG} is given for it to name "
            "end users with"
        )
