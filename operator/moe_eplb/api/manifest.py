"""Reading manifests (YAML or JSON) a person or a tool hands to ``moe-eplb validate|render``, bounded.

A hostile or broken file must give one clear line, fast, and never a traceback, a hang or unbounded
memory. :func:`load_documents` refuses, naming the file, the place and the limit:

* more than :data:`MAX_BYTES` (the API server's own request limit, 3 MiB);
* bytes that are not UTF-8 (with the offset of the first bad byte);
* nesting deeper than :data:`MAX_DEPTH`, more than :data:`MAX_ALIASES` YAML aliases, or a document
  that would expand to more than :data:`MAX_NODES` values through aliases (a "billion laughs" bomb
  is refused while still a small graph, before anything is expanded);
* duplicate keys in a mapping (kubectl refuses them too; YAML loaders silently keep the last);
* more than :data:`MAX_DOCUMENTS` documents in one file;
* anything YAML itself rejects, control bytes (NUL ...) included (with the line and column).

:class:`ManifestError` is a kind of :class:`moe_eplb.contracts.bounded_read.InputError`, the one error type of
every bounded reader.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

from moe_eplb.contracts.bounded_read import InputError

MAX_BYTES = 3 * 1024 * 1024
MAX_DEPTH = 64
MAX_ALIASES = 64
MAX_NODES = 200_000
#: Most documents in one manifest file (each is validated, and rendered, on its own: 6,000 took 29 s).
MAX_DOCUMENTS = 100


class ManifestError(InputError):
    """A manifest that cannot be read; ``str()`` is one line naming the file, the place and the fix."""


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with depth, alias and duplicate-key checks."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise ManifestError(f"more than {MAX_ALIASES} YAML aliases (at {_where(self.peek_event().start_mark)}); "
                                    "a Kubernetes manifest needs none: write the values out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ManifestError(f"nested deeper than {MAX_DEPTH} levels (at {_where(self.peek_event().start_mark)})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                if key in seen:
                    raise ManifestError(f"duplicate key {str(key)[:80]!r} at {_where(key_node.start_mark)} (first at "
                                        f"{_where(seen[key])}); keep one")
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: Any, memo: dict[int, int], depth: int = 0) -> int:
    """Values the composed ``node`` would expand to with every alias written out (memoized: an
    alias is a shared node, counted without expanding it)."""
    key = id(node)
    if key in memo:
        return memo[key]
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo, depth + 1) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo, depth + 1) + _expanded_size(v, memo, depth + 1) for k, v in node.value)
    memo[key] = size
    return size


def parse_documents(text: str, source: str = "<input>") -> list[Any]:
    """Every non-empty document of ``text`` (YAML, which includes JSON), within the limits above."""
    docs: list[Any] = []
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses control bytes at once: inside the try
        while loader.check_node():
            if len(docs) >= MAX_DOCUMENTS:
                raise ManifestError(f"more than {MAX_DOCUMENTS} documents (at {_where(loader.peek_event().start_mark)}); "
                                    "split the file")
            node = loader.get_node()
            if node is None:
                continue
            size = _expanded_size(node, {})
            if size > MAX_NODES:
                raise ManifestError(f"{source}: a document at {_where(node.start_mark)} expands to {size} values "
                                    f"through YAML aliases (at most {MAX_NODES}); write the values out")
            doc = loader.construct_document(node)
            if doc is not None:
                docs.append(doc)
    except ManifestError as exc:
        raise ManifestError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from None
    except yaml.reader.ReaderError as exc:
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        raise ManifestError(f"{source}: control character U+{ord(char):04X} at character {exc.position} "
                            f"(line {text.count(chr(10), 0, exc.position) + 1}); a manifest is printable text") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise ManifestError(f"{source}: not valid YAML at {_where(mark)}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{source}: not valid YAML: {str(exc).splitlines()[0][:200]}") from None
    except RecursionError:  # belt and braces: the depth limit comes first
        raise ManifestError(f"{source}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    finally:
        if loader is not None:
            loader.dispose()
    return docs


def _decode(raw: bytes, source: str) -> str:
    if len(raw) > MAX_BYTES:
        raise ManifestError(f"{source}: more than {MAX_BYTES} bytes ({MAX_BYTES // 2**20} MiB, the API server's "
                            "request limit); a MoEInference is a few kB")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{source}: not UTF-8 text (byte {exc.start}: 0x{raw[exc.start]:02x}); "
                            "save the manifest as UTF-8") from None


def load_documents(path: str | os.PathLike) -> list[Any]:
    """The documents of manifest file ``path`` (``-``: standard input), bounded; ManifestError otherwise."""
    source = str(path)
    try:
        if source == "-":
            raw = sys.stdin.buffer.read(MAX_BYTES + 1)
        else:
            p = Path(path)
            if p.is_dir():
                raise ManifestError(f"{source}: is a directory; give a manifest file")
            size = p.stat().st_size
            if size > MAX_BYTES:
                raise ManifestError(f"{source}: {size} bytes, more than {MAX_BYTES} ({MAX_BYTES // 2**20} MiB, the "
                                    "API server's request limit); a MoEInference is a few kB")
            with open(p, "rb") as fh:
                raw = fh.read(MAX_BYTES + 1)
    except ManifestError:
        raise
    except OSError as exc:
        raise ManifestError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    return parse_documents(_decode(raw, source), source)
