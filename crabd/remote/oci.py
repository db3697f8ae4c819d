"""A small OCI distribution-spec client: the transport under crabd.remote.

Why not a library: `oras` on PyPI (oras-py) is the maintained Python ORAS
client, but it is built on `requests` (a second HTTP stack beside the httpx
crabd already uses), pushes files named by path with its own manifest
layout, and gives no hook to stream a blob we are still producing or to
skip blobs per digest under our control. What crabd needs of the spec is
small, so it is spelled out here on httpx:

* blobs: HEAD (does the registry have it?), monolithic upload (POST to open
  a session, PUT with `?digest=`), GET into a file with the sha256 checked
  while it streams;
* manifests: PUT and GET by tag or digest; the digest of what came back is
  computed here, and checked when the reference named one;
* auth: a 401 names its scheme in `WWW-Authenticate`; Basic answers with the
  credentials, Bearer with a token fetched from the realm (Docker's token
  dance, with the credentials as Basic when there are any). Credentials
  come from an explicit "user:password" or from ~/.docker/config.json
  (`auths.<host>.auth`, base64 user:password);
* plain HTTP only for localhost/127.0.0.1/::1 or when the caller says so.

Errors: a registry that is unreachable or answers with an error raises
`crabd.errors.RegistryError`; content that does not match its digest raises
`crabd.errors.IntegrityError`. The HTTP transport can be injected (httpx's
own seam), so unit tests drive the real code with `httpx.MockTransport`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import httpx

from ..errors import IntegrityError, InvalidArgument, RegistryError

__all__ = ["Reference", "Registry", "parse_reference", "REFERENCE_PATTERN", "docker_credentials", "sha256_file"]

_LOCAL_HOSTS = {"localhost", "127.0.0.1", "[::1]", "::1"}
_HOST = r"(?:localhost(?::[0-9]{1,5})?|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+(?::[0-9]{1,5})?|[A-Za-z0-9-]+:[0-9]{1,5})"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# The whole grammar as one pattern: the API's schema states it, parse_reference applies it.
REFERENCE_PATTERN = (rf"^({_HOST})/({_COMPONENT}(?:/{_COMPONENT})*)(?::([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}))?"
                     r"(?:@(sha256:[0-9a-f]{64}))?$")
_REF_RE = re.compile(REFERENCE_PATTERN)
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_TIMEOUT = httpx.Timeout(30.0, read=300.0)


@dataclass(frozen=True)
class Reference:
    """host[:port]/repository[:tag][@sha256:...]"""

    host: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def target(self) -> str:
        """What the manifest endpoint is asked for: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> "Reference":
        return Reference(self.host, self.repository, self.tag, digest)

    def __str__(self) -> str:
        s = f"{self.host}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def parse_reference(ref: str) -> Reference:
    """Parse `host[:port]/repo[:tag][@digest]`; the host part is required
    (crabd has no default registry: a checkpoint must not go to Docker Hub
    by accident)."""
    m = _REF_RE.fullmatch(ref)
    if m is None:
        raise InvalidArgument(f"reference {ref!r} is not HOST[:PORT]/REPOSITORY[:TAG][@sha256:DIGEST]",
                              fix="e.g. 127.0.0.1:5000/crabd/sb1:turn3: the host is required (a dot, a port "
                                  "or localhost), repositories are lower-case")
    host, repo, tag, digest = m.groups()
    if tag is None and digest is None:
        tag = "latest"
    return Reference(host, repo, tag, digest)


