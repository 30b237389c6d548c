"""Container image references (``[registry[:port]/]repo[/path][:tag][@digest]``) and the vLLM
version in a tag.

``IMAGE_PATTERN`` is the same regular expression as the CRD's ``spec.engine.image`` pattern (a test
checks they are identical), so the apiserver and ``moe-eplb validate`` accept the same references.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moe_eplb.api.versions import Version, parse_version

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)"
_DOMAIN = rf"{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

IMAGE_PATTERN = (
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?$"
)
_IMAGE_RE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$"
)


_TAG_VERSION_RE = re.compile(r"^v?[0-9]+[.][0-9]+[.][0-9]+([^0-9].*)?$")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference. ``registry`` is None for Docker Hub short names."""

    registry: str | None
    repository: str
    tag: str | None
    digest: str | None

    @property
    def version(self) -> Version | None:
        """vLLM version from a tag that starts with it (``v0.12.0``, ``0.12.0-cu129``,
        ``v0.11.1rc1``), else None (``latest``, ``nightly-0.12.0``: set ``spec.engine.version``).
        The CRD's CEL rules read the tag the same way."""
        if not self.tag or not _TAG_VERSION_RE.match(self.tag):
            return None
        return parse_version(self.tag)


def parse_image(ref: str) -> ImageRef | None:
    """Parse ``ref``; None when it is not a valid image reference.

    A first component without a dot, colon or ``localhost`` is part of the repository, as Docker
    reads it (``vllm/vllm-openai`` is Docker Hub's ``vllm`` org).
    """
    if not ref or len(ref) > 512:
        return None
    match = _IMAGE_RE.match(ref)
    if not match:
        return None
    domain, path = match.group("domain"), match.group("path")
    if domain and not ("." in domain or ":" in domain or domain == "localhost"):
        # "vllm/vllm-openai": the regex took "vllm" as a domain; it is a path component
        if not re.fullmatch(_COMPONENT, domain):
            return None
        path, domain = f"{domain}/{path}", None
    return ImageRef(domain, path, match.group("tag"), match.group("digest"))
