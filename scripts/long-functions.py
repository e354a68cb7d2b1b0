#!/usr/bin/env python3
"""Lists the production functions in crates/*/src that are longer than a limit.

    scripts/long-functions.py [--limit LINES] [--max-count N] [--all]

A function's length is counted in lines from the line of its `fn` keyword to
the line of its body's closing brace. Test code is skipped: files named
tests.rs or *_tests.rs, files under a tests/ directory, and items marked
#[cfg(test)] (in practice the `mod tests` blocks). Closures are not counted;
a function nested in another is counted on its own (and inside its parent).

The scan works on tokens, not on raw text, so braces inside string, char and
raw-string literals and inside comments do not count. It is not a Rust
parser: it only needs to find `fn NAME`, the body's braces and cfg(test)
attributes, which the tokens alone settle.

Prints `LINES path:line name` for each function over the limit, longest
first, and then the count. With --max-count N it exits 1 when more than N
functions are over the limit (for CI); --all prints every function.
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tokens(text):
    """Yields (kind, value, line) for identifiers and punctuation.

    String, char and byte literals are yielded as one ("lit", "", line)
    token; comments and lifetimes are dropped. `kind` is "id" or "p".
    """
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            # Block comments nest in Rust.
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        line += 1
                    i += 1
        elif c == '"':
            start = line
            i, line = skip_string(text, i + 1, line)
            yield ("lit", "", start)
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime/label ('a).
            if i + 1 < n and text[i + 1] == "\\":
                j = i + 2
                while j < n and text[j] != "'":
                    j += 2 if text[j] == "\\" else 1
                i = j + 1
                yield ("lit", "", line)
            elif i + 2 < n and text[i + 2] == "'":
                i += 3
                yield ("lit", "", line)
            else:
                i += 1
                while i < n and (text[i].isalnum() or text[i] == "_"):
                    i += 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            # Raw strings r"..", r#".."#, br#".."#; byte strings b"..", b'x'.
            if word in ("r", "br", "cr") and j < n and text[j] in "#\"":
                k = j
                while k < n and text[k] == "#":
                    k += 1
                if k < n and text[k] == '"':
                    hashes = k - j
                    close = '"' + "#" * hashes
                    end = text.find(close, k + 1)
                    end = n if end < 0 else end + len(close)
                    start = line
                    line += text.count("\n", i, end)
                    i = end
                    yield ("lit", "", start)
                    continue
                # r#ident: a raw identifier.
                j = k
                while j < n and (text[j].isalnum() or text[j] == "_"):
                    j += 1
                yield ("id", text[k:j], line)
                i = j
                continue
            if word in ("b", "c") and j < n and text[j] == '"':
                start = line
                i, line = skip_string(text, j + 1, line)
                yield ("lit", "", start)
                continue
            if word == "b" and j < n and text[j] == "'":
                k = j + 1
                while k < n and text[k] != "'":
                    k += 2 if text[k] == "\\" else 1
                i = k + 1
                yield ("lit", "", line)
                continue
            yield ("id", word, line)
            i = j
        elif c.isdigit():
            j = i
            while j < n and (text[j].isalnum() or text[j] in "_."):
                # Stop before `..` (ranges) and method calls on literals.
                if text[j] == "." and not (j + 1 < n and text[j + 1].isdigit()):
                    break
                j += 1
            i = j
            yield ("lit", "", line)
        else:
            yield ("p", c, line)
            i += 1


def skip_string(text, i, line):
    """Returns the index after the closing quote of a string opened before i."""
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if i + 1 < n and text[i + 1] == "\n":
                line += 1
            i += 2
        elif c == '"':
            return i + 1, line
        else:
            if c == "\n":
                line += 1
            i += 1
    return i, line


def matching(toks, i):
    """Index of the token closing the bracket at toks[i]."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    stack = []
    for j in range(i, len(toks)):
        v = toks[j][1] if toks[j][0] == "p" else None
        if v in pairs:
            stack.append(pairs[v])
        elif v in (")", "]", "}"):
            if not stack:
                return j
            stack.pop()
            if not stack:
                return j
    return len(toks) - 1


def is_test_cfg(toks, i):
    """Whether toks[i] starts a `#[cfg(test)]`-like attribute (cfg(all(test, ..)) too)."""
    if not (toks[i][1] == "#" and i + 2 < len(toks) and toks[i + 1][1] == "["):
        return False
    end = matching(toks, i + 1)
    words = [t[1] for t in toks[i + 2 : end]]
    if not words or words[0] != "cfg":
        return False
    # `test` must be a condition that must hold, not one under not(..).
    for k, w in enumerate(words):
        if w == "test" and not (k >= 2 and words[k - 2] == "not"):
            return True
    return False


def item_end(toks, i):
    """Index of the last token of the item starting at or after toks[i]
    (its closing brace, or its `;`), skipping its attributes."""
    j = i
    while j < len(toks):
        kind, v, _ = toks[j]
        if kind == "p" and v == "#":
            j = matching(toks, j + 1) + 1
            continue
        if kind == "p" and v == ";":
            return j
        if kind == "p" and v == "{":
            return matching(toks, j)
        if kind == "p" and v in "([":
            j = matching(toks, j) + 1
            continue
        j += 1
    return len(toks) - 1


def functions(text):
    """Yields (first_line, last_line, name) for each fn with a body, outside cfg(test)."""
    toks = list(tokens(text))
    skip_until = -1
    i = 0
    while i < len(toks):
        kind, v, line = toks[i]
        if i <= skip_until:
            i += 1
            continue
        if kind == "p" and v == "#" and is_test_cfg(toks, i):
            attr_end = matching(toks, i + 1)
            skip_until = item_end(toks, attr_end + 1)
            i = skip_until + 1
            continue
        if kind == "id" and v == "fn" and i + 1 < len(toks) and toks[i + 1][0] == "id":
            name = toks[i + 1][1]
            # The body is the first `{` outside the signature's parens and
            # brackets; a `;` first means a declaration without a body.
            j = i + 2
            while j < len(toks):
                k2, v2, _ = toks[j]
                if k2 == "p" and v2 in "([":
                    j = matching(toks, j) + 1
                    continue
                if k2 == "p" and v2 in "{;":
                    break
                j += 1
            if j < len(toks) and toks[j][1] == "{":
                end = matching(toks, j)
                yield (line, toks[end][2], name)
        i += 1


def is_test_file(path):
    rel = path.relative_to(ROOT)
    return (
        path.name == "tests.rs"
        or path.name.endswith("_tests.rs")
        or "tests" in rel.parts[:-1]
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=80, help="longest allowed (lines)")
    ap.add_argument("--max-count", type=int, help="exit 1 if more functions are over the limit")
    ap.add_argument("--all", action="store_true", help="print every function")
    args = ap.parse_args()

    found = []
    for path in sorted(ROOT.glob("crates/*/src/**/*.rs")):
        if is_test_file(path):
            continue
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        for first, last, name in functions(text):
            found.append((last - first + 1, f"{rel}:{first}", name))
    found.sort(key=lambda f: (-f[0], f[1]))
    over = [f for f in found if f[0] > args.limit]
    for length, where, name in found if args.all else over:
        print(f"{length:5} {where} {name}")
    print(f"{len(over)} functions over {args.limit} lines ({len(found)} scanned)")
    if args.max_count is not None and len(over) > args.max_count:
        print(f"more than {args.max_count} functions are over {args.limit} lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
