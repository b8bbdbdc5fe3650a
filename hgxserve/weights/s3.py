"""A small S3 client for ranged GETs at line rate: SigV4 signing, pooled HTTP(S), retries.

boto3's per-request overhead costs CPU that the hashing needs on a busy host, and importing it plus
building one client takes ~0.7 s, so the hot path speaks HTTP itself: one keep-alive connection per
worker thread, `readinto` straight into the part buffer. TLS verification is always on.

    client = S3Client.from_env(endpoint_url="https://s3.example.com", region="us-east-1")
    for obj in client.list_objects("models", "DeepSeek-V4-Flash/"):
        print(obj.key, obj.size, obj.etag)
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import hmac
import http.client
import ipaddress
import os
import random
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hgxserve.base.defaults import S3_REQUEST_DEADLINE_S
from hgxserve.base.errors import scrub
from hgxserve.weights.credentials import Credentials
from hgxserve.weights.errors import CredentialsError, SourceError, VerifyError, WeightsError
from hgxserve.weights.manifest import check_size

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
RETRYABLE_STATUS = {500, 502, 503, 504}
RETRYABLE_CODES = {
    "SlowDown",
    "InternalError",
    "RequestTimeout",
    "ServiceUnavailable",
    "Throttling",
}
CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
}
# Body bytes are received in slices of this size when a consumer writes them out as they come:
# the slice is still in the CPU cache when it is written to the page cache (see transfer.py).
RECV_SLICE = 64 << 10
# Bounds on what one S3 answer may make this process hold or wait for: every store's answer is
# untrusted input. A ListObjectsV2 page of 1000 keys is 0.3-0.5 MB (keys, ETags, checksum
# fields); a published manifest of a 163-shard model ~40 KB; tokenizer.json of a 150k vocabulary
# ~11 MB; an S3 error document < 1 KB.
LIST_PAGE_MAX = 16 << 20
LIST_TOTAL_MAX = 256 << 20  # all pages of one listing together: ~500k keys, past any model tree
SMALL_OBJECT_MAX = 64 << 20  # a whole-object GET (get_bytes: manifests, configs)
ERROR_BODY_MAX = 64 << 10  # what is read of an error answer (the rest is dropped)
# Each request's whole answer must arrive within REQUEST_BASE_S plus its size at MIN_RATE. The
# socket timeout bounds one recv only, so a store that trickles a byte every few seconds would
# otherwise hold a worker forever. A healthy S3 GET moves 50-100+ MB/s per connection (the
# transfer benchmark's figures); 1 MiB/s is a store or link that is broken, not slow.
REQUEST_BASE_S = 60.0
MIN_RATE = 1 << 20  # bytes per second
_UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~"


@dataclass(frozen=True)
class S3Url:
    """`s3://bucket/prefix/` split into bucket and key prefix."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """Parse an s3:// URL; raise SourceError on anything else.

        S3Url.parse("s3://models/DeepSeek-V4-Flash/")
        """
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise SourceError(f"{url!r} is not an s3://bucket/prefix URL")
        return cls(parsed.netloc, parsed.path.lstrip("/"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass
class S3Object:
    """One listed object."""

    key: str
    size: int
    etag: str
    checksum_algorithm: str | None = None
    checksum_type: str | None = None


@dataclass
class ObjectChecksum:
    """What HeadObject with checksum mode says about an object's own checksum."""

    sha256_b64: str | None  # full-object or composite ("...-N") value as the store sends it
    checksum_type: str | None  # FULL_OBJECT or COMPOSITE
    version_id: str | None
    etag: str


