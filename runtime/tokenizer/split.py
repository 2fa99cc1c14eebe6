"""Pre-tokenization: text -> words, cut exactly where llama.cpp cuts.

llama.cpp runs a pre-tokenizer's regexes one after the other, each splitting the pieces the last one left (a
match is a piece, and so is the text between two matches). Its regex engine is C++'s std::regex (ECMAScript),
which knows no Unicode classes, so llama.cpp works on a stand-in text: every non-ASCII character becomes one
byte naming its general category (letter, number, mark, punctuation, symbol), non-ASCII whitespace becomes a
vertical tab and anything else a byte no class holds; in the regex, \\p{L} becomes "that byte or A-Za-z", and so
on. One consequence is that \\p{Lu} and \\p{Ll} both mean "any letter" beyond ASCII: a case-splitting rule such as
GPT-4o's tells cases apart for A-Z/a-z only. Regexes without a \\p{..} run on the text itself, non-ASCII
whitespace read as a vertical tab. Python's `re` backtracks and alternates leftmost-first as ECMAScript does, so
running it on the same stand-in text gives the same words, quirks included.

Three splits are hand-written rules, not regexes, in llama.cpp (each named in the table by a marker pattern):
Kimi-K2's word rule, the digit grouping of AFMoE and Tiny Aya, and (equal to its regex) runs of newlines.
"""

from __future__ import annotations

import functools
import re

import regex as uregex  # Unicode general categories of a recent Unicode version (the stdlib's lags by years)

# Marker patterns for the hand-written rules; the pre-tokenizer table names them where llama.cpp does.
KIMI_K2 = r"\p{Han}+"
DIGIT_GROUPS = r"\p{AFMoE_digits}"  # digit runs cut into threes from the right, the rest of the run to the left
TINY_AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"  # the same rule in llama.cpp

