"""URI helpers shared by every store: schemes, glob matching, and shard names.

One glob dialect for all stores, so that a source selects the same shards on S3, on local disk
and through fsspec: `*` and `?` stay within one path segment, `**` crosses `/`, and `**/` also
matches zero directories (`a/**/b` matches `a/b`). `[...]` is a character class (`[!...]` negates).
"""
from __future__ import annotations

import os
import re

GLOB_CHARS = "*?["
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(uri: str) -> str:
    """"s3", "file", "memory", ... or "" for a plain path."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else ""


def has_glob(text: str) -> bool:
    return any(ch in text for ch in GLOB_CHARS)


def literal_prefix(pattern: str) -> str:
    """The part of a pattern before its first glob character."""
    cut = min((i for i in (pattern.find(ch) for ch in GLOB_CHARS) if i >= 0), default=len(pattern))
    return pattern[:cut]


def glob_base(pattern: str) -> str:
    """The deepest directory (ending in '/', or "") that holds every match of `pattern`."""
    prefix = literal_prefix(pattern)
    return prefix[: prefix.rfind("/") + 1]


def glob_depth(pattern: str) -> int | None:
    """How many segments below glob_base() a match lies; None when `**` makes it unbounded."""
    rest = pattern[len(glob_base(pattern)):]
    return None if "**" in rest else rest.count("/") + 1


def glob_regex(pattern: str) -> re.Pattern[str]:
    """Compile `pattern` (see the module docstring) to a regex for re.fullmatch."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = i + 1
            if end < n and pattern[end] == "!":
                end += 1
            if end < n and pattern[end] == "]":  # a ']' first in the class is literal
                end += 1
            end = pattern.find("]", end)
            if end < 0:  # no closing bracket: a literal '['
                out.append(re.escape(ch))
            else:
                body = pattern[i + 1:end].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"(?!/)[{body}]")
                i = end
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def local_path(uri: str) -> str:
    """A plain path or file:// URI as an absolute local path (the form LocalStore returns)."""
    if scheme_of(uri) == "file":
        uri = uri[len("file://"):]
    return os.path.abspath(os.path.expanduser(uri))


def relative_name(root_uri: str, object_uri: str) -> str:
    """The name of `object_uri` relative to the non-glob root of `root_uri`, the URI that listed it.

    relative_name("s3://b/web/", "s3://b/web/sub/part-1.jsonl") == "sub/part-1.jsonl";
    a URI naming one object gives its basename. Shard names in state and errors use this.
    """
    scheme = scheme_of(root_uri)
    if scheme in ("", "file"):
        root, obj = local_path(root_uri), local_path(object_uri)
        if os.sep != "/":
            root, obj = root.replace(os.sep, "/"), obj.replace(os.sep, "/")
    else:
        root, obj = root_uri, object_uri
        if scheme != "s3":  # fsspec: compare paths in the filesystem's own stripped form
            import fsspec

            strip = fsspec.get_filesystem_class(scheme)._strip_protocol
            root, obj = strip(root_uri), strip(object_uri)
    if has_glob(root):
        base = glob_base(root)
    elif obj == root.rstrip("/"):
        return obj.rsplit("/", 1)[-1]
    elif obj.startswith(root.rstrip("/") + "/"):
        base = root.rstrip("/") + "/"
    else:  # listed as a raw key prefix ("s3://b/logs/2024-" lists "s3://b/logs/2024-01/x")
        base = root[: root.rfind("/") + 1]
    if not base or not obj.startswith(base) or obj == base:
        raise ValueError(f"{object_uri!r} is not under {root_uri!r}")
    return obj[len(base):]
