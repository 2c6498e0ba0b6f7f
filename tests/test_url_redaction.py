"""URLs with a password never leak it and never crash felixctl (issue 19, item 7 a-c).

* a password with an unencoded space is masked by ``redact_url`` (in ``ConnectionFailed``
  and ``client.url``: tests/test_secrets.py's unreachable URLs);
* an upper-case ``?PASSWORD=`` (or any query option the scheme does not take) is
  refused up front, naming the option and never its value, so no secret reaches a
  redis-py client's repr;
* felixctl answers such a URL with one ``felixctl: error:`` line and exit status 1,
  like every other bad URL, never a traceback.
No server is needed: every URL points at a closed port.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import felix_redis
import felix_redis.asyncio as felix_asyncio
from felix_redis.errors import redact_url
from felixctl.cli import cli

SECRET = "pa ss-7"
OTHER = "s3cret-Q"


def _no_secret(*texts: object) -> None:
    for text in texts:
        for secret in (SECRET, OTHER, "pa ss", "ss-7"):
            assert secret not in str(text), text


SPACED = [
    f"redis://:{SECRET}@127.0.0.1:1/0",
    f"redis://app:{SECRET}@127.0.0.1:1/0",
    f"redis+sentinel://:{SECRET}@127.0.0.1:1/mymaster/0",
    f"redis+cluster://:{SECRET}@127.0.0.1:1",
    f"redis://127.0.0.1:1/0?password={SECRET}",
]


@pytest.mark.parametrize("url", SPACED)
def test_a_password_with_a_space_is_masked(url: str) -> None:
    assert "***" in redact_url(url)
    _no_secret(redact_url(url))
    if "?" not in url:
        # in a longer message, a password with a space is masked while it holds no "/"
        # (the library redacts the URL alone before it goes into a message)
        _no_secret(redact_url(f"cannot reach Redis at {url}: refused"))
    # the client's errors: tests/test_secrets.py's unreachable URLs hold it too


def test_redaction_of_messages_keeps_the_rest() -> None:
    assert redact_url(f"redis://:{SECRET}/x@127.0.0.1:1/0") == "redis://:***@127.0.0.1:1/0"  # space and slash
    assert redact_url(f"cannot reach Redis at redis://:{SECRET}@127.0.0.1:1/0: Error 111 connecting") == (
        "cannot reach Redis at redis://:***@127.0.0.1:1/0: Error 111 connecting")
    # a host:port is no user:password
    assert redact_url("cannot reach Redis at redis://127.0.0.1:1/0: refused; see a@b") == (
        "cannot reach Redis at redis://127.0.0.1:1/0: refused; see a@b")
    assert redact_url(f"redis://h:1/0?PASSWORD={OTHER}&Sentinel_Password={OTHER}") == (
        "redis://h:1/0?PASSWORD=***&Sentinel_Password=***")


UNKNOWN = [
    (f"redis://127.0.0.1:1/0?PASSWORD={OTHER}", "'PASSWORD'", "lower case: 'password'"),
    (f"rediss://127.0.0.1:1/0?ssl_cert_reqs=none&Password={OTHER}", "'Password'", "lower case"),
    ("redis://127.0.0.1:6379/0?bogus=1", "'bogus'", "docs/security.md"),
    (f"unix:///run/redis.sock?pass={OTHER}", "'pass'", "docs/security.md"),
    (f"redis+sentinel://127.0.0.1:1/m/0?SENTINEL_PASSWORD={OTHER}", "'SENTINEL_PASSWORD'", "sentinel_password"),
    ("redis+sentinel://127.0.0.1:1/m/0?db=3", "'db'", "sentinel_password"),
    (f"redis+cluster://127.0.0.1:1?sentinel_password={OTHER}", "'sentinel_password'", "ssl_ca_certs"),
]


@pytest.mark.parametrize("url, name, hint", UNKNOWN)
def test_unknown_query_options_are_refused_without_their_value(url: str, name: str, hint: str) -> None:
    for connect in (felix_redis.connect, felix_asyncio.connect):
        with pytest.raises(felix_redis.InvalidArgument) as info:
            connect(url)
        assert name in str(info.value) and hint in str(info.value), info.value
        _no_secret(info.value)


def test_known_query_options_still_pass() -> None:
    for url in ("redis://127.0.0.1:1/0?db=2&socket_timeout=1&password=x&client_name=felix&health_check_interval=5",
                "rediss://127.0.0.1:1/0?ssl_ca_certs=/ca.pem&ssl_check_hostname=false&ssl_min_version=3",
                "redis+sentinel://127.0.0.1:1/m/0?sentinel_password=x&socket_connect_timeout=1",
                "rediss+sentinel://127.0.0.1:1/m/0?ssl_cert_reqs=optional&username=u&password=p"):
        felix_redis.connect(url).close()


@pytest.mark.parametrize("url, name, _hint", UNKNOWN)
def test_felixctl_answers_a_bad_option_with_one_error_line(url: str, name: str, _hint: str) -> None:
    result = CliRunner().invoke(cli, ["--redis-url", url, "stream", "list"])
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("felixctl: error: unknown query option "), result.stderr
    assert name in lines[0]
    _no_secret(result.output)


def test_felixctl_bad_url_errors_share_one_exit_status() -> None:
    """The unknown option answers as the other bad URLs do (exit 1, one line)."""
    for url in ("redis://127.0.0.1:notaport/0", "bogus://h:1/0", "redis://127.0.0.1:1/0?bogus=1"):
        result = CliRunner().invoke(cli, ["--redis-url", url, "stream", "list"])
        assert result.exit_code == 1, (url, result.output)
        assert result.stderr.startswith("felixctl: error: ") and result.stderr.count("\n") == 1
