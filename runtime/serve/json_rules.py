"""A JSON schema as llguidance lark rules whose numbers have a bounded length, so that a constrained answer always
can, and soon must, end.

JSON lets a number have any number of digits, and llguidance's JSON-schema compiler (1.9.1) follows it: its options
(`x-guidance`: separators, whitespace, `coerce_one_of`, `lenient`, string escapes) have no cap on a number's length,
`minimum`/`maximum` bound the integer part but never the fraction, and `multipleOf` (which does bound the fraction)
reads its value through a 17-digit float, so that most powers of ten fail as "too many digits". A sampled model
that keeps writing digits (`12.444444...`) then runs to its token limit inside the number. Here a number is a lark
terminal of our own: at most NUMBER_INTEGER_DIGITS digits before the point and NUMBER_FRACTION_DIGITS after it, no
exponent, intersected with regexes for the schema's bounds (`minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`, compared digit by digit as decimals, never through floats).

The rules are written only where a number can appear: a subschema with no number in it goes to llguidance whole
(`%json`), which keeps its coverage of strings, formats, enums and the rest. Objects (properties in the schema's
order, as llguidance writes them; the required ones always; other keys after them unless `additionalProperties` is
false), arrays (`items`, `minItems`, `maxItems`), `anyOf`/`oneOf` (as alternatives), type lists, and a schema of
any value (`{}`, whose numbers are bounded too) are written here. A number with `multipleOf` keeps llguidance's rule,
its integer part bounded by added limits (the multiple bounds the fraction). A schema using keywords this writer
does not know where numbers can appear (`$ref`, `allOf`, `patternProperties`, `minProperties`, `prefixItems`, ...)
goes to llguidance whole, its numbers unbounded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, InvalidOperation, localcontext
from typing import Any

# A number in a constrained answer has at most this many digits before its decimal point and after it (16 holds
# every integer a double holds exactly, 2**53, and then some; 16 fraction digits are a double's precision)
NUMBER_INTEGER_DIGITS = 16
NUMBER_FRACTION_DIGITS = 16

# keywords that say nothing about the value
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema", "$id"}
)
_NUMBER_KEYS = frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})
_ARRAY_KEYS = frozenset({"type", "items", "minItems", "maxItems"})

# a JSON string as llguidance writes one (no control characters, the escapes JSON allows)
_STRING = r'"(?:[^"\\\x{0}-\x{1f}]|\\(?:["\\\/bfnrt]|u[0-9a-fA-F]{4}))*"'


_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")


def regex_literal(text: str) -> str:
    """`text` as a regex matching it alone (inside lark's /.../)."""
    out = []
    for ch in text:
        if ch in _REGEX_SPECIAL:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif not ch.isprintable() or ch.isspace():
            out.append(f"\\x{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return "".join(out)


def number_regex(integer: bool = False) -> str:
    """A JSON number (an integer: no fraction) within the digit caps, as a regex."""
    return f"-?{_any_magnitude(integer)}"


def _digits(value: Decimal) -> tuple[str, str]:
    """A non-negative decimal's integer digits and its fraction's digits (no trailing zeros)."""
    text = format(value, "f")
    whole, _, fraction = text.partition(".")
    return whole.lstrip("0") or "0", fraction.rstrip("0")


def _class(low: str, high: str) -> str:
    return low if low == high else f"[{low}-{high}]"


# Every regex below writes numbers within the digit caps, an integer's with no fraction, so that the regexes of one
# number agree on where it can go on: llguidance then sees the end of a number whose bounds let it go no further
# (where regexes of other shapes intersect to nothing, it offered only the end of generation at that point)
_I, _F = NUMBER_INTEGER_DIGITS, NUMBER_FRACTION_DIGITS


def _any_fraction(integer: bool) -> str:
    return "" if integer else f"(?:\\.[0-9]{{1,{_F}}})?"


def _any_magnitude(integer: bool) -> str:
    return f"(?:0|[1-9][0-9]{{0,{_I - 1}}}){_any_fraction(integer)}"


def _fraction_at_most(bound: str) -> str:
    """Fraction digits (after the point, one to the cap) of 0.F <= 0.bound (bound: at most the cap's digits)."""
    options = [
        f"{bound[:k]}{_class('0', str(int(bound[k]) - 1))}[0-9]{{0,{_F - k - 1}}}"
        for k in range(len(bound))
        if bound[k] != "0"
    ]
    options += [bound[:k] for k in range(1, len(bound))]
    options.append(f"{bound}0{{0,{_F - len(bound)}}}" if bound else f"0{{1,{_F}}}")
    return "(?:" + "|".join(options) + ")"


def _fraction_at_least(bound: str) -> str:
    """Fraction digits (one to the cap) of 0.F >= 0.bound."""
    options = [
        f"{bound[:k]}{_class(str(int(bound[k]) + 1), '9')}[0-9]{{0,{_F - k - 1}}}"
        for k in range(len(bound))
        if bound[k] != "9"
    ]
    options.append(f"{bound}[0-9]{{0,{_F - len(bound)}}}" if bound else f"[0-9]{{1,{_F}}}")
    return "(?:" + "|".join(options) + ")"


def _magnitude_at_most(value: Decimal, integer: bool) -> str:
    """Unsigned number texts of a value <= `value` (>= 0, on the caps' grid)."""
    whole, fraction = _digits(value)
    n, options, rest = len(whole), [], _any_fraction(integer)
    if n > 1:  # fewer integer digits
        options.append(f"(?:0|[1-9][0-9]{{0,{n - 2}}}){rest}")
    for k in range(n):  # as many, smaller at digit k
        low = "1" if k == 0 and n > 1 else "0"
        if int(whole[k]) > int(low):
            options.append(f"{whole[:k]}{_class(low, str(int(whole[k]) - 1))}[0-9]{{{n - k - 1}}}{rest}")
    options.append(whole if integer else f"{whole}(?:\\.{_fraction_at_most(fraction)})?")  # the same integer part
    return "(?:" + "|".join(options) + ")"


def _magnitude_at_least(value: Decimal, integer: bool) -> str:
    """Unsigned number texts of a value >= `value` (>= 0, on the caps' grid)."""
    whole, fraction = _digits(value)
    n, options, rest = len(whole), [], _any_fraction(integer)
    if n < _I:  # more integer digits
        options.append(f"[1-9][0-9]{{{n},{_I - 1}}}{rest}")
    for k in range(n):  # as many, greater at digit k
        if whole[k] != "9":
            options.append(f"{whole[:k]}{_class(str(int(whole[k]) + 1), '9')}[0-9]{{{n - k - 1}}}{rest}")
    if integer:
        options.append(whole)
    else:
        options.append(f"{whole}(?:\\.{_fraction_at_least(fraction)})" + ("" if fraction else "?"))
    return "(?:" + "|".join(options) + ")"


def _at_most(value: Decimal, integer: bool) -> str:
    if value >= 0:
        return f"(?:-{_any_magnitude(integer)}|{_magnitude_at_most(value, integer)})"
    return f"-{_magnitude_at_least(-value, integer)}"


def _at_least(value: Decimal, integer: bool) -> str:
    if value <= 0:
        return f"(?:-{_magnitude_at_most(-value, integer)}|{_any_magnitude(integer)})"
    return _magnitude_at_least(value, integer)


def _bound(schema: dict[str, Any], key: str) -> Decimal | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'{key}' is not a number")
    try:
        return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation as e:
        raise ValueError(f"'{key}' is not a finite number") from e


def _number_range(schema: dict[str, Any], integer: bool) -> tuple[Decimal | None, Decimal | None]:
    """The least and the greatest number the caps allow (an integer, or a multiple of the last fraction digit's
    unit) within the schema's bounds; None where no bound is tighter than the caps. ValueError when there is none:
    a grammar with no way to finish."""
    low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
    low_open, high_open = _bound(schema, "exclusiveMinimum"), _bound(schema, "exclusiveMaximum")
    unit = Decimal(1) if integer else Decimal(10) ** -NUMBER_FRACTION_DIGITS
    cap = Decimal(10) ** NUMBER_INTEGER_DIGITS - unit
    least, most = -cap, cap
    with localcontext() as exact:  # numbers of the caps' 32 digits, and bounds of any size, without rounding
        exact.prec = 1000
        if low is not None:
            least = max(least, (low / unit).to_integral_value(rounding=ROUND_CEILING) * unit)
        if low_open is not None:
            least = max(least, ((low_open / unit).to_integral_value(rounding=ROUND_FLOOR) + 1) * unit)
        if high is not None:
            most = min(most, (high / unit).to_integral_value(rounding=ROUND_FLOOR) * unit)
        if high_open is not None:
            most = min(most, ((high_open / unit).to_integral_value(rounding=ROUND_CEILING) - 1) * unit)
    if least > most:
        raise ValueError(
            f"no number of at most {NUMBER_INTEGER_DIGITS} integer and {NUMBER_FRACTION_DIGITS} fraction digits "
            f"meets the bounds of {json.dumps(schema)}"
        )
    return (least if least > -cap else None), (most if most < cap else None)


def bounded_number_regexes(schema: dict[str, Any], integer: bool) -> list[str]:
    """Regexes a number of `schema` must all match: the digit caps' and one per bound tighter than the caps (on the
    caps' grid of numbers, an exclusive bound is an inclusive one a unit inside it). ValueError when no number
    within the caps meets the bounds."""
    least, most = _number_range(schema, integer)
    regexes = [number_regex(integer)]
    if least is not None:
        regexes.append(_at_least(least, integer))
    if most is not None:
        regexes.append(_at_most(most, integer))
    return regexes


def _holds_number(schema: Any) -> bool:
    """Whether a value of `schema` may be or hold a number (where it cannot, llguidance compiles it unchanged)."""
    if schema is True:
        return True
    if not isinstance(schema, dict) or "const" in schema or "enum" in schema:
        return False
    if any(isinstance(schema.get(k), list) and any(map(_holds_number, schema[k])) for k in ("anyOf", "oneOf")):
        return True
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & {"number", "integer"} or (kind is None and not set(schema) & {"properties", "items", "anyOf", "oneOf"}):
        return True
    if "object" in kinds or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        unlisted = set(schema.get("required") or ()) - set(properties)  # required keys of any value
        extra = schema.get("additionalProperties", True)
        return bool(unlisted) or any(_holds_number(v) for v in [*properties.values(), extra])
    if "array" in kinds:
        return _holds_number(schema.get("items", True))
    return False


class SchemaRules:
    """Writes JSON schemas into a lark grammar's `rules` (shared with the grammar around them: names here begin
    with `j`/`J`), and gives the expression of each. `embed` writes a schema llguidance compiles itself (`%json`)."""

    def __init__(self, rules: list[str], embed: Callable[[dict[str, Any]], str]) -> None:
        self.rules, self.embed = rules, embed
        self._any: str | None = None

    def value(self, schema: Any) -> str:
        """The expression of a value of `schema`."""
        written = self._written(schema)
        return written if written is not None else self.embed(schema)

    def _rule(self, body: str, terminal: bool = False) -> str:
        name = f"{'J' if terminal else 'j'}{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def _written(self, schema: Any) -> str | None:
        """The expression of `schema` written here, or None when llguidance compiles it unchanged (no number can
        appear in it, or it uses a keyword this writer does not know)."""
        if not _holds_number(schema):
            return None
        if schema is True or schema == {}:
            return self.any_value()
        keys = set(schema) - _ANNOTATIONS
        for choice in ("anyOf", "oneOf"):
            if isinstance(schema.get(choice), list) and schema[choice]:
                rest = {k: v for k, v in schema.items() if k != choice}
                subs = [{**rest, **sub} if isinstance(sub, dict) else sub for sub in schema[choice]]
                written = [self._written(sub) for sub in subs]
                if all(w is None for w in written) or keys - {choice, "type"}:
                    return None
                return "(" + " | ".join(w if w is not None else self.embed(s) for w, s in zip(written, subs)) + ")"
        if "const" in keys or "enum" in keys:
            return None
        kind = schema.get("type")
        if isinstance(kind, list):
            subs = [{**schema, "type": k} for k in kind]
            written = [self._written(sub) for sub in subs]
            if all(w is None for w in written):
                return None
            return "(" + " | ".join(w if w is not None else self.embed(s) for w, s in zip(written, subs)) + ")"
        if kind in ("number", "integer"):
            return self._number(schema, kind == "integer")
        if kind == "object" or (kind is None and "properties" in keys):
            return self._object(schema) if keys <= _OBJECT_KEYS else None
        if kind == "array":
            return self._array(schema) if keys <= _ARRAY_KEYS and isinstance(schema.get("items", {}), dict) else None
        if kind is None and not keys:
            return self.any_value()
        return None

    def _number(self, schema: dict[str, Any], integer: bool) -> str | None:
        if "multipleOf" in schema:  # llguidance's rule, which the multiple bounds after the point; bounded before
            cap = 10**NUMBER_INTEGER_DIGITS - 1
            low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
            low_json = -cap if low is None or low < -cap else schema["minimum"]
            return self.embed(
                {**schema, "minimum": low_json, "maximum": cap if high is None or high > cap else schema["maximum"]}
            )
        if set(schema) - _ANNOTATIONS - _NUMBER_KEYS:
            return None
        regexes = bounded_number_regexes(schema, integer)
        return self._rule(" & ".join(f"/{r}/" for r in regexes), True)

    def _pairs(self, named: list[tuple[str, Any]], required: set[str], extra: Any) -> str:
        """The members of an object: `named` (key, schema) in order, the `required` ones always, then (unless
        `extra` is False) other keys with values of the schema `extra`, a comma between two."""
        items = [(f'{json.dumps(json.dumps(key))} ":" {self.value(sub)}', key in required) for key, sub in named]
        if extra is not False:
            others = "|".join(regex_literal(json.dumps(key)) for key, _ in named)
            key = self._rule(f"/{_STRING}/" + (f" & ~/{others}/" if others else ""), True)
            member = self._rule(f'{key} ":" {self.value({} if extra is True or extra is None else extra)}')
            items.append((f'{member} ("," {member})*', False))
        # after[first]: the members from one on, `first` when none was written before them (no comma to open with)
        after = {True: '""', False: '""'}
        for item, needed in reversed(items):
            written = {first: (item if first else f'"," {item}') + f" {after[False]}" for first in (True, False)}
            after = {
                first: self._rule(written[first] if needed else f"({written[first]}) | {after[first]}")
                for first in (True, False)
            }
        return after[True]

    def _object(self, schema: dict[str, Any]) -> str:
        properties = schema.get("properties") or {}
        required = {k for k in schema.get("required") or () if isinstance(k, str)}
        named = list(properties.items()) + [(k, {}) for k in sorted(required) if k not in properties]
        return self._rule(f'"{{" {self._pairs(named, required, schema.get("additionalProperties"))} "}}"')

    def _array(self, schema: dict[str, Any]) -> str:
        item = self._rule(self.value(schema.get("items", {})))
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) < max(low, 1):
            if int(high) < low:
                raise ValueError(f"no array meets the bounds of {json.dumps(schema)}")
            return '"[" "]"'
        more = f'("," {item})*' if high is None else '""'
        for _ in range(max(0, (int(high) if high is not None else low) - max(low, 1))):
            more = f'("," {item} {more})?'
        items = " ".join([item] + ['"," ' + item] * (max(low, 1) - 1) + [more])
        return self._rule(f'"[" {items} "]"' if low else f'"[" "]" | "[" {items} "]"')

    def any_value(self) -> str:
        """Any JSON value, its numbers within the caps."""
        if self._any is None:
            at = len(self.rules)
            self._any = name = f"j{at}"
            self.rules.append("")  # the name's place, filled below (the rule refers to itself)
            string = self._rule(f"/{_STRING}/", True)
            number = self._rule(f"/{number_regex()}/", True)
            member = self._rule(f'{string} ":" {name}')
            body = (
                f'"{{" "}}" | "{{" {member} ("," {member})* "}}" | "[" "]" | "[" {name} ("," {name})* "]" '
                f'| {string} | {number} | "true" | "false" | "null"'
            )
            self.rules[at] = f"{name}: {body}"
        return self._any