@dataclass
class S3Call:
    """One S3 request: the method, the object key (None: the bucket itself) and what goes with
    it. `into` takes the answer's body in place; `on_data(start, end)` hears of each slice
    `into[start:end]` as it arrives (a retry starts again from 0, so the consumer must accept
    the same range twice)."""

    method: str
    key: str | None
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    into: memoryview | None = None
    ok: tuple[int, ...] = (200,)
    on_data: Callable[[int, int], None] | None = None
    limit: int = SMALL_OBJECT_MAX  # the most body bytes a good answer may have (not `into`)
    kind: str = "object"  # what the answer is, for the error naming a bound

    def budget_s(self) -> float:
        """Seconds one attempt may take: REQUEST_BASE_S plus its body at MIN_RATE."""
        size = len(self.into) if self.into is not None else self.limit
        return REQUEST_BASE_S + (0 if self.method == "HEAD" else size) / MIN_RATE

    def deadline_s(self, request_deadline_s: float) -> float:
        """Seconds all attempts together may take, backoffs included: the client's request
        deadline, or one attempt's budget where that is longer."""
        return max(request_deadline_s, self.budget_s())


class _Watchdog:
    """Shuts a connection's socket down when a request runs past its budget, so a blocked or
    trickling read ends; `fired` says it did."""

    def __init__(
        self, conn: http.client.HTTPConnection, seconds: float, why: str | None = None
    ) -> None:
        self.conn = conn
        self.fired = False
        self.seconds = seconds
        self.why = why
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()

    def reason(self) -> str:
        if self.why:
            return self.why
        return (
            f"no complete answer within {self.seconds:.0f}s (slower than "
            f"{MIN_RATE >> 20} MiB/s after {REQUEST_BASE_S:.0f}s)"
        )


class S3RequestError(WeightsError):
    """An S3 answer with an error status, already parsed."""

    def __init__(self, status: int, code: str, message: str, what: str, hint: str | None = None):
        super().__init__(f"{what}: HTTP {status} {code}: {message}".rstrip(": "), hint)
        self.status = status
        self.code = code


def _quote(value: str, safe: str = "") -> str:
    return urllib.parse.quote(value, safe=safe + _UNRESERVED)


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode("utf-8"), hashlib.sha256).digest()