def docker_credentials(host: str, config_path: str | os.PathLike[str] | None = None) -> tuple[str, str] | None:
    """(user, password) for `host` from a Docker config file (`auths`), or None.

    Default path: $DOCKER_CONFIG/config.json, else ~/.docker/config.json.
    Credential helpers (`credsStore`) are not run: only inline `auth`."""
    if config_path is None:
        base = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
        config_path = os.path.join(base, "config.json")
    try:
        doc = json.loads(Path(config_path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"cannot read Docker config {config_path}: {e}",
                              fix="fix the file's JSON or pass --registry-auth USER:PASSWORD") from None
    auths = doc.get("auths") or {}
    for key in (host, f"https://{host}", f"http://{host}", f"https://{host}/v2/", f"http://{host}/v2/"):
        entry = auths.get(key)
        if entry and entry.get("auth"):
            try:
                user, _, pw = base64.b64decode(entry["auth"]).decode().partition(":")
            except ValueError:
                raise InvalidArgument(f"the `auth` of {key} in {config_path} is not base64 user:password",
                                      fix="run `docker login` again or pass --registry-auth") from None
            return user, pw
    return None


def sha256_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return "sha256:" + h.hexdigest(), n


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


class Registry:
    """One registry host, one repository's worth of requests at a time (see module doc)."""

    def __init__(self, host: str, *, auth: str | None = None, docker_config: str | None = None,
                 insecure: bool = False, transport: httpx.BaseTransport | None = None) -> None:
        self.host = host
        bare = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        plain = insecure or bare in _LOCAL_HOSTS
        self.base = f"{'http' if plain else 'https'}://{host}"
        if auth is not None:
            user, sep, pw = auth.partition(":")
            if not sep:
                raise InvalidArgument("--registry-auth must be USER:PASSWORD")
            self.creds: tuple[str, str] | None = (user, pw)
        else:
            self.creds = docker_credentials(host, docker_config)
        self._http = httpx.Client(timeout=_TIMEOUT, transport=transport, follow_redirects=True)
        self._authz: str | None = None  # the Authorization header that worked last

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests, with the auth dance ---------------------------------------------------
    def _request(self, method: str, url: str, *, stream: bool = False, **kw: Any) -> httpx.Response:
        if not url.startswith("http"):
            url = self.base + url
        for attempt in range(2):
            headers = dict(kw.pop("headers", None) or {})
            if self._authz:
                headers["Authorization"] = self._authz
            try:
                req = self._http.build_request(method, url, headers=headers, **kw)
                resp = self._http.send(req, stream=stream)
            except httpx.HTTPError as e:
                raise RegistryError(f"registry {self.host} unreachable during {method} {url.split('/v2/', 1)[-1]}: "
                                    f"{type(e).__name__}: {e}",
                                    fix="check that the registry runs and the reference's host:port is right; "
                                        "nothing was changed on this host, run the command again") from None
            if resp.status_code != 401 or attempt == 1:
                return resp
            challenge = resp.headers.get("www-authenticate", "")
            resp.close()
            self._authz = self._answer(challenge)
            kw["headers"] = headers
        raise AssertionError("unreachable")

    def _answer(self, challenge: str) -> str:
        scheme, params = _parse_challenge(challenge)
        if scheme == "basic":
            if self.creds is None:
                raise RegistryError(f"registry {self.host} needs credentials",
                                    fix="pass --registry-auth USER:PASSWORD or `docker login` (~/.docker/config.json)")
            raw = f"{self.creds[0]}:{self.creds[1]}".encode()
            return "Basic " + base64.b64encode(raw).decode()
        if scheme == "bearer":
            realm = params.pop("realm", "")
            if not realm:
                raise RegistryError(f"registry {self.host} asked for a Bearer token without a realm: {challenge!r}")
            auth = httpx.BasicAuth(*self.creds) if self.creds else None
            try:
                r = self._http.get(realm, params=params, auth=auth)
            except httpx.HTTPError as e:
                raise RegistryError(f"token service {realm} unreachable: {e}") from None
            if r.status_code != 200:
                raise RegistryError(f"token service {realm} refused ({r.status_code}): {r.text[:200]}",
                                    fix="check the credentials (--registry-auth or ~/.docker/config.json)")
            doc = r.json()
            token = doc.get("token") or doc.get("access_token")
            if not token:
                raise RegistryError(f"token service {realm} returned no token")
            return f"Bearer {token}"
        raise RegistryError(f"registry {self.host} wants auth scheme {scheme!r}, which crabd does not speak")

    def _check(self, resp: httpx.Response, what: str, ok: tuple[int, ...]) -> httpx.Response:
        if resp.status_code in ok:
            return resp
        if resp.is_stream_consumed is False:
            resp.read()
        body = resp.text[:300]
        fix = None
        if resp.status_code == 401:
            fix = "the credentials were refused: check --registry-auth or ~/.docker/config.json"
        elif resp.status_code == 403:
            fix = "the credentials may not write this repository"
        raise RegistryError(f"registry {self.host}: {what} failed with HTTP {resp.status_code}: {body}", fix=fix)

    # ---- blobs ----------------------------------------------------------------------------
    def has_blob(self, repo: str, digest: str) -> bool:
        r = self._request("HEAD", f"/v2/{repo}/blobs/{digest}")
        if r.status_code == 404:
            return False
        self._check(r, f"HEAD blob {digest[:19]}", (200,))
        return True

    def push_blob(self, repo: str, path: str | os.PathLike[str], digest: str, size: int) -> None:
        """Monolithic upload of the file at `path` (POST opens the session, PUT ?digest= closes it)."""
        r = self._check(self._request("POST", f"/v2/{repo}/blobs/uploads/"), "open a blob upload", (202,))
        loc = r.headers.get("location")
        if not loc:
            raise RegistryError(f"registry {self.host} opened an upload without a Location")
        if loc.startswith("/"):
            loc = self.base + loc
        sep = "&" if "?" in loc else "?"
        with open(path, "rb") as f:
            r = self._request("PUT", f"{loc}{sep}digest={digest}", content=_file_chunks(f),
                              headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
        self._check(r, f"upload blob {digest[:19]}", (201,))

    def push_bytes(self, repo: str, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.has_blob(repo, digest):
            return digest
        r = self._check(self._request("POST", f"/v2/{repo}/blobs/uploads/"), "open a blob upload", (202,))
        loc = r.headers["location"]
        if loc.startswith("/"):
            loc = self.base + loc
        sep = "&" if "?" in loc else "?"
        self._check(self._request("PUT", f"{loc}{sep}digest={digest}", content=data,
                                  headers={"Content-Type": "application/octet-stream"}),
                    f"upload blob {digest[:19]}", (201,))
        return digest

    def pull_blob(self, repo: str, digest: str, dest: BinaryIO, size: int | None = None) -> int:
        """Stream blob `digest` into `dest`; raises IntegrityError when the bytes do not hash to it."""
        if not _DIGEST_RE.match(digest):
            raise IntegrityError(f"blob digest {digest!r} is not sha256:<hex>")
        r = self._request("GET", f"/v2/{repo}/blobs/{digest}", stream=True)
        try:
            self._check(r, f"GET blob {digest[:19]}", (200,))
            h = hashlib.sha256()
            n = 0
            try:
                for chunk in r.iter_bytes(1 << 20):
                    h.update(chunk)
                    dest.write(chunk)
                    n += len(chunk)
                    if size is not None and n > size:
                        break
            except httpx.HTTPError as e:
                raise RegistryError(f"registry {self.host} broke off blob {digest[:19]}: {e}",
                                    fix="nothing was imported; run the command again") from None
        finally:
            r.close()
        got = "sha256:" + h.hexdigest()
        if got != digest or (size is not None and n != size):
            raise IntegrityError(f"blob {digest} from {self.host}/{repo} does not match its digest "
                                 f"(got {got}, {n} bytes): refused, nothing imported",
                                 fix="the registry's copy is corrupt or was tampered with: push the checkpoint again")
        return n

    def pull_small(self, repo: str, digest: str, limit: int = 64 << 20) -> bytes:
        import io
        buf = io.BytesIO()
        self.pull_blob(repo, digest, buf)
        if buf.tell() > limit:
            raise IntegrityError(f"blob {digest} is larger than {limit} bytes")
        return buf.getvalue()

    # ---- manifests ------------------------------------------------------------------------
    def put_manifest(self, ref: Reference, manifest: dict[str, Any]) -> str:
        body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        r = self._request("PUT", f"/v2/{ref.repository}/manifests/{ref.tag or 'latest'}", content=body,
                          headers={"Content-Type": manifest["mediaType"]})
        self._check(r, f"PUT manifest {ref}", (201,))
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        said = r.headers.get("docker-content-digest")
        if said and said != digest:
            raise RegistryError(f"registry {self.host} stored manifest {said}, crabd sent {digest}")
        return digest

    def get_manifest(self, ref: Reference, media_type: str) -> tuple[dict[str, Any], str]:
        """The manifest `ref` names and its digest (checked against the reference's when it has one)."""
        r = self._request("GET", f"/v2/{ref.repository}/manifests/{ref.target}",
                          headers={"Accept": media_type})
        if r.status_code == 404:
            from ..errors import NotFound
            raise NotFound(f"no manifest {ref} in the registry", fix="check the reference (host/repository:tag)")
        self._check(r, f"GET manifest {ref}", (200,))
        body = r.content
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if ref.digest and digest != ref.digest:
            raise IntegrityError(f"manifest {ref} does not match its digest (got {digest}): refused",
                                 fix="the registry's copy is corrupt or was tampered with")
        said = r.headers.get("docker-content-digest")
        if said and said != digest:
            raise IntegrityError(f"manifest {ref}: the registry says {said} but the bytes hash to {digest}")
        try:
            doc = json.loads(body)
        except ValueError:
            raise IntegrityError(f"manifest {ref} is not JSON") from None
        return doc, digest


def _file_chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(1 << 20):
        yield chunk