# The stand-in bytes for non-ASCII characters, by category, and the ASCII members of each class in the regex.
_STAND_IN = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_OTHER, _SPACE = "\xd0", "\x0b"
_ASCII_MEMBERS = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}", "M": "", "S": r"\$\+<->\^`\|\~"}
# The classes llama.cpp rewrites: the letter subclasses all stand for "any letter".
_CLASSES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}
# Unicode's White_Space property (PropList.txt): what llama.cpp's \s and its hand-written rules call whitespace.
WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)
_CATEGORY = uregex.compile(r"(?P<L>\p{L})|(?P<N>\p{N})|(?P<M>\p{M})|(?P<P>\p{P})|(?P<S>\p{S})")
# Han (CJK ideograph) blocks, as Kimi-K2's rule reads \p{Han}
_HAN = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0x2CEB0, 0x2EBEF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


@functools.lru_cache(maxsize=None)
def category(ch: str) -> str:
    """'L', 'N', 'M', 'P', 'S', ' ' (whitespace) or '' (anything else: controls, separators, unassigned)."""
    if ord(ch) in WHITESPACE:
        return " "
    m = _CATEGORY.match(ch)
    return m.lastgroup if m else ""


def _is_han(ch: str) -> bool:
    c = ord(ch)
    return any(lo <= c <= hi for lo, hi in _HAN)


@functools.lru_cache(maxsize=None)
def _stand_in(ch: str) -> str:
    if ord(ch) < 128:
        return ch
    cat = category(ch)
    return _SPACE if cat == " " else _STAND_IN.get(cat, _OTHER)


@functools.lru_cache(maxsize=None)
def compile_rule(pattern: str) -> tuple[re.Pattern, bool]:
    """`pattern` as Python runs it, and whether it runs on the stand-in text (it names a \\p{..} class)."""
    uses_classes = any(f"\\p{{{name}}}" in pattern for name in _CLASSES)
    out, inside, i = [], False, 0
    while i < len(pattern):
        c = pattern[i]
        escaped = i > 0 and pattern[i - 1] == "\\"
        if c == "[" and not escaped:
            inside = True
        elif c == "]" and inside and not escaped:
            inside = False
        elif c == "$" and not inside and not escaped:
            c = r"\Z"  # ECMAScript's $ is the end of the input only (Python's also matches before a final \n)
        elif uses_classes and pattern.startswith("\\p{", i):
            name = pattern[i + 3 : pattern.index("}", i)]
            cls = _CLASSES[name]
            members = _STAND_IN[cls] + _ASCII_MEMBERS[cls]
            out.append(members if inside else f"[{members}]")
            i += len(name) + 4
            continue
        out.append(c)
        i += 1
    # ASCII: \s \d \b are C's (std::regex's) classes, not Unicode's
    return re.compile("".join(out), re.ASCII), uses_classes


def split(text: str, rules: tuple[str, ...]) -> list[str]:
    """`text` cut into words by `rules` in turn (empty pieces dropped: they make no tokens)."""
    bounds = [(0, len(text))] if text else []
    stand_in = plain = None
    for rule in rules:
        if rule == KIMI_K2:
            bounds = _apply(bounds, lambda s, e: _kimi_k2(text, s, e))
        elif rule in (DIGIT_GROUPS, TINY_AYA_DIGITS):
            bounds = _apply(bounds, lambda s, e: _digit_groups(text, s, e))
        else:
            pattern, uses_classes = compile_rule(rule)
            if uses_classes:
                stand_in = stand_in or "".join(map(_stand_in, text))
                subject = stand_in
            else:
                plain = plain or "".join(_SPACE if ord(c) in WHITESPACE and ord(c) > 127 else c for c in text)
                subject = plain
            bounds = _apply(bounds, lambda s, e: _regex_cuts(pattern, subject, s, e))
    return [text[s:e] for s, e in bounds]


def _apply(bounds, cut) -> list[tuple[int, int]]:
    """Each piece (start, end) replaced by the pieces `cut(start, end)` gives, as a list of end offsets."""
    out = []
    for s, e in bounds:
        prev = s
        for end in cut(s, e):
            if end > prev:
                out.append((prev, end))
                prev = end
        if prev < e:
            out.append((prev, e))
    return out


def _regex_cuts(pattern: re.Pattern, subject: str, start: int, end: int) -> list[int]:
    cuts = []
    for m in pattern.finditer(subject, start, end):
        cuts += [m.start(), m.end()]
    return cuts


def _digit_groups(text: str, start: int, end: int) -> list[int]:
    """Each run of numbers cut into threes from its right end. llama.cpp's rule emits its first group together with
    whatever precedes it in the piece (a later rule usually separates them), and so do we."""
    cuts, pos = [], start
    while pos < end:
        if category(text[pos]) != "N":
            pos += 1
            continue
        run = pos
        while pos < end and category(text[pos]) == "N":
            pos += 1
        first = run + (pos - run) % 3
        cuts += ([first] if first > run else []) + list(range(first + 3, pos + 1, 3))
    return cuts


_CONTRACTIONS = ("s", "t", "m", "d", "re", "ve", "ll")


def _contraction(text: str, pos: int, end: int) -> int:
    """Length of a contraction ('s 't 're 've 'm 'll 'd, any case) at `pos`, else 0."""
    if text[pos] != "'" or pos + 1 >= end:
        return 0
    one = text[pos + 1].lower()
    if one in ("s", "t", "m", "d"):
        return 2
    if pos + 2 < end and one + text[pos + 2].lower() in ("re", "ve", "ll"):
        return 3
    return 0


def _kimi_k2(text: str, start: int, end: int) -> list[int]:
    """Kimi-K2's split: Han runs; words of non-Han letters with one optional leading non-letter non-number and an
    optional trailing contraction; numbers in threes; punctuation runs with their trailing newlines; whitespace
    (to its last newline, else all but the last space before a word)."""

    def cat(p):
        return category(text[p]) if p < end else None

    def letter(p):
        return p < end and cat(p) == "L" and not _is_han(text[p])

    cuts, pos = [], start
    while pos < end:
        ch, c = text[pos], cat(pos)
        if _is_han(ch):
            while pos < end and _is_han(text[pos]):
                pos += 1
            cuts.append(pos)
            continue
        prefixed = ch not in "\r\n" and c not in ("L", "N")  # may lead a word
        if letter(pos) or (prefixed and letter(pos + 1)):
            pos += 1 if prefixed else 0
            while letter(pos):
                pos += 1
            if pos < end:
                pos += _contraction(text, pos, end)
            cuts.append(pos)
            continue
        if c == "N":
            run = pos
            while pos < end and cat(pos) == "N":
                pos += 1
                if pos - run == 3:
                    cuts.append(pos)
                    run = pos
            cuts.append(pos)
            continue
        nxt = cat(pos + 1) if ch == " " else c
        if nxt is not None and nxt not in (" ", "L", "N"):
            pos += ch == " "
            while pos < end and cat(pos) not in (" ", "L", "N"):
                pos += 1
            while pos < end and text[pos] in "\r\n":
                pos += 1
            cuts.append(pos)
            continue
        n, last_newline = 0, 0
        while pos + n < end and cat(pos + n) == " ":
            if text[pos + n] in "\r\n":
                last_newline = pos + n + 1
            n += 1
        if last_newline:
            pos = last_newline
        elif n > 1 and pos + n < end:
            pos += n - 1
        else:
            pos += max(n, 1)
        cuts.append(pos)
    return cuts