class Signer:
    """AWS Signature Version 4 for S3 requests (header auth)."""

    def __init__(self, credentials: Credentials, region: str) -> None:
        self.credentials = credentials
        self.region = region
        self._key_cache: dict[tuple[str, str], bytes] = {}

    def _signing_key(self, secret: str, date: str) -> bytes:
        cached = self._key_cache.get((secret, date))
        if cached is None:
            key = _hmac(("AWS4" + secret).encode("utf-8"), date)
            key = _hmac(key, self.region)
            key = _hmac(key, "s3")
            cached = _hmac(key, "aws4_request")
            self._key_cache = {(secret, date): cached}
        return cached

    def sign(self, host: str, path: str, call: S3Call) -> dict[str, str]:
        """Return the call's headers with Authorization, x-amz-date and x-amz-content-sha256
        added."""
        method, query = call.method, call.query
        payload_sha256 = hashlib.sha256(call.body).hexdigest() if call.body else EMPTY_SHA256
        access_key, secret_key, token = self.credentials.get()
        now = dt.datetime.now(dt.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        date = amz_date[:8]
        out = dict(call.headers)
        out["host"] = host
        out["x-amz-date"] = amz_date
        out["x-amz-content-sha256"] = payload_sha256
        if token:
            out["x-amz-security-token"] = token
        signed = sorted(
            k.lower() for k in out if k.lower() == "host" or k.lower().startswith("x-amz-")
        )
        lowered = {k.lower(): " ".join(str(v).split()) for k, v in out.items()}
        canonical_headers = "".join(f"{k}:{lowered[k]}\n" for k in signed)
        canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
        canonical_request = "\n".join(
            [method, path, canonical_query, canonical_headers, ";".join(signed), payload_sha256]
        )
        scope = f"{date}/{self.region}/s3/aws4_request"
        string_to_sign = "\n".join(
            [
                "AWS4-HMAC-SHA256",
                amz_date,
                scope,
                hashlib.sha256(canonical_request.encode("utf-8")).hexdigest(),
            ]
        )
        signature = hmac.new(
            self._signing_key(secret_key, date), string_to_sign.encode("utf-8"), hashlib.sha256
        ).hexdigest()
        out["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
            f"SignedHeaders={';'.join(signed)}, Signature={signature}"
        )
        del out["host"]  # http.client sends Host itself
        return out


def _is_ip_or_localhost(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _dns_compatible(bucket: str) -> bool:
    return (
        3 <= len(bucket) <= 63
        and bucket.replace("-", "").replace(".", "").isalnum()
        and bucket.islower()
        and "." not in bucket
    )


@dataclass(frozen=True)
class Endpoint:
    """Where requests for one bucket go: scheme, Host header, bucket path prefix (path style)."""

    scheme: str
    host: str  # as sent in the Host header (may include :port)
    path_prefix: str  # "/bucket" for path style, "" for virtual-hosted
    style: str  # "virtual" | "path"

    def url(self, key: str = "") -> str:
        return f"{self.scheme}://{self.host}{self.path_prefix}/{key}"


def resolve_endpoint(
    endpoint_url: str | None, bucket: str, region: str, addressing: str
) -> Endpoint:
    """Choose the Host and path for `bucket` from the endpoint URL and the addressing style.

    resolve_endpoint("https://s3.example.com", "models", "us-east-1", "virtual").host
    # -> "models.s3.example.com"
    """
    if addressing not in ("virtual", "path", "auto"):
        raise SourceError(f"addressing must be virtual, path or auto, not {addressing!r}")
    if not endpoint_url:
        endpoint_url = f"https://s3.{region}.amazonaws.com"
    parsed = urllib.parse.urlparse(endpoint_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SourceError(f"endpoint URL {endpoint_url!r} must be http(s)://host[:port]")
    hostname = parsed.hostname
    netloc = hostname + (f":{parsed.port}" if parsed.port else "")
    # Seed 003: the endpoint already names the bucket (https://<BUCKET>.<S3_ENDPOINT>).
    if hostname.startswith(bucket + "."):
        return Endpoint(parsed.scheme, netloc, "", "virtual")
    style = addressing
    if style == "auto":
        style = (
            "path" if _is_ip_or_localhost(hostname) or not _dns_compatible(bucket) else "virtual"
        )
    if style == "virtual":
        if _is_ip_or_localhost(hostname):
            raise SourceError(
                f"virtual-hosted addressing needs a DNS name, not {hostname}",
                hint="use --addressing path for an IP or localhost endpoint",
            )
        return Endpoint(parsed.scheme, f"{bucket}.{netloc}", "", "virtual")
    return Endpoint(parsed.scheme, netloc, "/" + _quote(bucket), "path")


def _ssl_context() -> ssl.SSLContext:
    # Verification is never turned off; a private CA is added with AWS_CA_BUNDLE.
    ctx = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
    return ctx


class _Retry(Exception):
    def __init__(self, reason: str, delay_hint: float | None = None):
        super().__init__(reason)
        self.reason = reason


class S3Client:
    """Signed S3 requests over one keep-alive connection per thread, with retries."""

    def __init__(
        self,
        endpoint: Endpoint,
        signer: Signer,
        bucket: str,
        retries: int = 8,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.signer = signer
        self.bucket = bucket
        self.retries = retries
        self.request_deadline_s = S3_REQUEST_DEADLINE_S  # all attempts of one request
        self.timeout = 60.0
        self.on_retry = on_retry
        self._local = threading.local()
        self._ssl = _ssl_context() if endpoint.scheme == "https" else None
        self._proxy = self._proxy_for(endpoint)
        self.request_count = 0
        self._count_lock = threading.Lock()

    @staticmethod
    def _proxy_for(endpoint: Endpoint) -> tuple[str, int] | None:
        # HTTP(S)_PROXY / NO_PROXY like the AWS CLI; labs often reach object stores through one.
        proxies = urllib.request.getproxies()
        url = proxies.get(endpoint.scheme)
        if not url:
            return None
        host_only = endpoint.host.rsplit(":", 1)[0] if ":" in endpoint.host else endpoint.host
        if urllib.request.proxy_bypass(host_only):
            return None
        parsed = urllib.parse.urlparse(url if "://" in url else f"http://{url}")
        return parsed.hostname or "", parsed.port or 80

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            host, _, port = self.endpoint.host.rpartition(":")
            if not host or not port.isdigit():
                host, port = self.endpoint.host, ""
            target_port = int(port) if port else (443 if self.endpoint.scheme == "https" else 80)
            if self._proxy and self.endpoint.scheme == "https":
                conn = http.client.HTTPSConnection(
                    self._proxy[0], self._proxy[1], timeout=self.timeout, context=self._ssl
                )
                conn.set_tunnel(host, target_port)
            elif self._proxy:
                conn = http.client.HTTPConnection(
                    self._proxy[0], self._proxy[1], timeout=self.timeout
                )
            elif self.endpoint.scheme == "https":
                conn = http.client.HTTPSConnection(
                    host, target_port, timeout=self.timeout, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(host, target_port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def object_path(self, key: str) -> str:
        return f"{self.endpoint.path_prefix}/{_quote(key, safe='/')}"

    def _what(self, key: str | None) -> str:
        return f"s3://{self.bucket}/{key}" if key is not None else f"s3://{self.bucket}"

    def request(self, call: S3Call) -> tuple[int, dict[str, str], bytes]:
        """Send one request with retries; read the body into `call.into` when given.

        status, headers, body = client.request(S3Call("GET", "a/config.json"))
        """
        key = call.key
        path = self.object_path(key) if key is not None else (self.endpoint.path_prefix or "") + "/"
        what = self._what(key)
        total = call.deadline_s(self.request_deadline_s)
        deadline = time.monotonic() + total
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._request_once(call, path, what, deadline)
            except _Retry as retry:
                # Full-jitter exponential backoff: spreads many workers hitting SlowDown at once.
                delay = random.uniform(0, min(10.0, 0.1 * 2**attempt))
                left = deadline - time.monotonic()
                if attempt > self.retries or left <= delay:
                    bound = (
                        f" (the request deadline, {total:.0f}s)" if attempt <= self.retries else ""
                    )
                    raise SourceError(
                        f"{what}: giving up after {attempt} attempts in "
                        f"{total - max(0.0, left):.0f}s{bound}: {scrub(retry.reason)}",
                        hint=self._connect_hint(retry.reason),
                    ) from None
                if self.on_retry:
                    self.on_retry(f"{what}: {scrub(retry.reason)}; retry {attempt} in {delay:.1f}s")
                time.sleep(delay)

    def _connect_hint(self, reason: str) -> str | None:
        if "refused" in reason or "resolve" in reason or "timed out" in reason:
            return (
                f"check the endpoint {self.endpoint.scheme}://{self.endpoint.host} and the network"
            )
        return None

    def _request_once(
        self, call: S3Call, path: str, what: str, deadline: float | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        signed = self.signer.sign(self.endpoint.host, path, call)
        query = call.query
        url = path + (
            "?" + "&".join(f"{_quote(k)}={_quote(v)}" for k, v in query.items()) if query else ""
        )
        if self._proxy and self.endpoint.scheme == "http":
            url = f"http://{self.endpoint.host}{url}"
        signed["Host"] = self.endpoint.host
        with self._count_lock:
            self.request_count += 1
        conn = self._connection()
        seconds, why = call.budget_s(), None
        if deadline is not None and deadline - time.monotonic() < seconds:
            seconds = max(0.0, deadline - time.monotonic())
            why = "the request deadline passed during this attempt"
        watchdog = _Watchdog(conn, seconds, why)
        try:
            conn.request(call.method, url, body=call.body or None, headers=signed)
            resp = conn.getresponse()
            status = resp.status
            resp_headers = {k.lower(): v for k, v in resp.getheaders()}
            if status in call.ok:
                return status, resp_headers, self._read_body(resp, resp_headers, call, what)
            data, _ = self._read_capped(resp, ERROR_BODY_MAX)
        except _Retry as retry:
            raise _Retry(watchdog.reason()) if watchdog.fired else retry from None
        except WeightsError:
            # The consumer failed (e.g. the disk is full) in the middle of a body, or the
            # answer is over its bound.
            self._drop_connection()
            raise
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            if watchdog.fired:
                raise _Retry(watchdog.reason()) from None
            raise self._transport_error(exc, what) from None
        finally:
            watchdog.cancel()
        if resp_headers.get("connection", "").lower() == "close":
            self._drop_connection()
        code, message = _parse_error(data)
        if status in RETRYABLE_STATUS or code in RETRYABLE_CODES:
            raise _Retry(f"HTTP {status} {code or ''}".strip())
        raise self._error(
            status, code or http.client.responses.get(status, ""), message, what, resp_headers
        )

    def _read_capped(self, resp: http.client.HTTPResponse, limit: int) -> tuple[bytes, bool]:
        """(at most `limit` bytes of the body, chunked or not; whether there was more). A
        longer body is cut there and its connection dropped: the rest is never read."""
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = resp.read(min(RECV_SLICE, limit + 1 - total))
            if not chunk:
                return b"".join(chunks), False
            total += len(chunk)
            chunks.append(chunk)
        self._drop_connection()
        return b"".join(chunks)[:limit], True

    def _read_body(
        self, resp: http.client.HTTPResponse, headers: dict[str, str], call: S3Call, what: str
    ) -> bytes:
        """A good answer's body: whole (at most `call.limit` bytes, else a SourceError), or b""
        once it is read into `call.into` in slices."""
        into = call.into
        if into is None:
            declared = headers.get("content-length", "")
            if call.method != "HEAD" and declared.isdigit() and int(declared) > call.limit:
                self._drop_connection()
                raise SourceError(
                    f"{what}: the answer announces {int(declared)} bytes, over the "
                    f"{call.limit}-byte bound for {call.kind}"
                )
            body, more = self._read_capped(resp, call.limit)
            if more:
                raise SourceError(
                    f"{what}: the answer is longer than the {call.limit}-byte bound for "
                    f"{call.kind} (stopped reading there)"
                )
            if call.method != "HEAD" and declared.isdigit() and len(body) != int(declared):
                self._drop_connection()
                raise _Retry(f"connection closed after {len(body)} of {declared} bytes")
            return body
        length = int(headers.get("content-length", "-1"))
        if length != len(into):
            resp.close()
            self._drop_connection()
            raise _Retry(f"expected {len(into)} bytes, server sends {length}")
        got = 0
        step = RECV_SLICE if call.on_data is not None else length
        while got < length:
            n = resp.readinto(into[got : got + step])
            if not n:
                break
            if call.on_data is not None:
                call.on_data(got, got + n)
            got += n
        if got != length:
            self._drop_connection()
            raise _Retry(f"connection closed after {got} of {length} bytes")
        return b""

    def _transport_error(self, exc: Exception, what: str) -> Exception:
        """What a failed connection, send or read becomes: a retry, or a TLS trust error."""
        host = self.endpoint.host
        if isinstance(exc, ssl.SSLCertVerificationError):
            return SourceError(
                f"{what}: TLS certificate of {host} not trusted: {exc.verify_message}",
                hint="add your CA with AWS_CA_BUNDLE=/path/ca.pem (verification stays on)",
            )
        if isinstance(exc, socket.gaierror):
            return _Retry(f"cannot resolve {host}")
        reason = getattr(exc, "strerror", None) or exc.__class__.__name__
        if isinstance(exc, ConnectionRefusedError):
            reason = f"connection to {host} refused"
        elif isinstance(exc, TimeoutError | socket.timeout):
            reason = f"connection to {host} timed out"
        return _Retry(str(reason))

    def _error(
        self, status: int, code: str, message: str, what: str, headers: dict[str, str]
    ) -> WeightsError:
        message = scrub(message)
        if code == "PathStyleDomainForbidden":
            return SourceError(
                f"{what}: HTTP {status} {code}: {message}",
                hint="this store forbids path-style requests: use --addressing virtual "
                "(requests go to https://<bucket>.<endpoint-host>/...)",
            )
        if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            region = headers.get("x-amz-bucket-region")
            if region:
                return SourceError(
                    f"{what}: bucket is in region {region}", hint=f"use --region {region}"
                )
        if code in CREDENTIAL_CODES or status == 403:
            return CredentialsError(
                f"{what}: HTTP {status} {code}: {message or 'access denied'}",
                hint="check the credentials reference (env file / profile) and the bucket policy",
            )
        if code == "NoSuchBucket":
            return SourceError(f"{what}: bucket does not exist on {self.endpoint.host}")
        if code == "NoSuchKey" or status == 404:
            return S3RequestError(status, code or "NotFound", message, what)
        return S3RequestError(status, code, message, what)

    # ---- operations -------------------------------------------------------------------------

    def list_objects(self, prefix: str) -> Iterator[S3Object]:
        """ListObjectsV2 over `prefix`, following continuation tokens.

        A listing is untrusted input: XML that does not parse, a size that is not an integer in
        0..5 TiB, or a continuation token seen before (a store that would loop forever) is a
        SourceError naming the page, never a traceback or a hang.
        """
        token: str | None = None
        seen: set[str] = set()
        pages = listed = 0
        what = f"listing of s3://{self.bucket}/{prefix}"
        while True:
            query = {"list-type": "2", "prefix": prefix}
            if token:
                query["continuation-token"] = token
            _, _, body = self.request(
                S3Call("GET", None, query=query, limit=LIST_PAGE_MAX, kind="a listing page")
            )
            pages += 1
            listed += len(body)
            if listed > LIST_TOTAL_MAX:
                raise SourceError(
                    f"{what}: {pages} pages came to more than {LIST_TOTAL_MAX >> 20} MiB of "
                    "listing; is the prefix right?"
                )
            try:
                root = ET.fromstring(body)
            except ET.ParseError as exc:
                raise SourceError(f"{what}: page {pages} is not valid XML ({exc})") from None
            ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            for item in root.findall(f"{ns}Contents"):
                key = item.findtext(f"{ns}Key") or ""
                algorithms = [a.text for a in item.findall(f"{ns}ChecksumAlgorithm") if a.text]
                yield S3Object(
                    key=key,
                    size=_listed_size(item.findtext(f"{ns}Size"), f"{what}: {key}"),
                    etag=(item.findtext(f"{ns}ETag") or "").strip('"'),
                    checksum_algorithm=",".join(algorithms) or None,
                    checksum_type=item.findtext(f"{ns}ChecksumType"),
                )
            if (root.findtext(f"{ns}IsTruncated") or "false").lower() != "true":
                return
            token = root.findtext(f"{ns}NextContinuationToken")
            if not token:
                return
            if token in seen or pages >= MAX_LIST_PAGES:
                raise SourceError(
                    f"{what}: the store sent continuation token {token[:40]!r} again "
                    f"(page {pages}); a listing that repeats itself would never end"
                    if token in seen
                    else f"{what}: more than {MAX_LIST_PAGES} pages; is the prefix right?"
                )
            seen.add(token)

    def head_checksum(self, key: str) -> ObjectChecksum:
        """HeadObject with x-amz-checksum-mode: ENABLED."""
        call = S3Call("HEAD", key, headers={"x-amz-checksum-mode": "ENABLED"})
        _, headers, _ = self.request(call)
        value = headers.get("x-amz-checksum-sha256")
        return ObjectChecksum(
            sha256_b64=value,
            checksum_type=headers.get("x-amz-checksum-type"),
            version_id=headers.get("x-amz-version-id"),
            etag=headers.get("etag", "").strip('"'),
        )

    def get_bytes(self, key: str) -> bytes:
        """GET a small object whole (at most SMALL_OBJECT_MAX bytes, else a SourceError)."""
        return self.request(S3Call("GET", key, kind="a whole-object GET"))[2]

    def get_range_into(
        self,
        key: str,
        offset: int,
        buf: memoryview,
        etag: str | None,
        on_data: Callable[[int, int], None] | None = None,
    ) -> dict[str, str]:
        """GET bytes [offset, offset+len(buf)) into `buf`; If-Match pins the listed version.

        With `on_data`, each received slice is handed over while it is still in the CPU cache.
        """
        headers = {"Range": f"bytes={offset}-{offset + len(buf) - 1}"}
        if etag:
            headers["If-Match"] = f'"{etag}"'
        try:
            _, resp_headers, _ = self.request(
                S3Call("GET", key, headers=headers, into=buf, ok=(206, 200), on_data=on_data)
            )
        except S3RequestError as exc:
            if exc.status == 412:
                raise SourceError(
                    f"s3://{self.bucket}/{key} changed while it was being downloaded (ETag is no "
                    f"longer {etag}); run the sync again"
                ) from None
            raise
        return resp_headers

    def put_bytes(self, key: str, body: bytes, content_type: str = "application/json") -> None:
        """PUT a small object (the published manifest) with its sha256 checksum."""
        checksum = base64.b64encode(hashlib.sha256(body).digest()).decode()
        headers = {"Content-Type": content_type, "x-amz-checksum-sha256": checksum}
        self.request(S3Call("PUT", key, headers=headers, body=body))

    def close(self) -> None:
        self._drop_connection()


@dataclass
class S3Options:
    """Where and how to reach S3; every field falls back to the standard AWS settings."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing: str = "auto"
    profile: str | None = None
    retries: int = 8
    request_deadline_s: float = S3_REQUEST_DEADLINE_S  # all attempts of one request together

    def resolved_region(self) -> str:
        from hgxserve.weights.credentials import profile_setting

        return (
            self.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or profile_setting(self.profile or os.environ.get("AWS_PROFILE"), "region")
            or "us-east-1"
        )

    def resolved_endpoint_url(self) -> str | None:
        from hgxserve.weights.credentials import profile_setting

        return (
            self.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or profile_setting(self.profile or os.environ.get("AWS_PROFILE"), "endpoint_url")
        )


# 1000 keys a page: a model tree is a few thousand objects at most
MAX_LIST_PAGES = 1_000


def _listed_size(text: str | None, what: str) -> int:
    try:
        size = int(text or "")
    except ValueError:
        raise SourceError(f"{what}: listed size {text!r} is not an integer") from None
    try:
        return check_size(size, what)
    except VerifyError as exc:
        raise SourceError(str(exc)) from None


def make_client(
    bucket: str, options: S3Options, on_retry: Callable[[str], None] | None = None
) -> S3Client:
    """An S3Client for `bucket` with credentials from the standard chain.

    client = make_client("models", S3Options(endpoint_url="http://127.0.0.1:9000"))
    """
    from hgxserve.weights.credentials import resolve_credentials

    region = options.resolved_region()
    endpoint = resolve_endpoint(options.resolved_endpoint_url(), bucket, region, options.addressing)
    creds = resolve_credentials(options.profile)
    client = S3Client(endpoint, Signer(creds, region), bucket, options.retries, on_retry=on_retry)
    client.request_deadline_s = options.request_deadline_s
    return client


def _parse_error(body: bytes) -> tuple[str, str]:
    if not body:
        return "", ""
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return "", body[:200].decode("utf-8", "replace").strip()
    return (root.findtext("Code") or "", root.findtext("Message") or "")
